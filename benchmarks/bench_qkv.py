"""The fused QKV projection against the reference and its peers: the cases, implementations and targets are
``transformer_kernels.bench.suites.qkv``'s (see conftest.py)."""

SUITE = "qkv"


def test_qkv(group, measure):
    measure(group)
