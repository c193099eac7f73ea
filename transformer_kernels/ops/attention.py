"""Masked scaled-dot-product attention: public function, argument checks, registered ops.

The public function checks and normalizes its arguments once (4-D views, key
bounds, expanded mask, causal kind, dropout seed), picks a backend and calls
``transformer_kernels::attention_forward``; autograd runs
``transformer_kernels::attention_backward`` on the same backend.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import Tensor
from torch.nn.attention.bias import CausalBias, CausalVariant

from .._backend import backend_module, select_backend
from .._checks import check_same_device, check_same_dtype_device, check_tensor
from ..backends.eager import attention as eager_attention

__all__ = ["scaled_dot_product_attention", "MAX_HEAD_DIM"]

OP_NAME = "scaled_dot_product_attention"
MAX_HEAD_DIM = 256

# Causal kinds passed to the backends.
NO_CAUSAL, CAUSAL_TOP_LEFT, CAUSAL_BOTTOM_RIGHT = 0, 1, 2



def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Union[Tensor, CausalBias]] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    key_padding_mask: Optional[Tensor] = None,
    backend: Optional[str] = None,
) -> Tensor:
    r"""Scaled-dot-product attention with padding and causal masks, fused where a backend allows.

    A drop-in replacement for :func:`torch.nn.functional.scaled_dot_product_attention`:
    every argument torch has means the same here; ``key_padding_mask`` and
    ``backend`` are additions.  Computes, for each batch element and head,

    .. code-block:: text

        S   = query @ key.transpose(-2, -1) * scale  (+ attn_mask if it is a float mask)
        S[excluded] = -inf        # bool attn_mask False, key padding, causal
        P   = softmax(S, dim=-1)  # rows where every key is excluded: P = 0
        out = dropout(P, dropout_p) @ value

    Shapes (``...`` is any number of batch dimensions, possibly none; a 3-D
    ``[N, L, E]`` input has no head dimension):

    - ``query``: ``[..., Hq, Lq, E]``
    - ``key``:   ``[..., Hk, Lk, E]``
    - ``value``: ``[..., Hk, Lk, Ev]``
    - returns:   ``[..., Hq, Lq, Ev]`` with ``query``'s dtype; contiguous, except
      that the eager backend lays it out over ``[..., Lq, Hq, Ev]`` memory like
      torch's CPU SDPA, so ``out.transpose(-3, -2).reshape(..., Lq, Hq * Ev)``
      is free.

    ``query``, ``key`` and ``value`` have one floating dtype and one device,
    and their batch dimensions ``...`` (heads included) broadcast against each
    other exactly as torch broadcasts them: a dimension may be 1 or missing
    (query ``[4, 3, 8]`` with key/value ``[4, 4, 6, 8]`` gives
    ``[4, 4, 3, 8]``), and gradients are summed over the dimensions an input
    was broadcast along.  Heads broadcast like any batch dimension (query's,
    key's or value's count may be 1); with ``enable_gqa``, ``Hk`` divides
    ``Hq`` instead.  ``E`` and ``Ev`` are 1 to 256 and may
    differ; ``Lq`` and ``Lk`` are any lengths >= 1 and may differ.  What torch
    refuses is refused with a ``ValueError`` that names the argument.

    Inputs may have any strides (e.g. ``x.view(B, L, H, D).transpose(1, 2)``)
    and are read in place, broadcast ones as stride-0 (``expand``-ed) views.
    The backends take ``[B, H, L, X]``; inputs of more than 4 dimensions
    ``[*lead, H, L, X]`` fold ``lead`` into ``B`` as views where every input's
    strides allow it, else fold its inner dimensions into the heads
    (``[X, Y, H]`` as ``[X, Y * H]``, e.g. for key/value shared over ``X``;
    a ``key_padding_mask`` that varies along a leading dimension keeps it in
    ``B``).  Only where neither is a view (an input broadcast along an inner
    leading dimension but not an outer one, or inputs broadcast along
    different ones) are the inputs that cannot fold copied, an attn_mask
    included.

    Args:
        query, key, value: the attention inputs, shapes above.
        attn_mask: optional, one of

            - a bool tensor broadcastable to ``[..., Hq, Lq, Lk]``: True means
              the query may attend to the key (torch's convention);
            - a float tensor of ``query``'s dtype broadcastable to
              ``[..., Hq, Lq, Lk]``, added to the scaled scores (``-inf``
              excludes a key).  It receives a gradient when it requires one;
            - a :class:`torch.nn.attention.bias.CausalBias`
              (``causal_upper_left(Lq, Lk)`` or ``causal_lower_right(Lq, Lk)``),
              applied structurally without materializing any mask.

            As in torch (which adds it to ``query @ key^T`` in place), the
            mask must broadcast to the shape of ``query @ key^T``, not only
            to the output's: a mask may not add dimensions that only
            ``value`` has.  It is read through ``expand``, not copied.
        dropout_p: probability in ``[0, 1)`` of dropping an attention weight
            (after the softmax; kept weights are scaled by ``1 / (1 - dropout_p)``).
            Like torch, dropout applies whenever ``dropout_p > 0``; pass
            ``dropout_p=0.0`` in evaluation.
        is_causal: top-left causal mask: query ``i`` attends to keys ``j <= i``
            (torch's convention).  An error together with ``attn_mask``.
        scale: factor applied to ``query @ key^T``; default ``1 / sqrt(E)``.
        enable_gqa: grouped-query attention, torch's rules: every input
            needs a dimension -3 (heads), ``Hq`` must be a multiple of key's
            and of value's heads, and query head ``h`` uses key head
            ``h // (Hq // Hk)`` (value likewise).  Served without copies when
            key and value have one head count (or one of them a single head).
            Otherwise, and for 3-D inputs (whose dimension -3 is the batch),
            a key or value whose count is neither 1 nor ``Hq`` is repeated to
            ``Hq`` as torch does (a copy).
        key_padding_mask: optional bool tensor ``[..., Lk]`` over the output's
            batch dimensions without heads (``[B, Lk]`` for 4-D inputs,
            ``[N, Lk]`` for 3-D ones, ``[Lk]`` for 2-D ones, or any shape that
            broadcasts to it, e.g. ``[Lk]`` or ``[1, Lk]``; the same padding
            for every head): True marks a *padding* key
            that no query attends to (the :class:`torch.nn.MultiheadAttention`
            convention, e.g. ``tokens.eq(pad_id)``).  Suffix padding, left
            padding and holes are all allowed.  It is never expanded to
            ``[B, H, Lq, Lk]``; backends skip key blocks that are all padding.
            It combines with ``attn_mask`` or the causal mask (a key must pass
            every mask).
        backend: ``"auto"``, ``"triton"``, ``"cuda"`` or ``"eager"``; overrides
            :func:`transformer_kernels.use_backend` and the
            ``TRANSFORMER_KERNELS_BACKEND`` environment variable.  ``"auto"``
            runs CUDA tensors on the CUDA extension or Triton when they can
            serve the call, else on eager; CPU tensors run on eager.  A backend
            named explicitly that cannot serve the call raises
            :class:`transformer_kernels.BackendUnavailableError`.

    Causal masks:
        - top-left (``is_causal=True`` or ``causal_upper_left``): query ``i``
          sees keys ``j <= i``;
        - bottom-right (``causal_lower_right``): query ``i`` sees keys
          ``j <= i + Lk - Lq``, the mask of decoding with a key/value cache.

    Rows without any key:
        A query row for which every key is excluded (bottom-right causal with
        ``Lq > Lk``, an all-padding sequence, a mask row that is all False or
        ``-inf``) gets output 0 and contributes gradient 0 to every input —
        never NaN.  (The seeds' ``masked_fill(-1e9)`` instead averages all
        values uniformly on such rows.)  Only ``-inf`` excludes a key: a
        finite float mask value, even ``torch.finfo(dtype).min``, is added
        like any other, so a row made entirely of ``finfo.min`` (the masks of
        many Hugging Face models) averages its values uniformly, as in torch.

    Dropout:
        The keep-mask is generated inside the backend from a ``(seed, offset)``
        pair drawn from torch's default CPU generator at call time, so
        ``torch.manual_seed`` makes results reproducible, and the backward pass
        regenerates the same mask instead of storing it.  Masks differ between
        backends and from torch's own dropout for the same seed.  The triton
        backend rounds ``dropout_p`` to a multiple of 1/65536 and scales kept
        weights by the exact rounded keep rate, so the mean is preserved.

    Backends:
        ``triton`` (CUDA fp16/bf16, and fp32 up to head dim 64; CPU under
        ``TRITON_INTERPRET=1``) is a
        FlashAttention-style kernel pair that stores only the row
        log-sum-exps; ``eager`` runs on any device and floating dtype (fp64
        for :func:`torch.autograd.gradcheck`), composed of PyTorch ops, and on
        CPU cuts padded keys and the causal triangle out of the work.

    Returns:
        Tensor ``[..., Hq, Lq, Ev]``.

    Example::

        >>> q = torch.randn(2, 8, 128, 64)
        >>> k = v = torch.randn(2, 8, 100, 64)
        >>> pad = torch.arange(100) >= torch.tensor([[100], [60]])  # [2, 100], True = padding
        >>> out = transformer_kernels.scaled_dot_product_attention(q, k, v, key_padding_mask=pad)
        >>> out.shape
        torch.Size([2, 8, 128, 64])
    """
    check_tensor("query", query, floating=True)
    check_tensor("key", key, floating=True)
    check_tensor("value", value, floating=True)
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.dim() < 2:
            raise ValueError(f"{name} must have at least 2 dimensions [..., L, E], got shape {tuple(tensor.shape)}")
    check_same_dtype_device("query", query, key=key, value=value)
    lq, head_dim = query.shape[-2], query.shape[-1]
    lk, value_head_dim = key.shape[-2], value.shape[-1]
    if value.shape[-2] != lk:
        raise ValueError(f"value must have key's length Lk={lk} in dimension -2, got shape {tuple(value.shape)}")
    if key.shape[-1] != head_dim:
        raise ValueError(f"key must have query's head dim E={head_dim} in dimension -1, got shape {tuple(key.shape)}")
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.numel() == 0:
            raise ValueError(f"{name} must not have a zero-sized dimension, got shape {tuple(tensor.shape)}")
        if tensor.shape[-1] > MAX_HEAD_DIM:
            raise ValueError(
                f"{name} head dim (last dimension) must be at most {MAX_HEAD_DIM}, got shape {tuple(tensor.shape)}"
            )

    ndim = max(query.dim(), key.dim(), value.dim())
    grouped_key, grouped_value = _grouped_key_value(query, key, value, ndim) if enable_gqa else (key, value)
    q, k, v, lead_shape = _broadcast_qkv(query, grouped_key, grouped_value, ndim, enable_gqa)
    # The output's batch dimensions without heads (key_padding_mask's) and with them: [*lead] and
    # [*lead, H] for 4-D and more, [N] for 3-D, none for 2-D.
    sequence_shape = lead_shape if ndim >= 3 else ()
    batch_shape = (*lead_shape, q.shape[-3]) if ndim >= 4 else sequence_shape

    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    elif not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")

    causal = CAUSAL_TOP_LEFT if is_causal else NO_CAUSAL
    mask = None
    if isinstance(attn_mask, CausalBias):
        if is_causal:
            raise ValueError("attn_mask and is_causal=True cannot both be set; a CausalBias already is a causal mask")
        if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (lq, lk):
            raise ValueError(
                f"attn_mask is a CausalBias for Lq={attn_mask.seq_len_q}, Lk={attn_mask.seq_len_kv}, "
                f"but query has Lq={lq} and key has Lk={lk}"
            )
        causal = CAUSAL_TOP_LEFT if attn_mask.variant == CausalVariant.UPPER_LEFT else CAUSAL_BOTTOM_RIGHT
    elif attn_mask is not None:
        check_tensor("attn_mask", attn_mask)
        if is_causal:
            raise ValueError(
                "attn_mask and is_causal=True cannot both be set (as in torch); fold the causal mask into attn_mask"
            )
        check_same_device("query", query, attn_mask=attn_mask)
        if attn_mask.dtype != torch.bool and attn_mask.dtype != query.dtype:
            raise TypeError(
                f"attn_mask must have dtype torch.bool or query's dtype ({query.dtype}), got {attn_mask.dtype}"
            )
        scores_shape = (*_score_batch_shape(query, key, enable_gqa), lq, lk)
        if not _broadcasts_to(attn_mask.shape, scores_shape):
            raise ValueError(
                f"attn_mask of shape {tuple(attn_mask.shape)} cannot be broadcast to the shape of "
                f"query @ key^T, [..., Lq, Lk] = {scores_shape}"
            )
        mask = _canonical(attn_mask.expand(*batch_shape, lq, lk), ndim)

    padding_lead_shape = None
    if key_padding_mask is not None:
        check_tensor("key_padding_mask", key_padding_mask, dtypes=(torch.bool,))
        check_same_device("query", query, key_padding_mask=key_padding_mask)
        expected = (*sequence_shape, lk)
        if not _broadcasts_to(key_padding_mask.shape, expected):
            raise ValueError(
                f"key_padding_mask must have shape [..., Lk] = {expected} (the output's batch dimensions without "
                f"heads, key's length) or one that broadcasts to it, got {tuple(key_padding_mask.shape)}"
            )
        padding_lead_shape = (1,) * (len(lead_shape) + 1 - key_padding_mask.dim()) + key_padding_mask.shape[:-1]

    split = _batch_split(lead_shape, [q, k, v, mask], padding_lead_shape)
    q, k, v = (_fold(t, split) for t in (q, k, v))
    if mask is not None:
        mask = _fold(mask, split)
    padding, key_bounds = None, None
    if key_padding_mask is not None:
        # Constant along the dimensions folded into heads (_batch_split made sure): one row per batch element.
        padding = key_padding_mask.expand(*lead_shape, lk)[(slice(None),) * split + (0,) * (len(lead_shape) - split)]
        padding = padding.reshape(-1, lk).contiguous()
        key_bounds = _key_bounds(padding)

    dropout_p = float(dropout_p)
    dropout_seed = None
    if dropout_p > 0.0:
        # (seed, offset) from the default generator: torch.manual_seed reproduces the keep-mask.
        dropout_seed = torch.randint(0, 2**31 - 1, (2,), dtype=torch.int64)

    chosen = select_backend("attention", OP_NAME, backend, query, q, k, v, mask, dropout_p)
    out, _ = torch.ops.transformer_kernels.attention_forward(
        q, k, v, padding, key_bounds, mask, causal, float(scale), dropout_p, dropout_seed, chosen
    )
    return out.view(*batch_shape, lq, value_head_dim)


# ----------------------------------------------------------------------------
# Normalization helpers
# ----------------------------------------------------------------------------


def _canonical(tensor: Tensor, ndim: int) -> Tensor:
    """A view of an input of the call's rank ``ndim`` (or lower: leading 1s are added, as torch
    broadcasts) as ``[*lead, H, L, X]``; inputs of rank 2 and 3 have no head dim and get H = 1."""
    tensor = tensor[(None,) * (max(ndim, 3) - tensor.dim())]
    return tensor.unsqueeze(-3) if ndim <= 3 else tensor


def _score_batch_shape(query: Tensor, key: Tensor, enable_gqa: bool) -> torch.Size:
    """The batch shape of torch's ``query @ key^T`` (key's heads repeated to query's with ``enable_gqa``),
    which attn_mask must broadcast to: torch adds the mask to it in place.  ``query`` and ``key``
    as the caller passed them, already checked to broadcast."""
    key_batch = key.shape[:-2]
    if enable_gqa:
        key_batch = (*key_batch[:-1], query.shape[-3])
    return torch.broadcast_shapes(query.shape[:-2], key_batch)


def _grouped_key_value(query: Tensor, key: Tensor, value: Tensor, ndim: int) -> tuple[Tensor, Tensor]:
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
    if num_heads % key_heads != 0 or num_heads % value_heads != 0:
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


def _broadcast_qkv(query: Tensor, key: Tensor, value: Tensor, ndim: int, enable_gqa: bool):
    """``query``, ``key``, ``value`` broadcast against each other by torch's rules, as
    ``[*lead, H, L, X]`` ``expand``-ed views, and the broadcast leading shape ``lead``.

    The leading dimensions broadcast as usual.  Heads broadcast too (a size-1 side is expanded),
    except that key/value heads that divide the query heads stay as they are: the backends serve
    grouped heads natively (``enable_gqa``, or a single key/value head shared by every query head).
    """
    q, k, v = (_canonical(t, ndim) for t in (query, key, value))
    try:
        lead_shape = tuple(torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3]))
    except RuntimeError:
        raise ValueError(
            f"query, key and value must have batch dimensions that broadcast against each other, got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)} and {tuple(value.shape)}"
        ) from None
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
    q = q.expand(*lead_shape, num_heads, *q.shape[-2:])
    k = k.expand(*lead_shape, kv_heads, *k.shape[-2:])
    v = v.expand(*lead_shape, kv_heads, *v.shape[-2:])
    return q, k, v, lead_shape


def _mergeable(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether these adjacent dimensions can be viewed as one (size-1 dimensions have no stride)."""
    kept = [(size, stride) for size, stride in zip(sizes, strides) if size != 1]
    return all(outer[1] == inner[1] * inner[0] for outer, inner in zip(kept, kept[1:]))


def _batch_split(lead_shape: tuple[int, ...], tensors: list[Optional[Tensor]], padding_lead_shape) -> int:
    """How many of the leading dimensions the backends' batch dimension folds; the others fold into
    the heads dimension (with the heads last), see :func:`_fold`.

    All of them when every tensor (``[*lead, H, L, X]``) allows that as a view.  A tensor
    broadcast along an outer leading dimension but not an inner one does not (a stride-0
    dimension never merges with a strided one), so fewer are tried, down to none, keeping the
    first split that leaves every tensor a view; the key padding mask, one row per batch element,
    must then have size 1 along the dimensions folded into heads.  When no split does, all of
    them, and :func:`_fold` copies the tensors that cannot merge.
    """
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


def _fold(tensor: Tensor, split: int) -> Tensor:
    """``[*lead, H, L, X]`` → ``[B, H', L, X]`` with ``B = prod(lead[:split])`` and
    ``H' = prod(lead[split:]) * H``: a view where :func:`_batch_split` found one, else a copy.
    Grouped heads stay grouped: query head ``(i, h)`` is ``i * Hq + h`` and its key/value head
    ``i * Hk + h // (Hq / Hk)`` is the one the backends pick."""
    return tensor.reshape(math.prod(tensor.shape[:split]), -1, *tensor.shape[-2:])


def _broadcasts_to(shape: torch.Size, target: tuple[int, ...]) -> bool:
    if len(shape) > len(target):
        return False
    return all(s == 1 or s == t for s, t in zip(reversed(shape), reversed(target)))


def _key_bounds(padding: Tensor) -> Tensor:
    """int32 ``[B, 2]``: (first non-padding key, last non-padding key + 1); (0, 0) for all-padding rows."""
    lk = padding.shape[1]
    index = torch.arange(lk, device=padding.device, dtype=torch.int32)
    valid = ~padding
    first = torch.where(valid, index, lk).amin(1)
    end = torch.where(valid, index + 1, 0).amax(1)
    first = torch.where(end > 0, first, 0)
    return torch.stack([first, end], 1).to(torch.int32)




def _dmask_dtype(mask_dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(mask_dtype, torch.float32)


# ----------------------------------------------------------------------------
# Registered ops
# ----------------------------------------------------------------------------


@torch.library.custom_op("transformer_kernels::attention_forward", mutates_args=())
def attention_forward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Optional[Tensor],
    key_bounds: Optional[Tensor],
    attn_mask: Optional[Tensor],
    causal: int,
    scale: float,
    dropout_p: float,
    dropout_seed: Optional[Tensor],
    backend: str,
) -> tuple[Tensor, Tensor]:
    """Normalized attention: ``out [B, Hq, Lq, Ev]`` and the row log-sum-exps ``lse [B, Hq, Lq]``."""
    return backend_module("attention", backend).forward(
        query, key, value, key_padding_mask, key_bounds, attn_mask, causal, scale, dropout_p, dropout_seed
    )


@attention_forward.register_fake
def _attention_forward_fake(
    query, key, value, key_padding_mask, key_bounds, attn_mask, causal, scale, dropout_p, dropout_seed, backend
):
    batch_size, num_heads, lq, _ = query.shape
    if backend == "eager":
        out = eager_attention.empty_output(batch_size, num_heads, lq, value.shape[-1], query.dtype, query.device)
        lse = eager_attention.empty_lse(batch_size, num_heads, lq, query.dtype, query.device)
    else:
        out = query.new_empty(batch_size, num_heads, lq, value.shape[-1])
        lse = query.new_empty(batch_size, num_heads, lq, dtype=torch.float32)
    return out, lse


@torch.library.custom_op("transformer_kernels::attention_backward", mutates_args=())
def attention_backward(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
    key_padding_mask: Optional[Tensor],
    key_bounds: Optional[Tensor],
    attn_mask: Optional[Tensor],
    causal: int,
    scale: float,
    dropout_p: float,
    dropout_seed: Optional[Tensor],
    backend: str,
    attn_mask_needs_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`attention_forward`: ``dq, dk, dv`` and ``dmask`` (``[B, Hq, Lq, Lk]`` when
    ``attn_mask_needs_grad``, else empty)."""
    dq, dk, dv, dmask = backend_module("attention", backend).backward(
        grad_out, query, key, value, out, lse, key_padding_mask, key_bounds, attn_mask,
        causal, scale, dropout_p, dropout_seed, attn_mask_needs_grad,
    )
    if attn_mask_needs_grad:
        dmask = dmask.to(_dmask_dtype(attn_mask.dtype)).contiguous()
    return dq, dk, dv, dmask


@attention_backward.register_fake
def _attention_backward_fake(
    grad_out, query, key, value, out, lse, key_padding_mask, key_bounds, attn_mask,
    causal, scale, dropout_p, dropout_seed, backend, attn_mask_needs_grad,
):
    if attn_mask_needs_grad:
        dmask = attn_mask.new_empty(attn_mask.shape, dtype=_dmask_dtype(attn_mask.dtype))
    else:
        dmask = query.new_empty(0, dtype=torch.float32)
    if backend == "eager":
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), dmask
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), dmask


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, key_padding_mask, key_bounds, attn_mask, causal, scale, dropout_p, dropout_seed, backend = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, key_padding_mask, key_bounds, attn_mask, dropout_seed)
    ctx.causal, ctx.scale, ctx.dropout_p, ctx.backend = causal, scale, dropout_p, backend
    ctx.attn_mask_needs_grad = attn_mask is not None and ctx.needs_input_grad[5]


def _backward(ctx, grad_out, grad_lse):
    query, key, value, out, lse, key_padding_mask, key_bounds, attn_mask, dropout_seed = ctx.saved_tensors
    dq, dk, dv, dmask = torch.ops.transformer_kernels.attention_backward(
        grad_out, query, key, value, out, lse, key_padding_mask, key_bounds, attn_mask,
        ctx.causal, ctx.scale, ctx.dropout_p, dropout_seed, ctx.backend, ctx.attn_mask_needs_grad,
    )
    grad_mask = dmask.to(attn_mask.dtype) if ctx.attn_mask_needs_grad else None
    return dq, dk, dv, None, None, grad_mask, None, None, None, None, None


attention_forward.register_autograd(_backward, setup_context=_setup_context)
