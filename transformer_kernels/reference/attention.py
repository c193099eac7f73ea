"""Seed attention: materialized scores, masked_fill, softmax, matmul."""

from __future__ import annotations

import math
from typing import Optional

import torch


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    causal_bottom_right: bool = False,
    enable_gqa: bool = False,
    masked_value: float = -1e9,
    dropout_p: float = 0.0,
    dropout_keep_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Naive attention: scores = q kᵀ · scale, masked_fill, softmax, @ v.

    ``attn_mask``: bool (True = takes part) or float (added), broadcastable to
    ``[..., Lq, Lk]``.  ``key_padding_mask``: bool ``[B, Lk]``, True = padding.
    Masked scores are filled with ``masked_value`` like the seeds (-1e9); pass
    ``float("-inf")`` for exact masking.  Rows where every key is masked
    (including by ``-inf`` in a float mask) are set to 0 (the package's
    documented convention) when ``masked_value`` is -inf; with -1e9 they
    become uniform, as in the seeds.  ``dropout_keep_mask`` (bool,
    broadcastable to the scores) applies dropout with a given keep-mask,
    scaling kept weights by ``1 / (1 - dropout_p)``.
    """
    lq, lk = query.shape[-2], key.shape[-2]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if enable_gqa and key.dim() >= 3 and key.shape[-3] != query.shape[-3]:
        group = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(group, dim=-3)
        value = value.repeat_interleave(group, dim=-3)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    excluded = torch.zeros(lq, lk, dtype=torch.bool, device=query.device)
    if is_causal:
        shift = lk - lq if causal_bottom_right else 0
        excluded = torch.ones(lq, lk, dtype=torch.bool, device=query.device).triu(1 + shift)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            excluded = excluded | ~attn_mask
        else:
            scores = scores + attn_mask
    if key_padding_mask is not None:
        batch_shape = (key_padding_mask.shape[0],) + (1,) * (scores.dim() - 2)
        excluded = excluded | key_padding_mask.view(*batch_shape[:-1], 1, lk)
    scores = scores.masked_fill(excluded, masked_value)
    if masked_value == float("-inf"):
        empty = torch.isneginf(scores).all(-1, keepdim=True)
        weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    else:
        weights = torch.softmax(scores, dim=-1)
    if dropout_keep_mask is not None:
        weights = weights * dropout_keep_mask / (1.0 - dropout_p)
    return torch.matmul(weights, value)
