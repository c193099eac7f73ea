"""Fused QKV projection as PyTorch ops: the CPU path and the fallback everywhere.

Forward is a GEMM with the packed weight, ``[T, E] @ [E, n*E] + bias``,
whose ``[T, n*E]`` result is then split into heads, copied once into each
output's contiguous ``[*batch, H, L, Dh]`` tensor, the layout every backend
returns; on a CPU chunk by chunk of tokens, so the split reads what the GEMM just
wrote from the cache.  The seeds' path does the same copy per projection on top of
three GEMMs.

Backward needs the head-split gradients as token matrices.  When the strides
allow views (gradients laid out ``[*batch, L, H, Dh]``) it multiplies them in
place, each projection's gradient its own ``[T, E]`` GEMM operand: ``grad_x``
accumulates the n products of depth ``E``, and the row blocks of
``grad_weight`` (depth ``T``) read the gradients and ``x`` transposed,
contraction-major, which :func:`.onednn.linear` sums in blocks.  Otherwise (the
usual contiguous ``[*batch, H, L, Dh]``) one copy packs them: for oneDNN's
GEMM into one ``[n, T, E]`` tensor, multiplied projection by projection as
above (one ``[T, n*E]`` product for ``grad_x``, of depth ``3E``, erred 2.2x
torch's float32 (RMS) on oneDNN's GEMM at the seeds' sizes, and ran 4-9%
slower; these err at most 1.7x); for the BLAS into one ``[T, n*E]`` matrix
``G``, whose two products ``G @ W`` and ``G.T @ x`` are those of torch's own
``F.linear`` backward (1.24-1.36x the per-projection products at the small
Transformer's T = 640, E = 128; 1.02-1.05x at the seeds' T = 5120, E = 512).

The GEMMs run through :func:`.onednn.linear`: oneDNN's GEMM where it outruns
the BLAS on this CPU, else ``F.linear``.  (A 1x1 ``F.conv2d`` on the tokens
viewed as a channels-last image reaches no oneDNN kernel: torch 2.13's CPU
wheel dispatches it to ``slow_conv2d``, the BLAS GEMM.)
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ...ops.qkv import QkvProjectionArgs
from . import onednn

__all__ = ["unsupported_reason", "forward", "backward"]


def unsupported_reason(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], args: QkvProjectionArgs
) -> Optional[str]:
    return None


def forward(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], args: QkvProjectionArgs
) -> list[torch.Tensor]:
    *batch, seq_len, embed_dim = x.shape
    num_seqs = math.prod(batch)  # not -1 in a view: a call may have no tokens
    num_proj = weight.shape[0] // embed_dim
    num_heads = args.num_heads
    head_dim = embed_dim // num_heads
    chunk_tokens = max(1, _CHUNK_ELEMENTS // weight.shape[0])
    output_shape = args.output_shape(x)
    if x.numel() <= chunk_tokens * embed_dim or x.device.type != "cpu":
        # One piece (a decoding step, the seeds' short batches, any GPU input): the fewest host-side
        # ops.  On a GPU the chunks keep nothing in a cache and each costs launches: on an H200
        # (2026-11-27 report, bfloat16, E = 512) the chunked path took 0.37 and 0.64 ms at 2 and 4
        # times the tokens of a 0.11 ms call in one piece, where torch's matmul took alike at all three.
        # Each output is a tensor of its own, not a view (autograd refuses in-place changes to a view
        # that an op's forward made), and outputs of one op must not share storage: so each is a
        # copy, even where a head-split view happens to be contiguous already.  One unbind_copy
        # makes all of them (3 clones cost a decoding step 4.5 us more).
        packed = onednn.linear(x, weight, bias).view(num_seqs, seq_len, num_proj, num_heads, head_dim)
        outputs = torch.unbind_copy(packed.permute(2, 0, 3, 1, 4).reshape(num_proj, *output_shape), 0)
        return list(outputs)
    sequences = x.reshape(num_seqs, seq_len, embed_dim)
    outputs = [x.new_empty(output_shape) for _ in range(num_proj)]
    for seqs, positions in _token_chunks(num_seqs, seq_len, chunk_tokens):
        packed = onednn.linear(sequences[seqs, positions], weight, bias)
        packed = packed.view(*packed.shape[:2], num_proj, num_heads, head_dim)
        for i, output in enumerate(outputs):
            output.view(num_seqs, num_heads, seq_len, head_dim)[seqs, :, positions].copy_(
                packed.select(2, i).transpose(1, 2))
    return outputs


# The packed product [T, n*E] is made and split into heads in chunks of about this many elements
# (16 MiB of float32): the GEMM writes a chunk and the head split reads it back from the cache.  In
# one piece, 8192 tokens' product is 48 MiB, past the cache, and the split read it from memory:
# 0.93x the seeds' three GEMMs (whose 16 MiB products each stay cached) at B=128, L=64, E=512;
# in chunks of 8, 16 or 32 MiB 1.05-1.06x (1 thread, interleaved, median of 15 rounds).
_CHUNK_ELEMENTS = 1 << 22


def _token_chunks(num_seqs: int, seq_len: int, tokens: int):
    """``(sequences, positions)`` slices covering ``[num_seqs, seq_len]`` tokens, about ``tokens``
    at a time: whole sequences when they are shorter, else pieces of one sequence (so that every
    chunk of a contiguous input is contiguous)."""
    if seq_len <= tokens:
        step = tokens // seq_len
        for first in range(0, num_seqs, step):
            yield slice(first, min(first + step, num_seqs)), slice(None)
        return
    for seq in range(num_seqs):
        for first in range(0, seq_len, tokens):
            yield slice(seq, seq + 1), slice(first, min(first + tokens, seq_len))


def _as_token_matrix(grad: torch.Tensor, embed_dim: int) -> Optional[torch.Tensor]:
    """``[*batch, H, L, Dh]`` -> ``[T, E]`` as a view, or ``None`` when the strides need a copy."""
    try:
        return grad.transpose(-3, -2).view(-1, embed_dim)
    except RuntimeError:
        return None


def _pack(grads: list[torch.Tensor], embed_dim: int) -> torch.Tensor:
    """The n head-split gradients ``[*batch, H, L, Dh]`` copied into one ``[n, T, E]`` tensor."""
    return torch.stack([g.transpose(-3, -2) for g in grads]).reshape(len(grads), -1, embed_dim)


def _packed_backward(grads: list[torch.Tensor], x2d: torch.Tensor, weight: torch.Tensor, has_bias: bool,
                     needs_grad_x: bool, needs_grad_weight: bool, needs_grad_bias: bool, x_shape: torch.Size):
    """:func:`backward` on the BLAS from one ``[T, n*E]`` copy ``G`` of the head-split gradients:
    ``grad_x = G @ W``, ``grad_weight = G.T @ x``, ``grad_bias = G.sum(0)``."""
    embed_dim = x2d.shape[1]
    packed = torch.stack([g.transpose(-3, -2) for g in grads], dim=-3).reshape(-1, len(grads) * embed_dim)
    grad_x = torch.mm(packed, weight).view(x_shape) if needs_grad_x else x2d.new_empty(0)
    grad_weight = torch.mm(packed.t(), x2d) if needs_grad_weight else x2d.new_empty(0)
    grad_bias = packed.sum(0) if has_bias and needs_grad_bias else x2d.new_empty(0)
    return grad_x, grad_weight, grad_bias


def backward(
    grads: list[torch.Tensor],
    x: torch.Tensor,
    weight: torch.Tensor,
    args: QkvProjectionArgs,
    has_bias: bool,
    needs_grad_x: bool,
    needs_grad_weight: bool,
    needs_grad_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    embed_dim = x.shape[-1]
    x2d = x.reshape(-1, embed_dim)
    matrices = [_as_token_matrix(g, embed_dim) for g in grads]
    if any(m is None for m in matrices):
        # Contiguous [*batch, H, L, Dh] gradients (what attention's backward returns): one copy.
        if not onednn.serves(x2d, weight[:embed_dim]):
            return _packed_backward(grads, x2d, weight, has_bias, needs_grad_x, needs_grad_weight, needs_grad_bias,
                                    x.shape)
        matrices = _pack(grads, embed_dim).unbind()
    blocks = [(m, weight[i * embed_dim : (i + 1) * embed_dim]) for i, m in enumerate(matrices)]

    grad_x = x.new_empty(0)
    if needs_grad_x:
        grad_x = onednn.linear(blocks[0][0], blocks[0][1].t())
        for g, w in blocks[1:]:
            grad_x.add_(onednn.linear(g, w.t()))
        grad_x = grad_x.view(x.shape)

    grad_weight = x.new_empty(0)
    if needs_grad_weight:
        products = [onednn.linear(g.t(), x2d.t()) for g, _ in blocks]
        grad_weight = products[0] if len(products) == 1 else torch.cat(products)

    grad_bias = x.new_empty(0)
    if has_bias and needs_grad_bias:
        grad_bias = torch.cat([g.sum(0) for g, _ in blocks])
    return grad_x, grad_weight, grad_bias
