"""Winograd F(2, 3): a kernel-size-3 convolution with two thirds of the GEMM work.

The GLU convolution's GEMMs are compute bound on a CPU, so every implementation
that does the same multiplications (oneDNN's convolution, the im2col GEMM,
per-tap GEMMs) runs at the same speed.  Winograd's minimal filtering does fewer:
two outputs of a 3-tap filter from 4 products instead of 6.  Per tile of two
output positions ``s = 2j, 2j + 1`` and its four input positions ``d0..d3``::

    V = Bᵀ d:  V0 = d0 - d2,  V1 = d1 + d2,  V2 = d2 - d1,  V3 = d1 - d3     (input transform)
    U = G w:   U0 = w0,  U1 = (w0 + w1 + w2) / 2,  U2 = (w0 - w1 + w2) / 2,  U3 = w2
    M_i = V_i @ U_iᵀ                                  (4 GEMMs of half the rows: 2/3 of 3 taps)
    y_2j   = M0 + M1 + M2,    y_2j+1 = M1 - M2 - M3                          (Aᵀ M)

with channels as the GEMMs' inner dimension, so ``M_i`` is ``[B * tiles, C_out]``.
The backward passes reuse the identity:

* **input gradient**: a correlation of the output gradient (zero-padded by
  ``2 - pad``) with the filter flipped and transposed, whose transform is
  ``U3ᵀ, U1ᵀ, U2ᵀ, U0ᵀ``: the same four matrices, read in another order;
* **weight gradient**: F(3, 2), the transposed algorithm: with ``g0, g1`` a
  tile's two output gradients, ``A g = (g0, g0 + g1, g0 - g1, -g1)`` and
  ``P_i = (A g)_iᵀ @ V_i``, the taps are ``Gᵀ P``:
  ``dw0 = P0 + (P1 + P2) / 2``, ``dw1 = (P1 - P2) / 2``, ``dw2 = (P1 + P2) / 2 - P3``.

Rounding: the transforms add at most three terms and halve, so the error is
about twice the direct GEMM's (measured ~2e-6 against float64 at 1536-term
sums in float32), well inside float32's test tolerances.

Infinities: the transforms turn an inf into NaN (inf - inf in the output's
sums) and sums of inputs near the dtype's limit overflow; the caller
(:mod:`.glu_conv`) computes such a result again by the direct GEMMs.

Tensors here are channel-last rows ``[B, L, C]``; an odd output length gets a
phantom last position, computed from finite padding and cut off.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["KERNEL_SIZE", "tiles", "padded_rows", "convolve", "input_gradient", "weight_gradient"]

KERNEL_SIZE = 3
_TILE = 2  # output positions per tile
_FILTER_TRANSFORM = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])  # G


def tiles(length_out: int) -> int:
    return -(-length_out // _TILE)


def padded_rows(rows: torch.Tensor, pad_left: int, padded_length: int, pad_value: float) -> torch.Tensor:
    """A contiguous ``[B, padded_length, C]``: ``pad_value``, then ``rows`` ``[B, L, C]`` (any
    layout) from position ``pad_left``, then ``pad_value`` up to ``padded_length``."""
    batch, length, channels = rows.shape
    padded = rows.new_empty(batch, padded_length, channels)
    padded[:, :pad_left].fill_(pad_value)
    padded[:, pad_left + length :].fill_(pad_value)
    padded[:, pad_left : pad_left + length].copy_(rows)
    return padded


def _input_transform(padded: torch.Tensor, tile_count: int) -> torch.Tensor:
    """``Bᵀ d`` for every tile of ``padded`` ``[B, 2 * tiles + 2, C]``: ``[4, B * tiles, C]``."""
    batch, _, channels = padded.shape
    d0, d1, d2, d3 = (padded[:, j : j + _TILE * tile_count : _TILE] for j in range(4))
    transformed = padded.new_empty(4, batch, tile_count, channels)
    torch.sub(d0, d2, out=transformed[0])
    torch.add(d1, d2, out=transformed[1])
    torch.sub(d2, d1, out=transformed[2])
    torch.sub(d1, d3, out=transformed[3])
    return transformed.view(4, batch * tile_count, channels)


def transformed_weight(weight: torch.Tensor) -> torch.Tensor:
    """``G w`` for ``weight`` ``[C_out, C_in, 3]``: ``[4, C_out, C_in]``."""
    # One [4, 3] @ [3, C_out * C_in] GEMM reads the taps in place; strided elementwise ops cost 2x.
    channels_out, channels_in, _ = weight.shape
    transformed = weight.new_empty(4, channels_out, channels_in)
    torch.mm(_FILTER_TRANSFORM.to(weight.dtype), weight.reshape(-1, KERNEL_SIZE).t(), out=transformed.view(4, -1))
    return transformed


def _correlate(
    rows: torch.Tensor,
    weights: Sequence[torch.Tensor],
    bias: Optional[torch.Tensor],
    pad_left: int,
    pad_right: int,
    pad_value: float,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``y[b, s] = bias + Σ_t xpad[b, s + t] @ W_t`` for ``rows`` ``[B, L, C_in]`` (any layout)
    padded with ``pad_value``; ``weights`` are the four transformed ``[C_in, C_out]`` matrices
    (``U_iᵀ``).  Returns ``[B, L_out, C_out]``: ``out`` if given (a ``[B, 2 * tiles, C_out]``
    tensor, of which the first ``L_out`` positions are the result), else a fresh one, cut to
    ``L_out`` (a view, not contiguous for an odd ``L_out``)."""
    batch, length, _ = rows.shape
    length_out = pad_left + length + pad_right - KERNEL_SIZE + 1
    tile_count = tiles(length_out)
    # The last tile's phantom position (odd L_out) reads padding beyond pad_right.
    padded = padded_rows(rows, pad_left, _TILE * tile_count + KERNEL_SIZE - 1, pad_value)
    transformed = _input_transform(padded, tile_count)
    channels_out = weights[0].shape[1]
    products = rows.new_empty(4, batch * tile_count, channels_out)
    for i, weight in enumerate(weights):
        if i == 1 and bias is not None:  # M1 enters both outputs once: the bias rides on it
            torch.addmm(bias, transformed[i], weight, out=products[i])
        else:
            torch.mm(transformed[i], weight, out=products[i])
    m0, m1, m2, m3 = products.view(4, batch, tile_count, channels_out)
    if out is None:
        out = rows.new_empty(batch, _TILE * tile_count, channels_out)
    pairs = out.view(batch, tile_count, _TILE, channels_out)
    even, odd = pairs[:, :, 0], pairs[:, :, 1]
    torch.add(m1, m2, out=even)
    even.add_(m0)
    torch.sub(m1, m2, out=odd)
    odd.sub_(m3)
    return out[:, :length_out]


def convolve(rows: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], pad_left: int,
             pad_right: int, pad_value: float) -> torch.Tensor:
    """``conv1d(pad(x), weight, bias)`` for ``rows`` = ``x`` as ``[B, L, C_in]`` (any layout) and
    ``weight`` ``[C_out, C_in, 3]``: ``[B, L_out, C_out]``, a view of a contiguous
    ``[B, 2 * tiles(L_out), C_out]``."""
    return _correlate(rows, [u.t() for u in transformed_weight(weight)], bias, pad_left, pad_right, pad_value)


def input_gradient(grad_rows: torch.Tensor, weight: torch.Tensor, pad_left: int, pad_right: int,
                   grad_input_rows: torch.Tensor) -> torch.Tensor:
    """Writes the gradient of :func:`convolve`'s input, ``[B, L, C_in]``, into ``grad_input_rows``
    (any layout) and returns it, for ``grad_rows`` ``[B, L_out, C_out]``: the correlation of
    ``grad_rows``, zero-padded by ``2 - pad``, with the flipped, transposed filter, whose
    transform is ``U3ᵀ, U1ᵀ, U2ᵀ, U0ᵀ``."""
    transformed = transformed_weight(weight)
    length = grad_input_rows.shape[1]
    # The product tiles land in place when they cover the rows exactly.
    in_place = grad_input_rows.is_contiguous() and length % _TILE == 0
    rows = _correlate(grad_rows, [transformed[i] for i in (3, 1, 2, 0)], None, KERNEL_SIZE - 1 - pad_left,
                      KERNEL_SIZE - 1 - pad_right, 0.0, out=grad_input_rows if in_place else None)
    return grad_input_rows if in_place else grad_input_rows.copy_(rows)


def weight_gradient(grad_rows: torch.Tensor, rows: torch.Tensor, pad_left: int, pad_right: int,
                    pad_value: float) -> torch.Tensor:
    """``dw[:, :, t] = Σ_{b,s} grad_rows[b, s]ᵀ xpad[b, s + t]``: ``[C_out, C_in, 3]`` for
    ``grad_rows`` ``[B, L_out, C_out]`` and ``rows`` ``[B, L, C_in]`` (both any layout)."""
    batch, _, channels_in = rows.shape
    length_out, channels_out = grad_rows.shape[1], grad_rows.shape[2]
    tile_count = tiles(length_out)
    padded = padded_rows(rows, pad_left, _TILE * tile_count + KERNEL_SIZE - 1, pad_value)
    transformed = _input_transform(padded, tile_count)
    # A g per tile, the phantom position's gradient zero: (g0, g0 + g1, g0 - g1, g1), P3's sign below.
    grad_padded = padded_rows(grad_rows, 0, _TILE * tile_count, 0.0)
    g0, g1 = grad_padded[:, 0::_TILE], grad_padded[:, 1::_TILE]
    grad_transformed = grad_rows.new_empty(4, batch, tile_count, channels_out)
    grad_transformed[0].copy_(g0)
    torch.add(g0, g1, out=grad_transformed[1])
    torch.sub(g0, g1, out=grad_transformed[2])
    grad_transformed[3].copy_(g1)
    products = torch.bmm(grad_transformed.view(4, batch * tile_count, channels_out).transpose(1, 2), transformed)
    p0, p1, p2, p3 = products  # [C_out, C_in] each
    grad_weight = rows.new_empty(channels_out, channels_in, KERNEL_SIZE)
    half_sum = torch.add(p1, p2).mul_(0.5)
    torch.add(p0, half_sum, out=grad_weight[:, :, 0])
    torch.sub(p1, p2, out=grad_weight[:, :, 1]).mul_(0.5)
    torch.sub(half_sum, p3, out=grad_weight[:, :, 2])
    return grad_weight
