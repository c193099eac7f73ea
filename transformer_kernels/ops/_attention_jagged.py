"""Scaled-dot-product attention of jagged nested tensors, the variable-length inputs torch's SDPA
takes: ``[B, H, j, E]`` tensors of ``layout=torch.jagged`` whose sequence dimension is ragged (a
``[B, j, H, E]`` nested tensor of tokens, transposed).

They run padded: each input to a ``[B, H, L, E]`` tensor of the longest sequence, the keys'
lengths as a key padding mask (so padded keys cost nothing where a backend skips key padding), and
the query rows of real tokens packed back into a nested tensor that shares the query's offsets (so
``query + out`` works as on torch's result).  Autograd reaches the nested inputs through the
padding and the packing."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

__all__ = ["is_nested", "attend_jagged"]


def is_nested(*tensors: object) -> bool:
    for t in tensors:  # a loop: any() over a generator takes twice as long, on every call
        if isinstance(t, Tensor) and t.is_nested:
            return True
    return False


def _check(name: str, tensor: object) -> None:
    if not (isinstance(tensor, Tensor) and tensor.is_nested and tensor.layout == torch.jagged
            and tensor.dim() == 4 and tensor._ragged_idx == 2):
        what = (f"a nested tensor of layout {tensor.layout} with {tensor.dim()} dimensions"
                if isinstance(tensor, Tensor) and tensor.is_nested else f"a {type(tensor).__name__}")
        raise ValueError(
            f"{name} must be a nested tensor of layout torch.jagged [B, H, j, E] with its sequence dimension ragged "
            f"(nt.transpose(1, 2) of a [B, j, H, E] one), as every input once one is nested; got {what}"
        )
    if tensor._lengths is not None:  # torch's jagged SDPA refuses holes too
        raise ValueError(
            f"{name} must be a jagged tensor without holes: its sequences must fill its values from one offset to "
            f"the next, got lengths set apart from the offsets (as torch.nested.narrow makes them)"
        )


def _padded(tokens: Tensor, longest: int) -> Tensor:
    """``[B, j, H, E]`` jagged tokens as a dense ``[B, longest, H, E]``, zero-padded (``to_padded_tensor``
    is told the length: left to itself it pads a tensor made by ``nested_tensor_from_jagged`` to the
    total length)."""
    return torch.nested.to_padded_tensor(tokens, 0.0, output_size=(tokens.shape[0], longest, *tokens.shape[2:]))


def _longest(lengths: Tensor) -> int:
    return int(lengths.max()) if lengths.numel() > 0 else 0


def attend_jagged(attend: Callable[..., Tensor], query: Tensor, key: Tensor, value: Tensor, attn_mask, dropout_p,
                  is_causal, scale, enable_gqa, key_padding_mask, backend) -> Tensor:
    """``attend`` (the public function, on dense tensors) for jagged nested ``query``, ``key`` and
    ``value``; the result is a jagged nested ``[B, H, j, Ev]`` with the query's offsets.
    ``is_causal`` is top-left within each sequence (torch's jagged SDPA refuses it)."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        _check(name, tensor)
    if attn_mask is not None or key_padding_mask is not None:
        raise ValueError("attn_mask and key_padding_mask must be None with nested inputs: their lengths are the mask")
    tokens_query, tokens_key, tokens_value = (t.transpose(1, 2) for t in (query, key, value))  # ragged dim 1
    if not torch.equal(tokens_key.offsets(), tokens_value.offsets()):
        raise ValueError("key and value must have the same sequence lengths (offsets)")
    query_lengths, key_lengths = tokens_query.offsets().diff(), tokens_key.offsets().diff()
    length_q, length_k = _longest(query_lengths), _longest(key_lengths)
    dense_query = _padded(tokens_query, length_q).transpose(1, 2)
    dense_key, dense_value = (_padded(t, length_k).transpose(1, 2) for t in (tokens_key, tokens_value))
    padding = torch.arange(length_k, device=key.device) >= key_lengths[:, None]
    out = attend(dense_query, dense_key, dense_value, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                 enable_gqa=enable_gqa, key_padding_mask=padding, backend=backend)
    real_rows = torch.arange(length_q, device=out.device) < query_lengths[:, None]
    rows = out.transpose(1, 2)[real_rows]  # [T, H, Ev]: the real queries' rows, packed
    return torch.nested.nested_tensor_from_jagged(rows, tokens_query.offsets()).transpose(1, 2)
