"""The seed models, training step and generation: the cases, implementations and targets are
``transformer_kernels.bench.suites.models``'s (see conftest.py)."""

SUITE = "models"


def test_models(group, measure):
    measure(group)
