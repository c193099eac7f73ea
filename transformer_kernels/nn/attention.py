"""``MultiheadAttention``: ``torch.nn.MultiheadAttention`` on the fused QKV projection
and masked attention."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..ops._autocast import autocast_enabled
from ..ops.attention import scaled_dot_product_attention
from ..ops.qkv import qkv_projection
from ._attention_masks import AttentionMasks, sdpa_masks
from ._checks import check_backend

__all__ = ["MultiheadAttention"]


class MultiheadAttention(torch.nn.MultiheadAttention):
    r"""``torch.nn.MultiheadAttention`` running on :func:`transformer_kernels.qkv_projection`
    and :func:`transformer_kernels.scaled_dot_product_attention`.

    A subclass of :class:`torch.nn.MultiheadAttention` with its constructor, parameters
    (``in_proj_weight``, or ``q_proj_weight``/``k_proj_weight``/``v_proj_weight`` when
    ``kdim``/``vdim`` differ from ``embed_dim``; ``in_proj_bias``, ``bias_k``, ``bias_v``,
    ``out_proj.weight``, ``out_proj.bias``), initialization and ``state_dict``, so either
    module's ``state_dict`` loads into the other with ``strict=True``, and ``isinstance``
    checks for ``torch.nn.MultiheadAttention`` (torch's ``TransformerEncoderLayer``'s) hold.
    :func:`transformer_kernels.nn.replace_modules` turns the attention layers of an existing
    model into this class in place.

    Args:
        embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim,
        batch_first, device, dtype: as in :class:`torch.nn.MultiheadAttention`.
        backend: ``None`` (follow :func:`transformer_kernels.use_backend` and the
            ``TRANSFORMER_KERNELS_BACKEND`` environment variable), ``"auto"``,
            ``"triton"``, ``"cuda"`` or ``"eager"``: the backend of every fused op this
            module calls.  A plain attribute, not part of the ``state_dict``.

    Forward: ``forward(query, key, value, key_padding_mask=None, need_weights=True,
    attn_mask=None, average_attn_weights=True, is_causal=False)`` takes and returns what
    torch's does, with ``N`` the batch size, ``L`` the target and ``S`` the source length:

    - ``query`` ``[N, L, E]`` (``batch_first=True``), ``[L, N, E]`` (``batch_first=False``)
      or ``[L, E]`` (unbatched); ``key`` and ``value`` likewise with ``S`` and
      ``kdim``/``vdim`` features.
    - ``key_padding_mask``: ``[N, S]`` (``[S]`` unbatched), bool with True marking a padding
      key that no query attends to, or float and added to the scores.
    - ``attn_mask``: ``[L, S]`` (the same for every sequence and head) or
      ``[N * num_heads, L, S]``, bool with True marking a pair that is *not* allowed to
      attend (the opposite of :func:`torch.nn.functional.scaled_dot_product_attention`'s
      convention), or float and added to the scores.  Float masks have ``query``'s dtype (or,
      with ``need_weights=False``, float32, as torch's SDPA path takes them).
    - ``is_causal``: a hint that ``attn_mask`` is the causal mask; it needs an ``attn_mask``.
      As in torch, with no ``key_padding_mask`` and ``need_weights=False`` the mask is then
      not read and a top-left causal mask is applied instead (no mask is built); otherwise
      ``attn_mask`` is applied and the hint ignored.
    - Returns ``(attn_output, attn_weights)``: ``attn_output`` has ``query``'s shape (and
      ``embed_dim`` features); ``attn_weights`` is None when ``need_weights=False``, else
      ``[N, L, S]`` averaged over heads (``average_attn_weights=True``) or
      ``[N, num_heads, L, S]`` (unbatched: without ``N``).  ``add_bias_kv`` and
      ``add_zero_attn`` each add one key, so ``S`` is then larger by 1 or 2, as in torch.
    - In training, ``dropout`` drops attention weights (none in ``eval()``).

    How it runs:

    - ``need_weights=False`` (the fast path; torch's ``TransformerEncoderLayer`` and
      ``TransformerDecoderLayer`` ask for it): self-attention (``query is key is value``)
      is one :func:`~transformer_kernels.qkv_projection` with ``in_proj_weight``;
      cross-attention with ``key is value`` is a query projection plus one packed
      key/value projection; distinct tensors, or ``kdim``/``vdim`` weights, are projected
      one at a time.  Then :func:`~transformer_kernels.scaled_dot_product_attention` gets a
      bool ``key_padding_mask`` as it is, never expanded to ``[N, H, L, S]``, and a 2-D
      ``attn_mask`` as ``[L, S]`` (read broadcast).  Dropout is drawn inside the attention
      op from the generator of the inputs' device: ``torch.manual_seed`` reproduces it, but the
      dropped positions differ from torch's for the same seed.
    - A float ``key_padding_mask`` is added to the scores through ``attn_mask``: read as a
      ``[N, 1, 1, S]`` view when it is the only mask, and summed with ``attn_mask`` into a
      ``[N, H or 1, L, S]`` tensor when both are given (what torch always builds).  The
      attention can then no longer skip padded keys, so prefer a bool mask.  (torch's
      ``TransformerEncoder`` and ``TransformerEncoderLayer`` convert a bool
      ``src_key_padding_mask`` to float before it reaches ``self_attn``.)
    - ``need_weights=True`` (torch's default) runs a slower path, torch's own math end to
      end: ``F.linear`` projections, the ``[N, H, L, S]`` scores with the masks added, softmax,
      ``F.dropout`` and ``@ value``; it returns the probabilities it used, so they are
      torch's (with dropout in training, the dropped ones, drawn as torch draws them).
    - Under ``torch.autocast`` the projections run in the autocast dtype, as ``nn.Linear``
      does, and a float mask is cast to it, as torch's attention casts it.
    - Nested tensor inputs run torch's own ``forward`` (its inference fast path is the
      only one that takes them).

    Differences from torch:

    - A query row whose keys are all masked (an all-padding sequence, a mask row that is
      all True or ``-inf``) attends to nothing: its attention is 0 and its gradient 0, so
      its output is ``out_proj.bias``, and its ``attn_weights`` row is 0.  torch gives that
      on its CPU SDPA path but NaN on its ``need_weights=True`` path and its inference
      fast path.
    - On the fused path dropout masks differ from torch's for the same seed (the
      statistics are the same).
    - With ``batch_first=True`` the output is contiguous (torch returns a transposed view).
    - A bool ``key_padding_mask`` or ``attn_mask`` is saved for the backward pass, not
      copied: changing it in place before that pass raises autograd's "modified by an
      inplace operation" (torch works from a float copy and does not).
    - ``torch.jit.script`` cannot compile it (``torch.compile`` can, ``fullgraph=True``).
      ``torch.jit.trace`` records it, but with parameters that require grad its check finds
      the attention op's flag "a backward pass will run" differing between its traces: trace
      with ``check_trace=False``, or under ``torch.no_grad()`` for inference.
    - In ``eval()`` under ``torch.no_grad()``, torch's ``TransformerEncoderLayer`` may take
      its fast path, which calls ``torch._transformer_encoder_layer_fwd`` with this
      module's weights and never calls ``forward``: such layers compute with torch's own
      fused inference kernel, unchanged.
    - ``is_causal=True`` without an ``attn_mask`` raises, as torch's module does, also where
      torch's own inference fast path (``eval()`` under ``torch.no_grad()``) accepts it and
      ignores the hint, attending to every key: so ``nn.TransformerDecoder(...,
      tgt_is_causal=True)`` without a ``tgt_mask`` raises here in inference too.
    - The weights are read once per call: a parametrization on them (``spectral_norm``,
      whose power iteration runs on every read) steps once per call here, where torch's
      batched self-attention reads ``in_proj_weight`` three times (its fast-path checks).

    Example::

        >>> mha = transformer_kernels.nn.MultiheadAttention(512, 8, batch_first=True)
        >>> x = torch.randn(128, 40, 512)
        >>> padding = torch.arange(40) >= torch.randint(8, 41, (128, 1))   # [128, 40], True = padding
        >>> out, _ = mha(x, x, x, key_padding_mask=padding, need_weights=False)
        >>> out.shape
        torch.Size([128, 40, 512])
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        batch_first: bool = False,
        device=None,
        dtype=None,
        *,
        backend: Optional[str] = None,
    ) -> None:
        super().__init__(
            embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first, device, dtype
        )
        self.backend = check_backend(backend)

    def extra_repr(self) -> str:
        return "" if self.backend is None else f"backend={self.backend!r}"

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Optional[Tensor]]:
        """See the class docstring: torch's arguments, shapes and outputs."""
        for name, tensor in (("query", query), ("key", key), ("value", value)):
            if not isinstance(tensor, Tensor):  # before reading their attributes: a clear error
                raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if query.is_nested or key.is_nested or value.is_nested:
            return super().forward(
                query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
            )
        # Read once: a parametrization of out_proj.weight (spectral_norm's power iteration) computes
        # it on every read, and torch's forward reads it once.
        out_weight = self.out_proj.weight
        is_batched = self._check_inputs(query, key, value, key_padding_mask, out_weight.dtype)
        self_attention = query is key and key is value
        shared_key_value = key is value
        if not is_batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        batch, tgt_len, src_len = query.shape[0], query.shape[1], key.shape[1]
        masks = sdpa_masks(
            attn_mask, key_padding_mask, is_causal=is_causal, need_weights=need_weights, batch=batch,
            num_heads=self.num_heads, tgt_len=tgt_len, src_len=src_len, dtype=query.dtype,
        )

        if need_weights:
            q, k, v = (self._project_unfused(x, w, b) for x, (w, b) in zip((query, key, value),
                                                                           self._projection_weights()))
        else:
            q, k, v = self._project_fused(query, key, value, self_attention, shared_key_value)
        k, v, masks = self._append_keys(k, v, masks.in_dtype(q.dtype))  # q's dtype: autocast's, if enabled
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            attn, weights = self._attention_with_weights(q, k, v, masks, dropout_p)
            if average_attn_weights:
                weights = weights.mean(dim=1)
        else:
            attn = scaled_dot_product_attention(
                q, k, v, masks.attn_mask, dropout_p, masks.is_causal,
                key_padding_mask=masks.key_padding_mask, backend=self.backend,
            )
            weights = None

        # [N, H, L, Dh] -> [N, L, E]: free on the fused path (its output lies over [N, L, H, Dh]).
        attn = attn.transpose(1, 2).reshape(batch, tgt_len, self.embed_dim)
        # out_proj's parameters, not the module: torch's forward never calls it (nor its hooks).
        if not is_batched:
            out = F.linear(attn.squeeze(0), out_weight, self.out_proj.bias)
            return out, None if weights is None else weights.squeeze(0)
        if not self.batch_first:
            attn = attn.transpose(0, 1)  # the projection then writes torch's contiguous [L, N, E]
        return F.linear(attn, out_weight, self.out_proj.bias), weights

    # ------------------------------------------------------------------ steps of forward

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor],
                      parameters_dtype: torch.dtype) -> bool:
        """torch's input checks, with its exception types, on tensors; returns whether the input is
        batched."""
        if query.dim() not in (2, 3):
            raise AssertionError(
                f"query should be unbatched 2D or batched 3D tensor but received {query.dim()}-D query tensor"
            )
        is_batched = query.dim() == 3
        kind = "batched (3-D)" if is_batched else "unbatched (2-D)"
        if key.dim() != query.dim() or value.dim() != query.dim():
            raise AssertionError(
                f"For {kind} `query`, expected `key` and `value` to be {query.dim()}-D but found "
                f"{key.dim()}-D and {value.dim()}-D tensors respectively"
            )
        if key_padding_mask is not None and key_padding_mask.dim() != query.dim() - 1:
            raise AssertionError(
                f"For {kind} `query`, expected `key_padding_mask` to be `None` or {query.dim() - 1}-D but found "
                f"{key_padding_mask.dim()}-D tensor instead"
            )
        for name, tensor, features in (
            ("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)
        ):
            if tensor.shape[-1] != features:
                raise AssertionError(
                    f"{name} must have {features} features in its last dimension "
                    f"({'embed_dim' if name == 'query' else name[0] + 'dim'}), got shape {tuple(tensor.shape)}"
                )
        if key.shape[:-1] != value.shape[:-1]:
            raise AssertionError(
                f"key and value must have the same sequence and batch dimensions, "
                f"got key {tuple(key.shape)} and value {tuple(value.shape)}"
            )
        if not autocast_enabled(query.device.type):  # else the projections cast, as nn.Linear's do
            for name, tensor in (("query", query), ("key", key), ("value", value)):
                if tensor.dtype != parameters_dtype:
                    raise RuntimeError(
                        f"{name} must have the module's parameters' dtype {parameters_dtype}, got {tensor.dtype}"
                    )
        batch_dim = 0 if self.batch_first else 1
        if is_batched and key.shape[batch_dim] != query.shape[batch_dim]:
            raise RuntimeError(
                f"key must have query's batch size {query.shape[batch_dim]} in dimension {batch_dim}, "
                f"got shape {tuple(key.shape)}"
            )
        return is_batched

    def _projection_weights(self) -> tuple[tuple[Tensor, Optional[Tensor]], ...]:
        """``(weight, bias)`` of the query, key and value projections."""
        if self._qkv_same_embed_dim:
            weights = self.in_proj_weight.chunk(3)
        else:
            weights = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        bias = self.in_proj_bias  # each parameter read once (a parametrization runs on every read)
        biases = (None, None, None) if bias is None else bias.chunk(3)
        return tuple(zip(weights, biases))

    def _query_and_key_value_rows(self) -> tuple[tuple[Tensor, Optional[Tensor]], tuple[Tensor, Optional[Tensor]]]:
        """``(weight, bias)`` of the query projection and of the key-value pair, from one split of the
        packed ``in_proj_weight`` and ``in_proj_bias``: backward joins the parts' gradients in one op,
        where a slice per part fills a zero gradient of the whole parameter per part and adds them."""
        sizes = [self.embed_dim, 2 * self.embed_dim]
        q_weight, kv_weight = self.in_proj_weight.split(sizes)
        bias = self.in_proj_bias
        q_bias, kv_bias = (None, None) if bias is None else bias.split(sizes)
        return (q_weight, q_bias), (kv_weight, kv_bias)

    def _project_fused(
        self, query: Tensor, key: Tensor, value: Tensor, self_attention: bool, shared_key_value: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``q [N, H, L, Dh]``, ``k`` and ``v`` ``[N, H, S, Dh]`` from ``[N, L|S, *]`` inputs with the
        fewest :func:`qkv_projection` calls the weights and the inputs' identities allow (torch's
        ``_in_projection_packed`` packs the same way)."""
        heads, backend = self.num_heads, self.backend
        if self._qkv_same_embed_dim and self_attention:
            return qkv_projection(query, self.in_proj_weight, self.in_proj_bias, num_heads=heads, backend=backend)
        if self._qkv_same_embed_dim and shared_key_value:
            (q_weight, q_bias), (kv_weight, kv_bias) = self._query_and_key_value_rows()
            (q,) = qkv_projection(query, q_weight, q_bias, num_heads=heads, backend=backend)
            k, v = qkv_projection(key, kv_weight, kv_bias, num_heads=heads, backend=backend)
            return q, k, v
        projected = []
        for x, (w, b) in zip((query, key, value), self._projection_weights()):
            if w.shape[0] == w.shape[1]:
                projected.append(qkv_projection(x, w, b, num_heads=heads, backend=backend)[0])
            else:  # kdim or vdim != embed_dim: qkv_projection takes [E, E] weights only
                projected.append(self._project_unfused(x, w, b))
        return tuple(projected)

    def _project_unfused(self, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        """torch's projection: ``F.linear`` then the head split, ``[N, len, *]`` -> ``[N, H, len, Dh]``."""
        batch, length, _ = x.shape
        return F.linear(x, weight, bias).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)

    def _append_keys(self, k: Tensor, v: Tensor, masks: AttentionMasks) -> tuple[Tensor, Tensor, AttentionMasks]:
        """``add_bias_kv`` appends ``bias_k``/``bias_v`` as one more key/value, then ``add_zero_attn``
        a zero key/value, in torch's order; every query may attend to them."""
        appended = 0
        batch, heads, _, head_dim = k.shape
        bias_k = self.bias_k  # read once, as every parameter
        if bias_k is not None:
            k = torch.cat([k, bias_k.view(1, heads, 1, head_dim).expand(batch, -1, -1, -1)], dim=2)
            v = torch.cat([v, self.bias_v.view(1, heads, 1, head_dim).expand(batch, -1, -1, -1)], dim=2)
            appended += 1
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(batch, heads, 1, head_dim)], dim=2)
            v = torch.cat([v, v.new_zeros(batch, heads, 1, head_dim)], dim=2)
            appended += 1
        return k, v, masks if appended == 0 else masks.with_allowed_keys(appended)

    def _attention_with_weights(
        self, q: Tensor, k: Tensor, v: Tensor, masks: AttentionMasks, dropout_p: float
    ) -> tuple[Tensor, Tensor]:
        """torch's ``need_weights=True`` math on ``[N, H, *, Dh]`` tensors: ``(attn [N, H, L, Dh],
        weights [N, H, L, S])``, except that a row with every key masked gets weights 0 (not NaN)."""
        scores = masks.apply_to_scores(torch.matmul(q * math.sqrt(1.0 / self.head_dim), k.transpose(-2, -1)))
        if masks.attn_mask is None and masks.key_padding_mask is None:
            weights = torch.softmax(scores, dim=-1)
        else:
            # A row without keys: softmax over zeros, then 0, so neither its value nor its
            # gradient is NaN.
            empty = torch.isneginf(scores).all(dim=-1, keepdim=True)
            weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p)
        return torch.matmul(weights, v), weights

