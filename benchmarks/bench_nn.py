"""transformer_kernels.nn.MultiheadAttention against the reference and its peers: the cases, implementations and targets are
``transformer_kernels.bench.suites.nn``'s (see conftest.py)."""

SUITE = "nn"


def test_nn(group, measure):
    measure(group)
