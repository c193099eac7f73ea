"""How attention inputs of any rank and broadcasting reach the backends as ``[B, H, L, X]``.

torch's rules for broadcasting query, key, value and masks, folded into the
backends' four dimensions as views wherever strides allow (see
:func:`transformer_kernels.scaled_dot_product_attention`, "Inputs may have any
strides").  Used by :mod:`transformer_kernels.ops.attention` only.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor


# The helpers below return their input itself where it already has the wanted shape: every view
# op is host time spent before the kernel starts, and the common 4-D call needs none.


def expanded(tensor: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``tensor.expand(shape)``, or ``tensor`` when it has that shape."""
    return tensor if tensor.shape == shape else tensor.expand(shape)


def canonical(tensor: Tensor, ndim: int) -> Tensor:
    """A view of an input of the call's rank ``ndim`` (or lower: leading 1s are added, as torch
    broadcasts) as ``[*lead, H, L, X]``; inputs of rank 2 and 3 have no head dim and get H = 1."""
    missing = max(ndim, 3) - tensor.dim()
    if missing:
        tensor = tensor[(None,) * missing]
    return tensor.unsqueeze(-3) if ndim <= 3 else tensor


def score_batch_shape(query: Tensor, key: Tensor, enable_gqa: bool) -> torch.Size:
    """The batch shape of torch's ``query @ key^T`` (key's heads repeated to query's with ``enable_gqa``),
    which attn_mask must broadcast to: torch adds the mask to it in place.  ``query`` and ``key``
    as the caller passed them, already checked to broadcast."""
    key_batch = key.shape[:-2]
    if enable_gqa:
        key_batch = (*key_batch[:-1], query.shape[-3])
    return torch.broadcast_shapes(query.shape[:-2], key_batch)


def grouped_key_value(query: Tensor, key: Tensor, value: Tensor, ndim: int) -> tuple[Tensor, Tensor]:
    """torch's ``enable_gqa`` checks: every input has a dimension -3 (heads) and key's and value's
    counts divide query's.  The backends group one key/value head count over the query heads
    natively; where that cannot express torch's grouping (3-D inputs, whose dimension -3 is the
    batch, or key and value with different counts, neither 1) the key/value is repeated to
    query's count as torch does, which copies it."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.dim() < 3:
            raise ValueError(
                f"with enable_gqa=True, {name} must have a heads dimension (dimension -3 of [..., H, L, E]), "
                f"got shape {tuple(tensor.shape)}"
            )
    num_heads, key_heads, value_heads = query.shape[-3], key.shape[-3], value.shape[-3]
    divides = all(count != 0 and num_heads % count == 0 for count in (key_heads, value_heads))
    if num_heads != 0 and not divides:  # no query heads take any key/value head count, as in torch
        raise ValueError(
            f"with enable_gqa=True the number of query heads ({num_heads}) must be a multiple of the number of "
            f"key heads ({key_heads}) and of value heads ({value_heads}) (dimension -3)"
        )
    if ndim > 3 and (key_heads == value_heads or 1 in (key_heads, value_heads)):
        return key, value
    return tuple(
        t if t.shape[-3] in (1, num_heads) else t.repeat_interleave(num_heads // t.shape[-3], dim=-3)
        for t in (key, value)
    )


def broadcast_qkv(query: Tensor, key: Tensor, value: Tensor, ndim: int, enable_gqa: bool):
    """``query``, ``key``, ``value`` broadcast against each other by torch's rules, as
    ``[*lead, H, L, X]`` ``expand``-ed views, and the broadcast leading shape ``lead``.

    The leading dimensions broadcast as usual.  Heads broadcast too (a size-1 side is expanded),
    except that key/value heads that divide the query heads stay as they are: the backends serve
    grouped heads natively (``enable_gqa``, or a single key/value head shared by every query head).
    """
    if ndim == 4 and query.dim() == key.dim() == value.dim() == 4:
        # The common call, [B, H, L, X] inputs of one batch and head count, needs no view.
        batch, heads = query.shape[:2]
        if key.shape[:2] == value.shape[:2] == (batch, heads):
            return query, key, value, (batch,)
    q, k, v = canonical(query, ndim), canonical(key, ndim), canonical(value, ndim)
    lead_shape = _broadcast_shape(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    if lead_shape is None:
        raise ValueError(
            f"query, key and value must have batch dimensions that broadcast against each other, got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)} and {tuple(value.shape)}"
        )
    num_heads, key_heads, value_heads = q.shape[-3], k.shape[-3], v.shape[-3]
    if key_heads != value_heads and 1 not in (key_heads, value_heads):
        raise ValueError(
            f"value must have as many heads as key ({key_heads}), or one, got shape {tuple(value.shape)}"
        )
    kv_heads = max(key_heads, value_heads)
    if num_heads == 1 and not enable_gqa:
        num_heads = kv_heads
    elif kv_heads != num_heads and kv_heads != 1 and not enable_gqa:
        raise ValueError(
            f"key and value must have as many heads as query ({num_heads}) or one, got shapes "
            f"{tuple(key.shape)} and {tuple(value.shape)}; pass enable_gqa=True for grouped-query attention"
        )
    q = expanded(q, (*lead_shape, num_heads, *q.shape[-2:]))
    k = expanded(k, (*lead_shape, kv_heads, *k.shape[-2:]))
    v = expanded(v, (*lead_shape, kv_heads, *v.shape[-2:]))
    return q, k, v, lead_shape


def _broadcast_shape(*shapes: tuple[int, ...]) -> Optional[tuple[int, ...]]:
    """torch's broadcast of equally long ``shapes``, or None where they do not broadcast.  Plain
    Python: ``torch.broadcast_shapes`` costs more host time than the rest of the call's checks."""
    result = list(shapes[0])
    for shape in shapes[1:]:
        for dim, size in enumerate(shape):
            if size != 1 and result[dim] != size:
                if result[dim] != 1:
                    return None
                result[dim] = size
    return tuple(result)


def _mergeable(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether these adjacent dimensions can be viewed as one (size-1 dimensions have no stride, and
    a tensor without elements views as any shape)."""
    if 0 in sizes:
        return True
    kept = [(size, stride) for size, stride in zip(sizes, strides) if size != 1]
    return all(outer[1] == inner[1] * inner[0] for outer, inner in zip(kept, kept[1:]))


def batch_split(lead_shape: tuple[int, ...], tensors: list[Optional[Tensor]], padding_lead_shape) -> int:
    """How many of the leading dimensions the backends' batch dimension folds; the others fold into
    the heads dimension (with the heads last), see :func:`fold`.

    All of them when every tensor (``[*lead, H, L, X]``) allows that as a view.  A tensor
    broadcast along an outer leading dimension but not an inner one does not (a stride-0
    dimension never merges with a strided one), so fewer are tried, down to none, keeping the
    first split that leaves every tensor a view; the key padding mask, one row per batch element,
    must then have size 1 along the dimensions folded into heads.  When no split does, all of
    them, and :func:`fold` copies the tensors that cannot merge.
    """
    if len(lead_shape) <= 1:  # one leading dimension (4-D inputs) or none: always a view
        return len(lead_shape)
    for split in range(len(lead_shape), -1, -1):
        if padding_lead_shape is not None and any(size != 1 for size in padding_lead_shape[split:]):
            continue
        if all(
            t is None or (_mergeable(t.shape[:split], t.stride()[:split])
                          and _mergeable(t.shape[split:-2], t.stride()[split:-2]))
            for t in tensors
        ):
            return split
    return len(lead_shape)


def fold(tensor: Tensor, split: int) -> Tensor:
    """``[*lead, H, L, X]`` → ``[B, H', L, X]`` with ``B = prod(lead[:split])`` and
    ``H' = prod(lead[split:]) * H``: a view where :func:`batch_split` found one, else a copy.
    Grouped heads stay grouped: query head ``(i, h)`` is ``i * Hq + h`` and its key/value head
    ``i * Hk + h // (Hq / Hk)`` is the one the backends pick."""
    if tensor.dim() == 4 and split == 1:
        return tensor
    # Both sizes spelled out: with an empty batch, -1 would leave the heads' size ambiguous.
    return tensor.reshape(math.prod(tensor.shape[:split]), math.prod(tensor.shape[split:-2]), *tensor.shape[-2:])


def broadcasts_to(shape: torch.Size, target: tuple[int, ...]) -> bool:
    if shape == target:  # the common case, without the walk below
        return True
    if len(shape) > len(target):
        return False
    return all(s == 1 or s == t for s, t in zip(reversed(shape), reversed(target)))

