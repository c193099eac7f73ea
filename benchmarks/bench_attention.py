"""Masked attention against the reference and its peers: the cases, implementations and targets are
``transformer_kernels.bench.suites.attention``'s (see conftest.py)."""

SUITE = "attention"


def test_attention(group, measure):
    measure(group)
