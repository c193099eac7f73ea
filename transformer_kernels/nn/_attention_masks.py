"""The masks of one :class:`transformer_kernels.nn.MultiheadAttention` call, from
``torch.nn.MultiheadAttention``'s conventions to the form
:func:`transformer_kernels.scaled_dot_product_attention` takes.

torch's module turns every bool mask into a float one (``-inf`` where True)
with ``F._canonical_mask`` and adds the key padding mask to ``attn_mask``,
a scores-sized ``[N * H, L, S]`` tensor when both are given.  Here a bool mask
stays bool: ``attn_mask`` is inverted once (torch's MHA says True = *not*
allowed, SDPA says True = *may* attend) and a bool ``key_padding_mask`` goes
to SDPA's ``key_padding_mask`` as it is.  Only a float ``key_padding_mask``,
which SDPA's bool argument cannot carry, is folded into ``attn_mask``.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class AttentionMasks:
    """SDPA's masks for queries ``[N, H, L, Dh]`` and keys ``[N, H, S, Dh]``.

    - ``attn_mask``: bool (True = may attend) or float (added to the scores),
      ``[L, S]``, ``[N, H, L, S]`` or ``[N, 1, 1, S]``; or None.
    - ``key_padding_mask``: bool ``[N, S]``, True = padding; or None.
    - ``is_causal``: top-left causal mask, applied structurally.  True only where
      torch's ``multi_head_attention_forward`` drops ``attn_mask`` for the
      ``is_causal`` hint: no key padding mask and ``need_weights=False``.
    """

    attn_mask: Optional[Tensor]
    key_padding_mask: Optional[Tensor]
    is_causal: bool

    def with_allowed_keys(self, count: int) -> "AttentionMasks":
        """The masks for ``count`` keys appended after the ``S`` keys (``add_bias_kv``,
        ``add_zero_attn``): every query may attend to them, as torch pads its masks with 0."""
        attn_mask, padding = self.attn_mask, self.key_padding_mask
        if attn_mask is not None:
            attn_mask = F.pad(attn_mask, (0, count), value=True if attn_mask.dtype == torch.bool else 0.0)
        if padding is not None:
            padding = F.pad(padding, (0, count), value=False)
        return AttentionMasks(attn_mask, padding, self.is_causal)

    def in_dtype(self, dtype: torch.dtype) -> "AttentionMasks":
        """The masks for scores of ``dtype``: a float ``attn_mask`` cast to it, as ``torch.autocast``
        casts the mask of torch's attention to the autocast dtype of the projections."""
        attn_mask = self.attn_mask
        if attn_mask is None or attn_mask.dtype in (torch.bool, dtype):
            return self
        return AttentionMasks(attn_mask.to(dtype), self.key_padding_mask, self.is_causal)

    def apply_to_scores(self, scores: Tensor) -> Tensor:
        """``scores [N, H, L, S]`` with the masks applied as torch applies them: a float
        mask added, ``-inf`` at every excluded key (``is_causal`` is never set here)."""
        attn_mask, padding = self.attn_mask, self.key_padding_mask
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                scores = scores.masked_fill(~attn_mask, float("-inf"))
            else:
                scores = scores + attn_mask
        if padding is not None:
            scores = scores.masked_fill(padding[:, None, None, :], float("-inf"))
        return scores


def _check_dtype(name: str, mask: Optional[Tensor], dtype: torch.dtype, need_weights: bool) -> None:
    """As torch checks: a float mask of query's dtype, or, where SDPA runs (``need_weights=False``),
    float32 too (``nn.Transformer.generate_square_subsequent_mask`` makes float32 masks)."""
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise AssertionError(f"only bool and floating types of {name} are supported, got {mask.dtype}")
    allowed = (dtype,) if need_weights else (dtype, torch.float32)
    if mask.is_floating_point() and mask.dtype not in allowed:
        also = "" if need_weights or dtype == torch.float32 else " or, with need_weights=False, float32"
        raise RuntimeError(f"a float {name} must have query's dtype ({dtype}){also}, got {mask.dtype}")


def _attn_mask_4d(attn_mask: Tensor, batch: int, num_heads: int, tgt_len: int, src_len: int) -> Tensor:
    """``attn_mask`` ``[L, S]`` (kept 2-D: it broadcasts) or ``[N * H, L, S]`` as ``[N, H, L, S]``."""
    if attn_mask.dim() == 2:
        if attn_mask.shape != (tgt_len, src_len):
            raise RuntimeError(
                f"The shape of the 2D attn_mask is {tuple(attn_mask.shape)}, but should be {(tgt_len, src_len)}."
            )
        return attn_mask
    if attn_mask.shape != (batch * num_heads, tgt_len, src_len):
        raise RuntimeError(
            f"The shape of the 3D attn_mask is {tuple(attn_mask.shape)}, but should be "
            f"{(batch * num_heads, tgt_len, src_len)} (N * num_heads, L, S)."
        )
    return attn_mask.view(batch, num_heads, tgt_len, src_len)


def sdpa_masks(
    attn_mask: Optional[Tensor],
    key_padding_mask: Optional[Tensor],
    *,
    is_causal: bool,
    need_weights: bool,
    batch: int,
    num_heads: int,
    tgt_len: int,
    src_len: int,
    dtype: torch.dtype,
) -> AttentionMasks:
    """torch's MHA masks (``attn_mask`` 2-D or 3-D, ``key_padding_mask`` ``[N, S]``, both bool
    with True = not allowed, or float and added) as :class:`AttentionMasks`.

    Follows ``F.multi_head_attention_forward``: ``is_causal`` is a hint that needs an
    ``attn_mask``; with no key padding mask and ``need_weights=False`` torch drops the mask
    (unchecked) and applies a causal one, anywhere else it applies the mask and ignores
    the hint.  Mask dtypes that differ warn as torch warns.
    """
    _check_dtype("key_padding_mask", key_padding_mask, dtype, need_weights)
    _check_dtype("attn_mask", attn_mask, dtype, need_weights)
    if key_padding_mask is not None and attn_mask is not None and key_padding_mask.dtype != attn_mask.dtype:
        warnings.warn(
            "Support for mismatched key_padding_mask and attn_mask is deprecated. Use same type for both instead.",
            stacklevel=3,
        )
    if attn_mask is not None and attn_mask.dim() not in (2, 3):
        raise AssertionError(f"attn_mask must be 2-D (L, S) or 3-D (N * num_heads, L, S), got {attn_mask.dim()}-D")
    if key_padding_mask is not None and key_padding_mask.shape != (batch, src_len):
        raise AssertionError(
            f"key_padding_mask must have shape (N, S) = {(batch, src_len)}, got {tuple(key_padding_mask.shape)}"
        )
    if is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. You may use the Transformer module method "
            "`generate_square_subsequent_mask` to create this mask."
        )
    if is_causal and key_padding_mask is None and not need_weights:
        return AttentionMasks(None, None, True)

    if attn_mask is not None:
        attn_mask = _attn_mask_4d(attn_mask, batch, num_heads, tgt_len, src_len)
        if attn_mask.dtype == torch.bool:
            attn_mask = ~attn_mask
    if key_padding_mask is None or key_padding_mask.dtype == torch.bool:
        return AttentionMasks(attn_mask, key_padding_mask, False)

    # A float key padding mask: added to the scores through attn_mask, as a [N, 1, 1, S] view when it is
    # the only mask; with an attn_mask the sum is materialized, [N, H or 1, L, S].
    padding = key_padding_mask.view(batch, 1, 1, src_len)
    if attn_mask is None:
        return AttentionMasks(padding, None, False)
    if attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill_(
            ~attn_mask, float("-inf")
        )
    return AttentionMasks(attn_mask + padding, None, False)
