"""Fused QKV projection vs the seeds' three linears, nn.MultiheadAttention's
packed linear + chunk, and (CUDA) a bare torch.matmul of the same GEMM.

Implementations:

- ``eager`` (CPU) / ``triton`` (CUDA): ``transformer_kernels.qkv_projection``.
- ``cuda`` (CUDA): the same on the CUDA extension's kernels (unmeasured when it is not built).
- ``reference``: the seeds' path, three ``nn.Linear``-style weights (separate
  leaf tensors), each ``F.linear`` + ``view`` + ``transpose`` + ``contiguous``.
- ``mha_packed``: ``F.linear`` with the packed weight, ``chunk(3)``, ``view`` +
  ``transpose`` (no copy).
- ``cublas_matmul`` (CUDA): ``torch.matmul(x, weight.t())`` on ``[T, E]``, the
  same GEMM without bias or head split: the speed of light.

Directions: ``fwd``, ``bwd`` and ``fwd+bwd`` (gradients for x, weights and
biases from one contiguous ``[B, H, L, Dh]`` gradient per output, as
attention's backward returns them).  Each (case, direction) is one group whose
implementations are timed interleaved (``benchmarks/interleaved.py``).
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, timed_call

import transformer_kernels as tk

OP = "qkv_projection"
CUDA = DEVICE.type == "cuda"
DTYPE = torch.float16 if CUDA else torch.float32
OURS = "triton" if CUDA else "eager"

# (name, B, L, E, H).  Seeds: batch 128, lengths 16-64, E = 512, 8 heads.
# Large: 4k-64k tokens, E 512-4096 (head dim 64 or 128).
SEEDS_CASES = [("seeds_B128_L16_E512", 128, 16, 512, 8), ("seeds_B128_L32_E512", 128, 32, 512, 8),
               ("seeds_B128_L64_E512", 128, 64, 512, 8)]
LARGE_CASES = [("tok4k_E1024", 4, 1024, 1024, 16), ("tok16k_E2048", 8, 2048, 2048, 16),
               ("tok64k_E512", 32, 2048, 512, 8), ("tok64k_E4096", 16, 4096, 4096, 32)]
# The CPU runs a cheap subset.
CPU_CASES = [SEEDS_CASES[0], SEEDS_CASES[2], ("tok4k_E1024", 4, 1024, 1024, 16)]
CASES = SEEDS_CASES + LARGE_CASES if CUDA else CPU_CASES

IMPLS = [OURS, "cuda", "reference", "mha_packed", "cublas_matmul"] if CUDA else [OURS, "reference", "mha_packed"]
DIRECTIONS = ["fwd", "bwd", "fwd+bwd"]

TARGETS = (
    [
        {"op": OP, "case": name, "direction": direction, "impl": "eager", "baseline": "reference",
         "min_speedup": 1.0, "device": "cpu"}
        for name, *_ in CPU_CASES
        for direction in DIRECTIONS
    ]
    + [
        {"op": OP, "case": name, "direction": "fwd", "impl": impl, "baseline": "cublas_matmul",
         "min_speedup": 0.9, "device": "cuda"}
        for impl in ("triton", "cuda")
        for name, *_ in SEEDS_CASES + LARGE_CASES
    ]
    + [
        {"op": OP, "case": name, "direction": "fwd+bwd", "impl": impl, "baseline": "reference",
         "min_speedup": 1.3, "device": "cuda"}
        for impl in ("triton", "cuda")
        for name, *_ in SEEDS_CASES + LARGE_CASES
    ]
)


def _make_case(batch, seq_len, embed_dim, num_heads, impl):
    """Returns ``(forward, inputs)``: ``forward()`` gives the outputs, ``inputs`` the leaves to differentiate."""
    x = torch.randn(batch, seq_len, embed_dim, device=DEVICE, dtype=DTYPE, requires_grad=True)
    weight = (torch.randn(3 * embed_dim, embed_dim, device=DEVICE, dtype=DTYPE) / embed_dim**0.5).requires_grad_()
    bias = torch.randn(3 * embed_dim, device=DEVICE, dtype=DTYPE, requires_grad=True)
    head_dim = embed_dim // num_heads

    def head_split(y):
        return y.view(batch, seq_len, num_heads, head_dim).transpose(1, 2)

    if impl in ("eager", "triton", "cuda"):
        return (lambda: tk.qkv_projection(x, weight, bias, num_heads=num_heads, backend=impl)), (x, weight, bias)
    if impl == "reference":
        weights = [w.detach().clone().requires_grad_() for w in weight.chunk(3)]
        biases = [b.detach().clone().requires_grad_() for b in bias.chunk(3)]
        return (
            lambda: tuple(head_split(F.linear(x, w, b)).contiguous() for w, b in zip(weights, biases)),
            (x, *weights, *biases),
        )
    if impl == "mha_packed":
        return (lambda: tuple(head_split(y) for y in F.linear(x, weight, bias).chunk(3, dim=-1))), (x, weight, bias)
    x2d = x.detach().view(-1, embed_dim).requires_grad_()
    return (lambda: (torch.matmul(x2d, weight.t()),)), (x2d, weight)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_qkv_projection(compare, case, direction):
    name, batch, seq_len, embed_dim, num_heads = case

    def factory(impl):
        forward, inputs = _make_case(batch, seq_len, embed_dim, num_heads, impl)
        return timed_call(lambda: forward, direction, inputs)

    factories = {impl: functools.partial(factory, impl) for impl in IMPLS}
    compare(factories, op=OP, case=name, direction=direction, ours=OURS)
