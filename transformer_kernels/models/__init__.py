"""The two seed model families on the fused ops, with cached greedy and beam-search generation."""

from .generation import IncrementalDecoder, generate

__all__ = ["IncrementalDecoder", "generate"]
