"""The two seed model families on the fused ops, with cached greedy and beam-search generation."""

from .conv_seq2seq import ConvSeq2Seq
from .generation import IncrementalDecoder, RedecodingDecoder, generate
from .transformer import Transformer

__all__ = ["ConvSeq2Seq", "IncrementalDecoder", "RedecodingDecoder", "Transformer", "generate"]
