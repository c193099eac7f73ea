"""Compositions of PyTorch ops: the CPU path and the fallback for every op."""
