"""The seeds' encoder-decoder Transformer on the fused attention ops, with cached generation.

``Transformer.transformer`` is the encoder-decoder stack laid out exactly as
``torch.nn.Transformer(..., batch_first=True)`` lays out its modules (post-LN layers with
torch's names and a final norm after each stack), so their ``state_dict``\\ s are
interchangeable.  Each attention layer keeps its projection and its attention apart
(:meth:`_Attention.project`, :meth:`_Attention.attend`) so that the decoder can cache keys
and values while generating.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import reference
from .._backend import select_backend
from .._checks import check_int
from ..nn import MultiheadAttention
from ..ops._autocast import autocast_enabled
from ..ops.attention import OP_NAME as ATTENTION_NAME
from ..ops.attention import AttentionArgs, Causal, attention_forward, scaled_dot_product_attention
from ..ops.qkv import QkvProjectionArgs, qkv_projection, qkv_projection_forward
from . import generation

__all__ = ["Transformer"]

_IMPLS = ("fused", "reference")

class Transformer(nn.Module):
    r"""The seeds' encoder-decoder Transformer (Vaswani et al., 2017), on
    :func:`transformer_kernels.qkv_projection` and
    :func:`transformer_kernels.scaled_dot_product_attention`.

    - Token embeddings scaled by :math:`\sqrt{d_{model}}`, plus sinusoidal positions
      (:math:`PE_{p, 2i} = \sin(p / 10000^{2i/d_{model}})`, :math:`PE_{p, 2i+1} = \cos(\cdot)`),
      then dropout.
    - Post-LN encoder and decoder layers (attention, then a ReLU feed-forward; each sublayer
      ``norm(x + dropout(sublayer(x)))``), and a final LayerNorm after each stack, exactly as
      ``torch.nn.Transformer`` computes them.
    - Source tokens equal to ``pad_index`` are padding: no encoder query and no decoder
      (cross-attention) query attends to them.  The decoder's self-attention is causal; target
      padding needs no mask of its own, since it follows a target's tokens and each position sees
      only itself and the positions before it.
    - A linear output projection to ``tgt_vocab_size`` logits.

    Args:
        src_vocab_size, tgt_vocab_size: the vocabulary sizes.
        d_model: the embedding and model width ``E``.
        nhead: attention heads; must divide ``d_model``.
        num_encoder_layers, num_decoder_layers: layers in each stack.
        dim_feedforward: the feed-forward's hidden width.
        dropout: dropout on the embedded inputs, the attention weights, the feed-forward's
            hidden layer and every sublayer's output, as in ``torch.nn.Transformer``.
        max_len: the longest source or target sequence (the positions' table size).
        pad_index: the padding token of both vocabularies.
        impl: ``"fused"`` computes attention with the fused ops
            (:func:`~transformer_kernels.qkv_projection` with the packed ``in_proj_weight``,
            :func:`~transformer_kernels.scaled_dot_product_attention` with the source padding as its
            ``key_padding_mask`` and ``is_causal`` for the decoder, never an expanded mask);
            ``"reference"`` with the seeds' naive math (:mod:`transformer_kernels.reference`:
            three separate projections, materialized scores).  The modules and parameters are the
            same either way, so a ``state_dict`` loads into either.  Fixed at construction.

    Attributes:
        src_embedding, tgt_embedding: :class:`torch.nn.Embedding` ``(vocab_size, d_model)``,
            initialized from :math:`\mathcal{N}(0, 1/d_{model})` so that the scaled embeddings have
            unit variance, like the positions.
        transformer: the encoder-decoder stack, with the modules, parameter names and
            initialization of ``torch.nn.Transformer(d_model, nhead, num_encoder_layers,
            num_decoder_layers, dim_feedforward, dropout, batch_first=True)``:
            ``transformer.load_state_dict(torch_transformer.state_dict())`` works with
            ``strict=True``, and the other way round.  Its attention modules are
            :class:`transformer_kernels.nn.MultiheadAttention`; calling it takes embedded inputs
            ``(src [B, S, E], tgt [B, T, E], src_key_padding_mask [B, S])`` and returns
            ``[B, T, E]``, what ``torch.nn.Transformer`` returns for the same key padding mask as
            ``src_key_padding_mask`` and ``memory_key_padding_mask`` and a causal ``tgt_mask``.
        output_projection: :class:`torch.nn.Linear` ``(d_model, tgt_vocab_size)``.

    Shape:
        - ``src``: ``[B, S]`` token ids (int64 or int32), ``1 <= S <= max_len``.
        - ``tgt``: ``[B, T]`` token ids, the teacher-forced decoder input, ``1 <= T <= max_len``.
        - output: ``[B, T, tgt_vocab_size]`` logits; position ``t`` predicts token ``t + 1``.

    Differences from the seeds (whose notebooks also differ among themselves):

    - A source that is all padding gives its decoder queries no source to attend to, so their
      cross-attention output is 0 (the package's convention), where the seeds'
      ``masked_fill(-1e9)`` attends uniformly to the padding.
    - Token embeddings are scaled by :math:`\sqrt{d_{model}}` (and initialized to match), as
      Vaswani et al. do; no seed scales them.
    - The stack is ``torch.nn.Transformer``'s, as in the seed built on it: a final LayerNorm after
      each stack, and cross-attention masked by the source's padding (the hand-written seed has
      no final LayerNorms, and masks cross-attention by the target's padding, which is right only
      where source and target are padded alike).

    Example::

        >>> model = Transformer(1000, 1000, d_model=512, nhead=8)
        >>> src = torch.randint(1, 1000, (32, 40))
        >>> tgt = torch.randint(1, 1000, (32, 35))
        >>> model(src, tgt).shape
        torch.Size([32, 35, 1000])
        >>> model.eval().generate(src, max_len=50, bos_index=1, eos_index=2, beam_size=4).shape[1] <= 50
        True
    """

    def __init__(
        self,
        src_vocab_size: int,
        tgt_vocab_size: int,
        *,
        d_model: int = 512,
        nhead: int = 8,
        num_encoder_layers: int = 6,
        num_decoder_layers: int = 6,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        max_len: int = 1024,
        pad_index: int = 0,
        impl: str = "fused",
    ) -> None:
        super().__init__()
        for name, value, minimum in (
            ("src_vocab_size", src_vocab_size, 1), ("tgt_vocab_size", tgt_vocab_size, 1), ("d_model", d_model, 1),
            ("nhead", nhead, 1), ("num_encoder_layers", num_encoder_layers, 0),
            ("num_decoder_layers", num_decoder_layers, 0), ("dim_feedforward", dim_feedforward, 1),
            ("max_len", max_len, 1),
        ):
            check_int(name, value, minimum)
        if d_model % nhead != 0:
            raise ValueError(f"d_model must be divisible by nhead, got d_model={d_model} and nhead={nhead}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        check_int("pad_index", pad_index, 0)
        if pad_index >= min(src_vocab_size, tgt_vocab_size):
            raise ValueError(
                f"pad_index must be a token of both vocabularies (< {min(src_vocab_size, tgt_vocab_size)}), "
                f"got {pad_index}"
            )
        if impl not in _IMPLS:
            raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
        self.d_model, self.max_len, self.pad_index, self._impl = d_model, max_len, pad_index, impl
        self.src_embedding = nn.Embedding(src_vocab_size, d_model)
        self.tgt_embedding = nn.Embedding(tgt_vocab_size, d_model)
        for embedding in (self.src_embedding, self.tgt_embedding):
            nn.init.normal_(embedding.weight, std=d_model**-0.5)
        self.register_buffer("positional_encoding", _sinusoidal_positions(max_len, d_model), persistent=False)
        self.dropout = nn.Dropout(dropout)
        self.transformer = _EncoderDecoder(
            d_model, nhead, num_encoder_layers, num_decoder_layers, dim_feedforward, dropout, impl
        )
        self.output_projection = nn.Linear(d_model, tgt_vocab_size)

    @property
    def impl(self) -> str:
        """``"fused"`` or ``"reference"``: how attention is computed."""
        return self._impl

    def _apply(self, fn, recurse=True):
        # The positional table is in no state_dict: where the module's tensors are moved or made
        # again (to_empty after a construction on the meta device, .to(), .half()), it is computed
        # again where it now lives, which a load_state_dict would not fill in.
        super()._apply(fn, recurse)
        table = self.positional_encoding
        self.positional_encoding = _sinusoidal_positions(self.max_len, self.d_model, table.dtype, table.device)
        return self

    def extra_repr(self) -> str:
        return f"impl={self._impl!r}, max_len={self.max_len}, pad_index={self.pad_index}"

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        """``src [B, S]``, ``tgt [B, T]`` token ids -> logits ``[B, T, tgt_vocab_size]``."""
        self._check_tokens("src", src)
        self._check_tokens("tgt", tgt)
        if src.shape[0] != tgt.shape[0]:
            raise ValueError(f"src and tgt must have the same batch size, got {src.shape[0]} and {tgt.shape[0]}")
        padding = src.eq(self.pad_index)
        out = self.transformer(self._embed(self.src_embedding, src), self._embed(self.tgt_embedding, tgt), padding)
        return self.output_projection(out)

    @torch.no_grad()
    def generate(
        self, src: Tensor, *, max_len: int, bos_index: int, eos_index: int, beam_size: int = 1,
        cuda_graph: Optional[bool] = None,
    ) -> Tensor:
        r"""Decode a target for each source, greedily (``beam_size=1``) or by beam search.

        Runs in evaluation mode (no dropout) whatever the module's mode, which it restores.
        The encoder runs once; the decoder runs one position per step, with each layer's
        self-attention keys and values cached (in buffers of ``max_len`` positions, allocated
        once) and its cross-attention keys and values projected once from the encoder output.
        The tokens are those of a search that re-runs :meth:`forward` on the whole prefix at
        every step (see :func:`transformer_kernels.models.generate` for the search and its
        tie-breaking).  On a GPU the steps after the first replay a CUDA graph.

        Args:
            src: ``[B, S]`` source token ids, padded with ``pad_index``.
            max_len: the longest output, ``bos_index`` included; at most the model's ``max_len``.
            bos_index: the first token of every output.
            eos_index: the token that ends a hypothesis; after it a row holds ``pad_index``.
            beam_size: 1 for greedy search, else the number of beams.
            cuda_graph: None (replay the steps from a CUDA graph on a GPU), True (insist) or
                False (run every step eagerly).

        Returns:
            LongTensor ``[B, T]``, ``T <= max_len``, on ``src``'s device.
        """
        self._check_tokens("src", src)
        check_int("max_len", max_len, 1)
        if max_len > self.max_len:
            raise ValueError(f"max_len must be at most the model's max_len ({self.max_len}), got {max_len}")
        vocab_size = self.tgt_embedding.num_embeddings
        for name, index in (("bos_index", bos_index), ("eos_index", eos_index)):
            check_int(name, index, 0)
            if index >= vocab_size:
                raise ValueError(f"{name} must be a target token (< {vocab_size}), got {index}")
        with generation.in_eval_mode(self):
            padding = src.eq(self.pad_index)
            memory = self.transformer.encoder(self._embed(self.src_embedding, src), padding)
            state = self.transformer.decoder.initial_state(memory, padding, max_len)
            return generation.generate(
                _CachedDecoder(self), state, batch_size=src.shape[0], max_len=max_len, bos_index=bos_index,
                eos_index=eos_index, pad_index=self.pad_index, beam_size=beam_size, device=src.device,
                cuda_graph=cuda_graph,
            )

    def _embed(self, embedding: nn.Embedding, tokens: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        """``tokens [B, L]`` -> ``[B, L, E]``, at positions ``0, ..., L - 1``, or with ``positions``
        ``[L, E]``, the rows of :attr:`positional_encoding` to add."""
        if positions is None:
            positions = self.positional_encoding[: tokens.shape[1]]
        return self.dropout(embedding(tokens) * math.sqrt(self.d_model) + positions)

    def _check_tokens(self, name: str, tokens: object) -> None:
        if not isinstance(tokens, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tokens).__name__}")
        if tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} must hold token ids (int64 or int32), got {tokens.dtype}")
        if tokens.dim() != 2 or not 1 <= tokens.shape[1] <= self.max_len:
            raise ValueError(
                f"{name} must have shape [B, L] with 1 <= L <= max_len = {self.max_len}, got {tuple(tokens.shape)}"
            )


class _CachedDecoder:
    """A :class:`Transformer` as :func:`generate`'s ``IncrementalDecoder``: each step embeds the
    newest token only and runs :meth:`_Decoder.step`.  Capturable: its caches are allocated
    before the first step and the position is read on the device only."""

    capturable = True

    def __init__(self, model: Transformer) -> None:
        self.model = model

    def step(self, tokens: Tensor, position: Tensor, state: "_DecoderState") -> Tensor:
        model = self.model
        # index_select, not indexing: a 0-dim index tensor would be read back to the host.
        positions = model.positional_encoding.index_select(0, position.view(1))
        x = model._embed(model.tgt_embedding, tokens[:, None], positions)
        x = model.transformer.decoder.step(x, position, state)
        return model.output_projection(x[:, 0]).log_softmax(-1)

    def reorder(self, state: "_DecoderState", indices: Tensor, *, same_sources: bool = False) -> "_DecoderState":
        return state.index(indices, same_sources)


# ----------------------------------------------------------------------------- the stack


class _Attention(MultiheadAttention):
    """One attention layer: :class:`transformer_kernels.nn.MultiheadAttention`'s parameters
    (``batch_first``), with the projection and the attention as separate calls, so that the
    decoder can project a memory once and cache keys and values.  ``impl`` picks the math."""

    def __init__(self, d_model: int, nhead: int, dropout: float, impl: str) -> None:
        super().__init__(d_model, nhead, dropout=dropout, batch_first=True)
        self.impl = impl

    def extra_repr(self) -> str:
        return ", ".join(filter(None, [f"impl={self.impl!r}", super().extra_repr()]))

    def projection(self, which: str) -> tuple[Tensor, Tensor]:
        """The ``which`` (``"qkv"``, ``"q"`` or ``"kv"``) rows of ``in_proj_weight`` and ``in_proj_bias``:
        the parameters themselves for ``"qkv"`` (a full slice would still cost its backward a copy),
        else their part of one split (``_query_and_key_value_rows``)."""
        if which == "qkv":
            return self.in_proj_weight, self.in_proj_bias
        query_rows, key_value_rows = self._query_and_key_value_rows()
        return query_rows if which == "q" else key_value_rows

    def project(self, x: Tensor, which: str, rows: Optional[tuple[Tensor, Tensor]] = None) -> tuple[Tensor, ...]:
        """``x [N, L, E]`` -> the ``which`` (``"qkv"``, ``"q"`` or ``"kv"``) projections, each
        head-split ``[N, H, L, E / H]``; ``rows``: their ``(weight, bias)``, when the caller has them
        (``_query_and_key_value_rows``)."""
        weight, bias = self.projection(which) if rows is None else rows
        if self.impl == "fused":
            return qkv_projection(x, weight, bias, num_heads=self.num_heads, backend=self.backend)
        return reference.qkv_projection(x, weight, bias, self.num_heads)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, *, key_padding_mask: Optional[Tensor] = None, is_causal: bool = False
    ) -> Tensor:
        """``q [N, H, L, Dh]``, ``k``, ``v`` ``[N, H, S, Dh]``, ``key_padding_mask`` bool ``[N, S]``
        (True = padding) -> the heads merged and through ``out_proj``, ``[N, L, E]``."""
        dropout_p = self.dropout if self.training else 0.0
        if self.impl == "fused":
            out = scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p, is_causal=is_causal, key_padding_mask=key_padding_mask,
                backend=self.backend,
            )
        else:
            keep = None
            if dropout_p > 0.0:
                keep = torch.rand(*q.shape[:-1], k.shape[-2], device=q.device) >= dropout_p
            # -inf rather than the seeds' -1e9: a query without keys (an all-padding source) gets 0,
            # as on the fused path, instead of a uniform average of the padding.
            out = reference.attention(
                q, k, v, is_causal=is_causal, key_padding_mask=key_padding_mask, masked_value=float("-inf"),
                dropout_p=dropout_p, dropout_keep_mask=keep,
            )
        return self.merge_heads(out)

    def merge_heads(self, out: Tensor) -> Tensor:
        """The attention's ``[N, H, L, Dh]`` output, heads merged, through ``out_proj``: ``[N, L, E]``."""
        batch, heads, length, head_dim = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, heads * head_dim))


def _feed_forward(layer: nn.Module, x: Tensor) -> Tensor:
    return layer.linear2(layer.dropout(F.relu(layer.linear1(x))))


class _EncoderLayer(nn.Module):
    """``torch.nn.TransformerEncoderLayer(norm_first=False, activation="relu")``'s modules and math."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int, dropout: float, impl: str) -> None:
        super().__init__()
        self.self_attn = _Attention(d_model, nhead, dropout, impl)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)

    def forward(self, x: Tensor, key_padding_mask: Tensor) -> Tensor:
        q, k, v = self.self_attn.project(x, "qkv")
        x = self.norm1(x + self.dropout1(self.self_attn.attend(q, k, v, key_padding_mask=key_padding_mask)))
        return self.norm2(x + self.dropout2(_feed_forward(self, x)))


@dataclasses.dataclass(frozen=True)
class _LayerCache:
    """One decoder layer's keys and values, ``[N, H, length, Dh]``: its self-attention's, a buffer
    of the generation's ``max_len`` positions written one position per step, and its
    cross-attention's for the ``S`` source positions."""

    key: Tensor
    value: Tensor
    memory_key: Tensor
    memory_value: Tensor

    def index(self, indices: Tensor, same_sources: bool) -> "_LayerCache":
        """The caches of hypotheses ``indices``.  When every hypothesis keeps its source
        (:meth:`IncrementalDecoder.reorder`), the cross-attention's stay as they are and the
        self-attention's are gathered into their own buffers, which a captured step writes."""
        if same_sources:
            self.key.copy_(self.key[indices])
            self.value.copy_(self.value[indices])
            return self
        return _LayerCache(self.key[indices], self.value[indices], self.memory_key[indices], self.memory_value[indices])


class _StepCalls:
    """How a generation's decoding steps call their projections and attentions.

    On the fused path (outside autocast), they go to the registered ops directly, each call site
    with what its first step worked out: the backend it chose, a projection's weight and bias rows
    and its arguments.  A step computes one query row per hypothesis, so the public functions'
    argument checks and backend choice cost about as much host time as the ops themselves; every
    step passes the same kinds of model-built arguments, and the weights do not change during a
    generation, so the first step's holds for the rest.  (Greedy generation at the small preset
    on a CPU, quick report: 0.87x -> 1.08x the seeds' math.)  Otherwise the layer's own
    ``project``/``attend`` run.
    """

    def __init__(self, direct: bool) -> None:
        self.direct = direct
        self._projections: dict[tuple[int, str], tuple] = {}
        self._backends: dict[int, str] = {}

    def project(self, layer: _Attention, x: Tensor, which: str) -> tuple[Tensor, ...]:
        if not self.direct:
            return layer.project(x, which)
        call = self._projections.get((id(layer), which))
        if call is None:
            weight, bias = layer.projection(which)
            args = QkvProjectionArgs(layer.num_heads)
            backend = select_backend("qkv", "qkv_projection", layer.backend, x, x, weight, bias, args)
            call = (weight, bias, args, backend)
            self._projections[id(layer), which] = call
        return tuple(qkv_projection_forward(x, *call))

    def attend(self, layer: _Attention, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
        """``attend(q, k, v, key_padding_mask=...)`` without a causal mask: the newest position sees
        every key the mask leaves (the positions decoded so far, or the source's)."""
        if not self.direct:
            return layer.attend(q, k, v, key_padding_mask=key_padding_mask)
        # The public function's default scale, computed the same way.
        args = AttentionArgs(key_padding_mask, None, Causal.NONE, 1.0 / math.sqrt(q.shape[-1]), 0.0, None)
        backend = self._backends.get(id(layer))
        if backend is None:
            backend = select_backend("attention", ATTENTION_NAME, layer.backend, q, q, k, v, args)
            self._backends[id(layer)] = backend
        out, _ = attention_forward(q, k, v, args, False, backend)
        return layer.merge_heads(out)


@dataclasses.dataclass(frozen=True)
class _DecoderState:
    """What the decoder carries from one generation step to the next, for ``N`` hypotheses."""

    memory_key_padding_mask: Tensor  # bool [N, S], True = source padding, contiguous
    layers: tuple[_LayerCache, ...]
    calls: _StepCalls
    key_positions: Tensor  # [N, max_len], each row 0, 1, ...: the positions of the self-attention caches

    def index(self, indices: Tensor, same_sources: bool) -> "_DecoderState":
        """The state of hypotheses ``indices`` (LongTensor ``[N']``), in that order."""
        if same_sources:
            mask, positions = self.memory_key_padding_mask, self.key_positions
        else:
            mask, positions = self.memory_key_padding_mask[indices], self.key_positions[indices]
        layers = tuple(c.index(indices, same_sources) for c in self.layers)
        return _DecoderState(mask, layers, self.calls, positions)

    def self_attention_padding(self, position: Tensor) -> Tensor:
        """bool ``[N, max_len]``, contiguous: the cache positions after ``position``, not decoded yet."""
        return self.key_positions.gt(position)


class _DecoderLayer(nn.Module):
    """``torch.nn.TransformerDecoderLayer(norm_first=False, activation="relu")``'s modules and math,
    with a causal self-attention, plus :meth:`step` for one new position over cached keys."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int, dropout: float, impl: str) -> None:
        super().__init__()
        self.self_attn = _Attention(d_model, nhead, dropout, impl)
        self.multihead_attn = _Attention(d_model, nhead, dropout, impl)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.norm3 = nn.LayerNorm(d_model)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.dropout3 = nn.Dropout(dropout)

    def forward(self, x: Tensor, memory: Tensor, memory_key_padding_mask: Tensor) -> Tensor:
        q, k, v = self.self_attn.project(x, "qkv")
        x = self.norm1(x + self.dropout1(self.self_attn.attend(q, k, v, is_causal=True)))
        query_rows, memory_rows = self.multihead_attn._query_and_key_value_rows()
        memory_key, memory_value = self.multihead_attn.project(memory, "kv", memory_rows)
        (q,) = self.multihead_attn.project(x, "q", query_rows)
        attended = self.multihead_attn.attend(q, memory_key, memory_value, key_padding_mask=memory_key_padding_mask)
        return self._add_cross_attention_and_feed_forward(x, attended)

    def step(
        self, x: Tensor, position: Tensor, cache: _LayerCache, self_padding: Tensor, memory_key_padding_mask: Tensor,
        calls: _StepCalls,
    ) -> Tensor:
        """``x [N, 1, E]``, the newest position, written into the cache at ``position`` (0-dim), then
        attending to itself and the positions before it (``self_padding`` masks the rest)."""
        q, k, v = calls.project(self.self_attn, x, "qkv")
        cache.key.index_copy_(2, position.view(1), k)
        cache.value.index_copy_(2, position.view(1), v)
        x = self.norm1(x + self.dropout1(calls.attend(self.self_attn, q, cache.key, cache.value, self_padding)))
        (q,) = calls.project(self.multihead_attn, x, "q")
        attended = calls.attend(self.multihead_attn, q, cache.memory_key, cache.memory_value, memory_key_padding_mask)
        return self._add_cross_attention_and_feed_forward(x, attended)

    def _add_cross_attention_and_feed_forward(self, x: Tensor, attended: Tensor) -> Tensor:
        x = self.norm2(x + self.dropout2(attended))
        return self.norm3(x + self.dropout3(_feed_forward(self, x)))


class _Encoder(nn.Module):
    """``torch.nn.TransformerEncoder``'s ``layers`` and final ``norm``."""

    def __init__(self, layers: list[_EncoderLayer], d_model: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x: Tensor, key_padding_mask: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x, key_padding_mask)
        return self.norm(x)


class _Decoder(nn.Module):
    """``torch.nn.TransformerDecoder``'s ``layers`` and final ``norm``, run on a whole target
    (:meth:`forward`) or one position at a time (:meth:`initial_state`, :meth:`step`)."""

    def __init__(self, layers: list[_DecoderLayer], d_model: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x: Tensor, memory: Tensor, memory_key_padding_mask: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x, memory, memory_key_padding_mask)
        return self.norm(x)

    def initial_state(self, memory: Tensor, memory_key_padding_mask: Tensor, max_len: int) -> _DecoderState:
        """Before the first position: every layer's cross-attention keys and values of ``memory``
        ``[N, S, E]``, and self-attention caches for ``max_len`` positions."""
        caches = []
        for layer in self.layers:
            # Contiguous [N, H, S, Dh], copied once: every step's attention then runs one batch of
            # N * H matrices instead of one per head over the projection's [N, S, H, Dh] layout.
            memory_key, memory_value = (t.contiguous() for t in layer.multihead_attn.project(memory, "kv"))
            # Zeros, not empty: a masked key is still multiplied (by a weight of 0), and 0 * NaN is NaN.
            key, value = (memory_key.new_zeros(*memory_key.shape[:2], max_len, memory_key.shape[-1]) for _ in "kv")
            caches.append(_LayerCache(key, value, memory_key, memory_value))
        fused = len(self.layers) > 0 and self.layers[0].self_attn.impl == "fused"
        direct = fused and not autocast_enabled(memory.device.type)
        key_positions = torch.arange(max_len, device=memory.device).repeat(memory.shape[0], 1)
        return _DecoderState(memory_key_padding_mask.contiguous(), tuple(caches), _StepCalls(direct), key_positions)

    def step(self, x: Tensor, position: Tensor, state: _DecoderState) -> Tensor:
        """``x [N, 1, E]``, the embedded token of each hypothesis at ``position`` (0-dim) -> ``[N, 1, E]``;
        writes its keys and values into ``state``'s caches."""
        self_padding = state.self_attention_padding(position)
        for layer, cache in zip(self.layers, state.layers):
            x = layer.step(x, position, cache, self_padding, state.memory_key_padding_mask, state.calls)
        return self.norm(x)


class _EncoderDecoder(nn.Module):
    """``torch.nn.Transformer(..., batch_first=True)``'s ``encoder`` and ``decoder``, parameters and
    initialization (Xavier-uniform for every matrix)."""

    def __init__(
        self, d_model: int, nhead: int, num_encoder_layers: int, num_decoder_layers: int, dim_feedforward: int,
        dropout: float, impl: str,
    ) -> None:
        super().__init__()
        sizes = (d_model, nhead, dim_feedforward, dropout, impl)
        self.encoder = _Encoder([_EncoderLayer(*sizes) for _ in range(num_encoder_layers)], d_model)
        self.decoder = _Decoder([_DecoderLayer(*sizes) for _ in range(num_decoder_layers)], d_model)
        for parameter in self.parameters():
            if parameter.dim() > 1:
                nn.init.xavier_uniform_(parameter)

    def forward(self, src: Tensor, tgt: Tensor, src_key_padding_mask: Tensor) -> Tensor:
        """``src [B, S, E]``, ``tgt [B, T, E]`` embedded, ``src_key_padding_mask`` bool ``[B, S]``
        (True = padding) -> ``[B, T, E]``."""
        return self.decoder(tgt, self.encoder(src, src_key_padding_mask), src_key_padding_mask)


def _sinusoidal_positions(max_len: int, d_model: int, dtype: Optional[torch.dtype] = None,
                          device: Optional[torch.device] = None) -> Tensor:
    """``[max_len, d_model]``: ``sin(p / 10000^(2i / d_model))`` at column ``2i``, ``cos`` of the same
    angle at ``2i + 1``; computed in float64, stored in ``dtype`` (default: the default dtype) on
    ``device``."""
    angles = torch.arange(max_len, dtype=torch.float64)[:, None] * torch.pow(
        10000.0, -torch.arange(0, d_model, 2, dtype=torch.float64) / d_model
    )
    table = torch.empty(max_len, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles[:, : d_model // 2])
    return table.to(device=device, dtype=dtype or torch.get_default_dtype())
