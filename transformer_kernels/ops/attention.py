"""Masked scaled-dot-product attention: the op's contract, public function and registered ops.

The public function checks and normalizes its arguments once into ``[B, H, L, X]``
query, key and value and an :class:`AttentionArgs` (key padding rows and their
bounds, the expanded mask, the causal kind, scale, dropout), picks a backend
and calls ``transformer_kernels::attention_forward``; autograd runs
``transformer_kernels::attention_backward`` on the same backend.  The layouts
every backend returns are defined here: :func:`empty_output`,
:func:`empty_lse`, :func:`empty_grads`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from typing import Callable, Optional, Union

import torch
from torch import Tensor
from torch.nn.attention.bias import CausalBias, CausalVariant

from .._backend import backend_module, select_backend
from .._checks import check_same_device, check_same_dtype_device, check_tensor
from . import _attention_inputs as inputs
from ._attention_jagged import attend_jagged, is_nested
from ._autocast import autocast
from ._call_plans import CallPlans, layout_key, prepared_forward
from ._library import RegisteredOp

__all__ = ["scaled_dot_product_attention", "AttentionArgs", "Causal", "MAX_HEAD_DIM"]

OP_NAME = "scaled_dot_product_attention"
# The largest head dim the fused GPU kernels serve; the eager backend serves any.
MAX_HEAD_DIM = 256


# ----------------------------------------------------------------------------
# The op's contract: its arguments and the layouts every backend returns
# ----------------------------------------------------------------------------


class Causal(enum.IntEnum):
    """Which causal mask applies: none, top-left (query ``i`` sees keys ``j <= i``) or
    bottom-right (query ``i`` sees keys ``j <= i + Lk - Lq``)."""

    NONE = 0
    TOP_LEFT = 1
    BOTTOM_RIGHT = 2


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionArgs:
    """Everything about one attention call besides ``query [B, Hq, Lq, E]``, ``key [B, Hk, Lk, E]``
    and ``value [B, Hk, Lk, Ev]`` (``Hk`` divides ``Hq``: query head ``h`` uses key/value head
    ``h // (Hq // Hk)``), as the op layer normalized it.

    - ``key_padding_mask``: bool ``[B, Lk]``, contiguous; True marks a padding key
      (:func:`key_padding_bounds` gives each row's first and last kept key, and their count).
    - ``attn_mask``: bool (True = attend) or float (added to the scaled scores)
      ``[B, Hq, Lq, Lk]``, any strides (often an ``expand``-ed view).
    - ``dropout_seed``: int64 ``[2]`` (seed, offset) on ``query``'s device when ``dropout_p > 0``.
    """

    key_padding_mask: Optional[Tensor]
    attn_mask: Optional[Tensor]
    causal: Causal
    scale: float
    dropout_p: float
    dropout_seed: Optional[Tensor]

    def __post_init__(self) -> None:
        if not isinstance(self.causal, Causal):  # from the flat schema, as an int
            object.__setattr__(self, "causal", Causal(self.causal))


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The log-sum-exps' dtype: float32, float64 for float64 inputs.  (A comparison, not
    ``torch.promote_types``, which is a dispatched op: host time on every call.)"""
    return torch.float64 if dtype == torch.float64 else torch.float32


def empty_output(query: Tensor, value: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """``out [B, Hq, Lq, Ev]`` with query's dtype (or ``dtype``, for a backend's accumulator) over
    ``[B, Lq, Hq, Ev]`` memory, torch's CPU and flash SDPA layout:
    ``out.transpose(1, 2).reshape(B, Lq, Hq * Ev)`` is free."""
    batch, heads, lq, _ = query.shape
    value_head_dim = value.shape[-1]
    strides = (lq * heads * value_head_dim, value_head_dim, heads * value_head_dim, 1)
    return torch.empty_strided((batch, heads, lq, value_head_dim), strides, dtype=dtype or query.dtype,
                               device=query.device)


def empty_lse(query: Tensor) -> Tensor:
    """``lse [B, Hq, Lq]``, contiguous, :func:`lse_dtype`: natural-log row log-sum-exps of the
    scaled, masked scores; +inf on rows that see no key."""
    return torch.empty(query.shape[:3], dtype=lse_dtype(query.dtype), device=query.device)


def empty_grads(query: Tensor, key: Tensor, value: Tensor, contiguous: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` laid out like ``torch.empty_like`` of each input (torch's flash SDPA layout),
    or contiguous (its math path's) when ``contiguous``: each backend's ``grads_contiguous`` says
    which it returns."""
    if contiguous:
        return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (query, key, value))
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def grads_like_inputs(query: Tensor, key: Tensor, value: Tensor, saved: Tensor, args: AttentionArgs,
                      attn_mask_needs_grad: bool) -> bool:
    """``grads_contiguous`` of the backends whose gradients are always laid out like their inputs."""
    return False


# Key bounds pay on a GPU where they let the kernels skip key blocks of padding and run whole blocks
# of kept keys without per-key tests.  Keys at most this long (the seeds' padded batches) are a block
# or two: both GPU backends then test each key's padding instead, and spare every call the bounds'
# launch (a kernel of each backend's own).
KEY_BOUNDS_MIN_LENGTH = 65


def key_padding_bounds(key_padding_mask: Tensor) -> Tensor:
    """int32 ``[B, 3]``: each row's first non-padding key, its last one + 1 ((0, 0) for a row of
    padding only) and the count of non-padding keys, short of their difference where padding sits
    between them (holes): without holes the bounds say all, and kernels skip the per-key test.
    For the eager backend and the tests; the GPU backends find them in a kernel of their own (a
    dozen small ops here would be a dozen launches per call)."""
    lk = key_padding_mask.shape[1]
    index = torch.arange(lk, device=key_padding_mask.device, dtype=torch.int32)
    kept = ~key_padding_mask
    first = torch.where(kept, index, lk).amin(1)
    end = torch.where(kept, index + 1, 0).amax(1)
    first = torch.where(end > 0, first, 0)
    return torch.stack([first, end, kept.sum(1, dtype=torch.int32)], 1)


DROPOUT_LEVELS = 1 << 16


def dropout_threshold(dropout_p: float) -> tuple[int, float]:
    """The kernels' dropout: ``(threshold, scale)``.  A weight whose 16 random bits are below
    ``threshold = round(p * 2**16)`` is dropped, the others are scaled by the inverse of that
    quantized keep probability, so the mean stays exact.  Shared by the triton and cuda backends,
    which drop the same weights for the same ``(seed, offset)``."""
    threshold = min(round(dropout_p * DROPOUT_LEVELS), DROPOUT_LEVELS - 1)
    return threshold, DROPOUT_LEVELS / (DROPOUT_LEVELS - threshold)


def dmask_dtype(mask_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a float mask's gradient as backends return it: at least float32."""
    return lse_dtype(mask_dtype)


# ----------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------


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
    - returns:   ``[..., Hq, Lq, Ev]`` with ``query``'s dtype, laid out over
      ``[..., Lq, Hq, Ev]`` memory on every backend, like torch's SDPA, so
      ``out.transpose(-3, -2).reshape(..., Lq, Hq * Ev)`` is free.

    ``query``, ``key`` and ``value`` have one floating dtype and one device
    (under ``torch.autocast``, as torch's SDPA: float16/bfloat16/float32
    inputs and a float ``attn_mask`` are cast to the autocast dtype first),
    and their batch dimensions ``...`` (heads included) broadcast against each
    other exactly as torch broadcasts them: a dimension may be 1 or missing
    (query ``[4, 3, 8]`` with key/value ``[4, 4, 6, 8]`` gives
    ``[4, 4, 3, 8]``), and gradients are summed over the dimensions an input
    was broadcast along.  Heads broadcast like any batch dimension (query's,
    key's or value's count may be 1); with ``enable_gqa``, ``Hk`` divides
    ``Hq`` instead.  ``E`` and ``Ev`` may differ (the fused GPU kernels
    serve up to 256; wider heads run on eager); ``Lq`` and ``Lk`` may differ.
    Zero-sized batches, heads, lengths, ``E`` and ``Ev`` give what torch gives
    (no key: rows of 0; ``E = 0``: every score 0, whatever the scale).  What
    torch refuses is refused with a ``ValueError`` or ``TypeError`` that names
    the argument (and so is a ``value`` whose length is not ``key``'s, which
    torch's CPU flash kernel reads out of bounds).

    Jagged nested tensors (``layout=torch.jagged``, ``[B, H, j, E]`` with the
    sequence dimension ragged, as torch's SDPA takes them) run padded to the
    longest sequence, the keys' lengths as the key padding mask; the result
    is a jagged ``[B, H, j, Ev]`` sharing the query's offsets.  ``is_causal``
    is then top-left within each sequence; ``attn_mask`` and
    ``key_padding_mask`` must be None.

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
            - a float tensor of ``query``'s dtype or float32 (torch's rule;
              the fused GPU backends take the query's dtype and leave a
              float32 mask with 16-bit inputs to eager) broadcastable to
              ``[..., Hq, Lq, Lk]``, added to the scaled scores (``-inf``
              excludes a key).  It receives a gradient when it requires one;
            - a :class:`torch.nn.attention.bias.CausalBias`
              (``causal_upper_left(Lq, Lk)`` or ``causal_lower_right(Lq, Lk)``),
              applied structurally without materializing any mask.  As in
              torch, an upper-left bias's lengths are not checked; a
              lower-right one's must be the inputs'.

            As in torch (which adds it to ``query @ key^T`` in place), the
            mask must broadcast to the shape of ``query @ key^T``, not only
            to the output's: a mask may not add dimensions that only
            ``value`` has.  It is read through ``expand``, not copied, and
            saved for the backward pass as it is, as ``key_padding_mask`` is:
            changing either in place before that pass raises autograd's
            "modified by an inplace operation" (torch copies a bool mask, and
            does not).
        dropout_p: probability in ``[0, 1]`` of dropping an attention weight
            (after the softmax; kept weights are scaled by ``1 / (1 - dropout_p)``;
            ``1.0`` drops every weight: the output and the gradients are 0, as in torch).
            Like torch, dropout applies whenever ``dropout_p > 0``; pass
            ``dropout_p=0.0`` in evaluation.
        is_causal: top-left causal mask: query ``i`` attends to keys ``j <= i``
            (torch's convention).  Together with an ``attn_mask`` tensor both
            apply: a key must pass the causal test and the bool mask, and a
            float mask is added where the causal mask keeps the key.  That is
            what torch's default CPU path (its flash kernel) computes for the
            pair, which its documentation and its math backend refuse.
        scale: factor applied to ``query @ key^T``; default ``1 / sqrt(E)``.
            ``scale`` and ``dropout_p`` take a real number or a 0-dim tensor,
            ``is_causal`` and ``enable_gqa`` a bool, as torch's parser does.
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
            runs CUDA tensors on Triton when it can serve the call, else on
            eager (never on the CUDA extension, whose attention measured slower
            than Triton's: name it to use it); CPU tensors run on eager.  A backend
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
        Its gradients are those of torch's math on eager; the triton and cuda
        backends, like torch's own flash kernels, derive the backward's
        probabilities from a saved log-sum-exp that so large a value swamps,
        so there a row whose every key carries a huge finite mask value
        (``finfo.min``, ``-1e9``) gets inexact gradients: exclude keys with
        ``-inf`` or a bool mask.

    Dropout:
        The keep-mask is generated inside the backend from a ``(seed, offset)``
        pair drawn at call time from the generator of ``query``'s device, as a
        tensor on that device (the kernels read it there: no host sync, and a
        captured CUDA graph draws a new pair on every replay), so
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
        CPU cuts padded keys and the causal triangle out of the work.  Where
        it materializes the scores (short sequences: up to 40 x 40 scores
        per head, 128 x 128 when a backward pass will run; dropout,
        ``Ev != E``, one query row, devices other than the CPU) and a
        backward pass will run, it keeps the ``[B, Hq, Lq, Lk]``
        probabilities for it, as torch's math backend does.

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
    # A nested tensor of layout torch.strided is of type Tensor: is_nested reads each input's flag.
    if is_nested(query, key, value):
        return attend_jagged(scaled_dot_product_attention, query, key, value, attn_mask, dropout_p, is_causal, scale,
                             enable_gqa, key_padding_mask, backend)
    if isinstance(attn_mask, CausalBias):  # a tensor subclass that stands for the causal mask: no values
        query, key, value = autocast(query, query, key, value)
    else:
        query, key, value, attn_mask = autocast(query, query, key, value, attn_mask)
    call = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask, backend)
    plan_key = _plan_key(*call)
    plan = None if plan_key is None else _PLANS.get(plan_key, lambda kept: _check_plan(kept, *call))
    if plan is not None:
        args = plan.args
        if key_padding_mask is not None or args.dropout_p != 0.0:
            args = AttentionArgs(key_padding_mask, None, args.causal, args.scale, args.dropout_p,
                                 _dropout_seed(args.dropout_p, query.device))
        # The masks a plan takes never require grad (bool, or no mask).
        needs_backward = attention_forward.records_autograd(query, key, value)
        if plan.one_head:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        typed = (query, key, value, args, needs_backward, plan.backend)
        out = attention_forward.call_plain(plan.forward, typed, needs_backward)[0]
        return out.squeeze(1) if plan.one_head else out
    q, k, v, args, output_shape = _normalize(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask
    )
    chosen = select_backend("attention", OP_NAME, backend, query, q, k, v, args)  # raises as for any call
    if 0 in output_shape or k.shape[2] == 0:  # not numel(): it would fix a symbolic shape's sizes
        return _without_scores(q, k, v, args.attn_mask).view(output_shape)
    if args.dropout_p == 1.0:  # every weight dropped: as if no key were there
        mask = None if args.attn_mask is None else args.attn_mask[..., :0]
        return _without_scores(q, k[:, :, :0], v[:, :, :0], mask).view(output_shape)
    needs_backward = torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad
        or (args.attn_mask is not None and args.attn_mask.requires_grad)
    )
    form = None if plan_key is None else _plan_form(q, k, v, args, output_shape, *call)
    if form is not None:
        plan_args = dataclasses.replace(args, key_padding_mask=None, dropout_seed=None)
        forward = prepared_forward("attention", chosen, _attention_forward, q, k, v, args, needs_backward)
        _PLANS.put(plan_key, _Plan(chosen, plan_args, forward, form == "one_head"))
    out, _ = attention_forward(q, k, v, args, needs_backward, chosen)
    return out if out.shape == output_shape else out.view(output_shape)


# ----------------------------------------------------------------------------
# Call plans (_call_plans.py): the checked decisions of a call layout, kept
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The backend chosen for a layout, its :class:`AttentionArgs` without the call's own tensors
    (``key_padding_mask`` and ``dropout_seed`` are None), the registered forward's implementation
    for the layout (``prepared_forward``), and whether the call's 3-D inputs run as one head
    (see :func:`_plan_form`)."""

    backend: str
    args: AttentionArgs
    forward: Callable
    one_head: bool


_PLANS = CallPlans()


def _plan_key(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask, backend):
    """The layout of a call that may have a plan, or None: no ``attn_mask``, and scalars of the types
    the checks pass as they are.  Everything ``_normalize`` and ``select_backend`` read is in it."""
    if not (
        attn_mask is None and type(dropout_p) is float and type(is_causal) is bool and type(enable_gqa) is bool
        and (scale is None or (type(scale) is float and scale == scale))
    ):
        return None
    tensors = layout_key(backend, query, key, value, key_padding_mask)
    return None if tensors is None else (*tensors, dropout_p, is_causal, scale, enable_gqa)


def _plan_form(q, k, v, args, output_shape, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
               key_padding_mask, backend) -> Optional[str]:
    """How a plan runs the call as the checked route ran it (``q, k, v, args`` and the result's
    ``output_shape`` from :func:`_normalize`), or None where it cannot: ``"as_is"``, on the call's
    own tensors (no view, copy or expansion of any input, a result of the kernels' shape), or
    ``"one_head"``, on 3-D inputs ``[N, L, E]`` of one batch size, each seen as ``unsqueeze(1)``
    (a decoder's one-head attention, as ConvSeq2Seq's), the result without that dimension."""
    if args.key_padding_mask is not key_padding_mask:
        return None
    if q is query and k is key and v is value:
        return "as_is" if output_shape == (*q.shape[:3], v.shape[3]) else None
    inserted = all(_one_head_of(normalized, given) for normalized, given in ((q, query), (k, key), (v, value)))
    return "one_head" if inserted and output_shape == (q.shape[0], q.shape[2], v.shape[3]) else None


def _one_head_of(normalized: Tensor, given: Tensor) -> bool:
    """Whether ``normalized`` is ``given.unsqueeze(1)`` for a 3-D ``given``: its memory, with a
    dimension of one head inserted."""
    return (
        given.dim() == 3 and normalized.shape == (given.shape[0], 1, *given.shape[1:])
        and normalized.data_ptr() == given.data_ptr()
        and (normalized.stride(0), *normalized.stride()[2:]) == given.stride()
    )


def _check_plan(plan: _Plan, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask,
                backend) -> None:
    """Takes the checked route (with no dropout, whose seed would draw from the generator) and fails
    unless it decides what ``plan`` holds."""
    call = (query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, key_padding_mask)
    q, k, v, args, output_shape = _normalize(*call)
    args = dataclasses.replace(args, dropout_p=_check_scalars(dropout_p, scale, query.shape[-1])[0])
    chosen = select_backend("attention", OP_NAME, backend, query, q, k, v, args)
    form = _plan_form(q, k, v, args, output_shape, *call, backend)
    decided = (chosen, args.attn_mask, args.causal, args.scale, args.dropout_p, form == "one_head")
    kept = (plan.backend, plan.args.attn_mask, plan.args.causal, plan.args.scale, plan.args.dropout_p, plan.one_head)
    if decided != kept or form is None:
        raise AssertionError(f"the attention plan kept for this call's layout decides {kept}, the checks {decided}")


def _without_scores(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor]) -> Tensor:
    """A call with no score to compute (an empty output, or no keys: every row gives 0), as
    ``[B, Hq, Lq, Ev]`` over ``[B, Lq, Hq, Ev]`` memory like every backend's output, from matmuls
    over the empty scores, so that autograd connects every input (each gradient zeros, as torch
    gives them)."""
    group = query.shape[1] // max(key.shape[1], 1)
    if group > 1:  # grouped-query attention: each key/value head serves `group` query heads
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = torch.matmul(query, key.transpose(-1, -2))
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        scores = scores + attn_mask
    return torch.matmul(scores, value).transpose(1, 2).contiguous().transpose(1, 2)


# ----------------------------------------------------------------------------
# Argument checks and normalization
# ----------------------------------------------------------------------------


def _check_qkv(query: Tensor, key: Tensor, value: Tensor) -> tuple[torch.Size, torch.Size, torch.Size]:
    """The checked inputs' shapes (each read once: every attribute read is host time)."""
    named = (("query", query), ("key", key), ("value", value))
    for name, tensor in named:
        if not (isinstance(tensor, Tensor) and tensor.is_floating_point() and tensor.layout == torch.strided):
            check_tensor(name, tensor, floating=True)  # words the error
    query_shape, key_shape, value_shape = query.shape, key.shape, value.shape
    shapes = (query_shape, key_shape, value_shape)
    for (name, _), shape in zip(named, shapes):
        if len(shape) < 2:
            raise ValueError(f"{name} must have at least 2 dimensions [..., L, E], got shape {tuple(shape)}")
    # One comparison each in the common case; check_same_dtype_device words the error.
    if not (key.dtype == value.dtype == query.dtype and key.device == query.device and value.device == query.device):
        check_same_dtype_device("query", query, key=key, value=value)
    lk, head_dim = key_shape[-2], query_shape[-1]
    if value_shape[-2] != lk:
        raise ValueError(f"value must have key's length Lk={lk} in dimension -2, got shape {tuple(value_shape)}")
    if key_shape[-1] != head_dim:
        raise ValueError(f"key must have query's head dim E={head_dim} in dimension -1, got shape {tuple(key_shape)}")
    return shapes


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):  # torch's argument parser takes a bool only, not 0/1 or None
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _as_float(name: str, value: object) -> float:
    """A float argument as torch's parser takes it: a real number or a 0-dim tensor."""
    if isinstance(value, Tensor) and value.dim() == 0 and not value.is_complex():
        return float(value)
    if isinstance(value, numbers.Real) and not isinstance(value, Tensor):
        return float(value)
    raise TypeError(f"{name} must be a float, got {type(value).__name__}")


def _check_scalars(dropout_p: object, scale: object, head_dim: int) -> tuple[float, float]:
    dropout_p = _as_float("dropout_p", dropout_p)
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1], got {dropout_p!r}")
    if scale is not None:
        scale = _as_float("scale", scale)
    if head_dim == 0:  # every score is an empty sum, 0 whatever the scale (torch's 1 / sqrt(0) too)
        return dropout_p, 1.0
    return dropout_p, 1.0 / math.sqrt(head_dim) if scale is None else scale


def _causal_and_mask(
    query: Tensor, key: Tensor, attn_mask: object, is_causal: bool, enable_gqa: bool
) -> tuple[Causal, Optional[Tensor]]:
    """The causal kind, and ``attn_mask`` when it is a tensor (checked to broadcast to the scores)."""
    lq, lk = query.shape[-2], key.shape[-2]
    if isinstance(attn_mask, CausalBias):
        if is_causal:
            raise ValueError("attn_mask and is_causal=True cannot both be set; a CausalBias already is a causal mask")
        if attn_mask.variant == CausalVariant.UPPER_LEFT:
            return Causal.TOP_LEFT, None  # its lengths do not move the diagonal: torch ignores them too
        if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (lq, lk):
            raise ValueError(
                f"attn_mask is a lower-right CausalBias for Lq={attn_mask.seq_len_q}, Lk={attn_mask.seq_len_kv}, "
                f"but query has Lq={lq} and key has Lk={lk}"
            )
        return Causal.BOTTOM_RIGHT, None
    causal = Causal.TOP_LEFT if is_causal else Causal.NONE
    if attn_mask is None:
        return causal, None
    check_tensor("attn_mask", attn_mask)
    check_same_device("query", query, attn_mask=attn_mask)
    if attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):  # torch's rule
        raise TypeError(
            f"attn_mask must have dtype torch.bool, torch.float32 or query's dtype ({query.dtype}), got {attn_mask.dtype}"
        )
    scores_shape = (*inputs.score_batch_shape(query, key, enable_gqa), lq, lk)
    if not inputs.broadcasts_to(attn_mask.shape, scores_shape):
        raise ValueError(
            f"attn_mask of shape {tuple(attn_mask.shape)} cannot be broadcast to the shape of "
            f"query @ key^T, [..., Lq, Lk] = {scores_shape}"
        )
    return causal, attn_mask


def _check_key_padding_mask(query: Tensor, key_padding_mask: object, sequence_shape: tuple, lk: int) -> None:
    check_tensor("key_padding_mask", key_padding_mask, dtypes=(torch.bool,))
    if key_padding_mask.device != query.device:  # check_same_device words the error
        check_same_device("query", query, key_padding_mask=key_padding_mask)
    expected = (*sequence_shape, lk)
    if not inputs.broadcasts_to(key_padding_mask.shape, expected):
        raise ValueError(
            f"key_padding_mask must have shape [..., Lk] = {expected} (the output's batch dimensions without "
            f"heads, key's length) or one that broadcasts to it, got {tuple(key_padding_mask.shape)}"
        )


def _dropout_seed(dropout_p: float, device: torch.device) -> Optional[Tensor]:
    """The keep-mask's ``(seed, offset)`` from ``device``'s generator (``torch.manual_seed``
    reproduces it), on ``device``; None without dropout."""
    if dropout_p == 0.0:
        return None
    return torch.randint(0, 2**31 - 1, (2,), dtype=torch.int64, device=device)


def _normalize(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask):
    """The checked call as the backends take it: ``q [B, Hq, Lq, E]``, ``k [B, Hk, Lk, E]``,
    ``v [B, Hk, Lk, Ev]``, its :class:`AttentionArgs`, and the shape of the result."""
    _check_flag("is_causal", is_causal)
    _check_flag("enable_gqa", enable_gqa)
    query_shape, key_shape, value_shape = _check_qkv(query, key, value)
    lq, lk, head_dim, value_head_dim = query_shape[-2], key_shape[-2], query_shape[-1], value_shape[-1]
    ndim = max(len(query_shape), len(key_shape), len(value_shape))
    grouped_key, grouped_value = inputs.grouped_key_value(query, key, value, ndim) if enable_gqa else (key, value)
    q, k, v, lead_shape = inputs.broadcast_qkv(query, grouped_key, grouped_value, ndim, enable_gqa)
    # The output's batch dimensions without heads (key_padding_mask's) and with them: [*lead] and
    # [*lead, H] for 4-D and more, [N] for 3-D, none for 2-D.
    sequence_shape = lead_shape if ndim >= 3 else ()
    batch_shape = (*lead_shape, q.shape[-3]) if ndim >= 4 else sequence_shape
    dropout_p, scale = _check_scalars(dropout_p, scale, head_dim)
    causal, mask = _causal_and_mask(query, key, attn_mask, is_causal, enable_gqa)
    if mask is not None:
        mask = inputs.canonical(inputs.expanded(_dense_if_expanded(mask), (*batch_shape, lq, lk)), ndim)

    padding_lead_shape = None
    if key_padding_mask is not None:
        _check_key_padding_mask(query, key_padding_mask, sequence_shape, lk)
        padding_lead_shape = (1,) * (len(lead_shape) + 1 - key_padding_mask.dim()) + key_padding_mask.shape[:-1]

    # batch_split and fold return at once for one leading dimension (4-D inputs, the usual call).
    split = inputs.batch_split(lead_shape, [q, k, v, mask], padding_lead_shape)
    q, k, v = inputs.fold(q, split), inputs.fold(k, split), inputs.fold(v, split)
    if head_dim == 0:
        # Every score is an empty sum: exactly the scores of E = 1 and zero q and k, which every
        # backend serves; the sums keep query and key in the graph (their gradients are empty).
        q, k = q.sum(-1, keepdim=True), k.sum(-1, keepdim=True)
    if mask is not None:
        mask = inputs.fold(mask, split)
    padding = None
    if key_padding_mask is not None:
        # Constant along the dimensions folded into heads (batch_split made sure): one row per batch element.
        padding = inputs.expanded(key_padding_mask, (*lead_shape, lk))
        if split < len(lead_shape):
            padding = padding[(slice(None),) * split + (0,) * (len(lead_shape) - split)]
        if padding.dim() != 2:  # both sizes spelled out: -1 is ambiguous without keys
            padding = padding.reshape(math.prod(padding.shape[:-1]), lk)
        padding = padding.contiguous()

    args = AttentionArgs(padding, mask, causal, scale, dropout_p, _dropout_seed(dropout_p, query.device))
    return q, k, v, args, torch.Size((*batch_shape, lq, value_head_dim))


# ----------------------------------------------------------------------------
# Registered ops
# ----------------------------------------------------------------------------

# The forward's second output is what the backend keeps for its backward pass besides the inputs
# and ``out``: the row log-sum-exps (``empty_lse``), or the eager backend's probabilities on short
# sequences.  ``needs_backward`` (autograd will differentiate the call) lets a backend keep more
# when it pays; the second output is not differentiable, and its layout is the backend's
# (``empty_saved``).
attention_forward = RegisteredOp(
    "attention_forward", ("Tensor query", "Tensor key", "Tensor value"), AttentionArgs, "(Tensor, Tensor)",
    flags=("bool needs_backward",),
)
attention_backward = RegisteredOp(
    "attention_backward",
    ("Tensor grad_out", "Tensor query", "Tensor key", "Tensor value", "Tensor out", "Tensor saved"),
    AttentionArgs,
    "(Tensor, Tensor, Tensor, Tensor)",
    flags=("bool attn_mask_needs_grad",),
)


@attention_forward.implement
def _attention_forward(query: Tensor, key: Tensor, value: Tensor, args: AttentionArgs, needs_backward, backend):
    """``out`` (:func:`empty_output`'s layout) and what the backend saves (its ``empty_saved``)."""
    return backend_module("attention", backend).forward(query, key, value, args, needs_backward)


@attention_forward.fake
def _attention_forward_fake(query, key, value, args, needs_backward, backend):
    return empty_output(query, value), backend_module("attention", backend).empty_saved(
        query, key, value, args, needs_backward
    )


@attention_backward.implement
def _attention_backward(grad_out, query, key, value, out, saved, args: AttentionArgs, attn_mask_needs_grad, backend):
    """``dq, dk, dv`` (:func:`empty_grads`'s layout) and ``dmask``: the attn_mask's gradient
    ``[B, Hq, Lq, Lk]`` in :func:`dmask_dtype` when ``attn_mask_needs_grad``, else empty."""
    dq, dk, dv, dmask = backend_module("attention", backend).backward(
        grad_out, query, key, value, out, saved, args, attn_mask_needs_grad
    )
    if attn_mask_needs_grad:
        dmask = dmask.to(dmask_dtype(args.attn_mask.dtype)).contiguous()
    return dq, dk, dv, dmask


@attention_backward.fake
def _attention_backward_fake(grad_out, query, key, value, out, saved, args, attn_mask_needs_grad, backend):
    if attn_mask_needs_grad:
        dmask = args.attn_mask.new_empty(args.attn_mask.shape, dtype=dmask_dtype(args.attn_mask.dtype))
    else:
        dmask = query.new_empty(0, dtype=torch.float32)
    module = backend_module("attention", backend)
    contiguous = module.grads_contiguous(query, key, value, saved, args, attn_mask_needs_grad)
    return (*empty_grads(query, key, value, contiguous), dmask)


def _setup_context(ctx, tensors, args: AttentionArgs, output) -> None:
    out, saved = output
    ctx.save_for_backward(*tensors, out, saved, args.key_padding_mask, args.attn_mask, args.dropout_seed)
    # saved is for backward only: no gradient flows into it, so none is allocated (as zeros) for it.
    ctx.mark_non_differentiable(saved)
    ctx.set_materialize_grads(False)
    # Tensors travel through save_for_backward only (autograd checks them for in-place changes).
    ctx.scalars = (args.causal, args.scale, args.dropout_p)
    ctx.attn_mask_needs_grad = args.attn_mask is not None and attention_forward.needs_grad(ctx, "attn_mask")


def _backward(ctx, grad_out, _grad_saved):
    if grad_out is None:
        return (None, None, None), {}
    query, key, value, out, saved, key_padding_mask, attn_mask, dropout_seed = ctx.saved_tensors
    causal, scale, dropout_p = ctx.scalars
    args = AttentionArgs(key_padding_mask, attn_mask, causal, scale, dropout_p, dropout_seed)
    runner = attention_forward.backward_runner(
        ctx, grad_out, query, key, value, out, saved, key_padding_mask, attn_mask, dropout_seed
    )
    dq, dk, dv, dmask = attention_backward.call_planned(
        runner, grad_out, query, key, value, out, saved, args, ctx.attn_mask_needs_grad, ctx.backend
    )
    grad_mask = _mask_gradient(dmask, attn_mask) if ctx.attn_mask_needs_grad else None
    return (dq, dk, dv), {"attn_mask": grad_mask}


def _dense_if_expanded(attn_mask: Tensor) -> Tensor:
    """The caller's ``attn_mask``, or a dense copy of it where it is a 16-bit mask that requires grad
    and is itself expanded (stride 0 along a dimension longer than 1): its gradient must then be
    element-wise, as torch's math gives it.  :func:`_mask_gradient` sums a 16-bit gradient over the
    op's broadcast dimensions and leaves the sums in the first slice, which is right only where
    autograd sums over those dimensions next: the expand the public function itself makes."""
    if (attn_mask.requires_grad and attn_mask.dtype in (torch.float16, torch.bfloat16)
            and any(stride == 0 and size > 1 for size, stride in zip(attn_mask.shape, attn_mask.stride()))):
        return attn_mask.contiguous()
    return attn_mask


def _mask_gradient(dmask: Tensor, attn_mask: Tensor) -> Tensor:
    """``dmask`` (float32 or wider) as the gradient of the op's ``attn_mask``, a view of the
    caller's mask that may be broadcast (stride 0) along some dimensions, over which autograd sums
    the gradient in the mask's dtype.  For a 16-bit mask those sums are taken here in ``dmask``'s
    precision and rounded once, as torch's math does (autograd would add up values each rounded to
    16 bits: a per-head bfloat16 mask's gradient, exactly 0, came out as -0.016): each sum sits in
    the first slice along those dimensions, zeros in the others, which autograd's sum leaves exact."""
    broadcast = [d for d in range(attn_mask.dim()) if attn_mask.stride(d) == 0 and attn_mask.shape[d] > 1]
    if not broadcast or attn_mask.dtype not in (torch.float16, torch.bfloat16):
        return dmask.to(attn_mask.dtype)
    grad = torch.zeros(attn_mask.shape, dtype=attn_mask.dtype, device=attn_mask.device)
    first = tuple(slice(0, 1) if d in broadcast else slice(None) for d in range(attn_mask.dim()))
    grad[first] = dmask.sum(broadcast, keepdim=True)
    return grad


attention_forward.register_autograd(_backward, _setup_context)


@attention_forward.count_flops
def _attention_forward_flops(query, key, value, args, needs_backward, backend) -> int:
    """torch's count for its SDPA: ``Q K^T`` and ``P V``, whatever the masks let the kernels skip."""
    batch, heads, length_q, head_dim = query
    return 2 * batch * heads * length_q * key[2] * (head_dim + value[3])


@attention_backward.count_flops
def _attention_backward_flops(grad_out, query, key, value, out, saved, args, attn_mask_needs_grad, backend) -> int:
    """torch's count for its SDPA's backward: the scores again, then ``dP``, ``dV``, ``dQ`` and ``dK``."""
    batch, heads, length_q, head_dim = query
    return 2 * batch * heads * length_q * key[2] * (3 * head_dim + 2 * value[3])
