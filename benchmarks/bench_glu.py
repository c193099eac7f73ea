"""The GLU convolution against the reference and its peers: the cases, implementations and targets are
``transformer_kernels.bench.suites.glu``'s (see conftest.py)."""

SUITE = "glu"


def test_glu(group, measure):
    measure(group)
