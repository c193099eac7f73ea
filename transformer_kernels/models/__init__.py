"""The two seed model families on the fused ops, with cached greedy and beam-search generation."""

from .generation import IncrementalDecoder, generate
from .transformer import Transformer

__all__ = ["IncrementalDecoder", "Transformer", "generate"]
