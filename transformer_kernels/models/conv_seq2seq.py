"""The convolutional seq2seq seed (Gehring et al., 2017) on the fused GLU convolution and attention.

:class:`ConvSeq2Seq` holds exactly the seed's ``Seq2Seq(Encoder, Decoder)`` parameters, so the
seed's checkpoints load with ``strict=True``; ``impl="fused"`` computes with
:func:`transformer_kernels.glu_conv1d` and :func:`transformer_kernels.scaled_dot_product_attention`,
``impl="reference"`` with the seed's naive math from :mod:`transformer_kernels.reference`.
Activations stay channel-last ``[B, L, C]`` throughout and the convolutions take them as
transposed views: the fused op reads them in place and, on the GPU, writes channel-last, so no
layer permutes (on a CPU, where oneDNN convolves, it hands back ``nn.Conv1d``'s contiguous
``[B, C, L]``, the layout the next convolution reads without a copy).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .. import reference
from .._checks import check_same_device, check_tensor, is_int
from ..nn.glu_conv import GLUConv1d
from ..ops._autocast import autocast
from ..ops.attention import MAX_HEAD_DIM, scaled_dot_product_attention
from .generation import generate, in_eval_mode

__all__ = ["ConvSeq2Seq"]

_IMPLS = ("fused", "reference")
# The seed scales every two-term sum by sqrt(1/2) to keep its variance.
_SCALE = math.sqrt(0.5)


class EncoderOutput(NamedTuple):
    """What the decoder attends to: ``conved`` (the keys) and ``combined`` (the values), both
    ``[B, S, E]``, and the source padding ``[B, S]`` (True = padding) or None (attend to all)."""

    conved: Tensor
    combined: Tensor
    key_padding_mask: Optional[Tensor]

    def index_select(self, indices: Tensor) -> "EncoderOutput":
        mask = self.key_padding_mask
        return EncoderOutput(
            self.conved.index_select(0, indices), self.combined.index_select(0, indices),
            None if mask is None else mask.index_select(0, indices),
        )


@dataclasses.dataclass(frozen=True)
class DecoderState:
    """The cache of :meth:`ConvDecoder.step`: the encoder's output (computed once) and, per decoder
    layer, its convolution's last inputs: fused, the ring ``[N, hid_dim, kernel_size]`` of
    :func:`~transformer_kernels.glu_conv1d_update` (position ``p`` in slot ``p % kernel_size``);
    reference, the last ``kernel_size - 1`` positions ``[N, hid_dim, kernel_size - 1]``."""

    encoder: EncoderOutput
    conv_states: tuple[Tensor, ...]


def _glu_conv(conv: GLUConv1d, impl: str, x: Tensor, residual: Optional[Tensor] = None,
              residual_scale: float = 1.0) -> Tensor:
    """``conv`` on channel-last ``x`` ``[B, L, C_in]`` (and ``residual`` ``[B, L, C]``), as
    ``[B, L, C]``: fused, the op reads the transposed views in place (its output's layout: see
    :func:`~transformer_kernels.glu_conv1d`)."""
    x_t = x.transpose(1, 2)
    residual_t = None if residual is None else residual.transpose(1, 2)
    if impl == "fused":
        out = conv(x_t, residual=residual_t, residual_scale=residual_scale)
    else:
        out = reference.glu_conv1d(
            x_t, conv.weight, conv.bias, padding=conv.padding, pad_value=conv.pad_value, residual=residual_t,
            residual_scale=residual_scale,
        )
    return out.transpose(1, 2)


def _attention(query: Tensor, encoder: EncoderOutput, impl: str) -> Tensor:
    """The decoder's one-head attention with scale 1: ``query`` ``[B, T, E]`` -> ``[B, T, E]``."""
    if impl == "fused" and query.shape[-1] <= MAX_HEAD_DIM:
        return scaled_dot_product_attention(
            query, encoder.conved, encoder.combined, scale=1.0, key_padding_mask=encoder.key_padding_mask
        )
    if impl == "fused":  # wider than the fused kernels serve: the weights are materialized anyway
        return _attention_and_weights(query, encoder)[0]
    return reference.attention(
        query, encoder.conved, encoder.combined, scale=1.0, key_padding_mask=encoder.key_padding_mask,
        masked_value=float("-inf"),
    )


def _attention_and_weights(query: Tensor, encoder: EncoderOutput) -> tuple[Tensor, Tensor]:
    """The seed's attention with its weights materialized: ``(out [B, T, E], weights [B, T, S])``.

    Padded source positions get weight exactly 0; a source of padding only gets weights 0 (and
    output 0) everywhere, as :func:`scaled_dot_product_attention` gives it.  Its energies are not
    masked, so the softmax (and its backward) stays finite before the row is zeroed."""
    energy = torch.bmm(query, encoder.conved.transpose(1, 2))
    mask = encoder.key_padding_mask
    if mask is None:
        weights = torch.softmax(energy, dim=-1)
    else:
        empty = mask.all(1, keepdim=True)[:, :, None]  # [B, 1, 1]
        energy = energy.masked_fill(mask[:, None, :] & ~empty, float("-inf"))
        weights = torch.softmax(energy, dim=-1).masked_fill(empty, 0.0)
    return torch.bmm(weights, encoder.combined), weights


class ConvEncoder(torch.nn.Module):
    """The seed's ``Encoder``: embeddings, ``num_layers`` GLU convolution blocks with their residual,
    and the projection back to ``emb_dim``.  See :class:`ConvSeq2Seq` for the arguments."""

    def __init__(self, vocab_size: int, emb_dim: int, hid_dim: int, num_layers: int, kernel_size: int,
                 dropout: float, max_len: int, impl: str) -> None:
        super().__init__()
        self.impl = impl
        self.tok_embedding = torch.nn.Embedding(vocab_size, emb_dim)
        self.pos_embedding = torch.nn.Embedding(max_len, emb_dim)
        self.emb2hid = torch.nn.Linear(emb_dim, hid_dim)
        self.hid2emb = torch.nn.Linear(hid_dim, emb_dim)
        self.convs = torch.nn.ModuleList(GLUConv1d(hid_dim, hid_dim, kernel_size) for _ in range(num_layers))
        self.dropout = torch.nn.Dropout(dropout)

    def forward(self, src: Tensor, key_padding_mask: Optional[Tensor] = None) -> EncoderOutput:
        """``src`` ``[B, S]`` -> its :class:`EncoderOutput`.  ``key_padding_mask`` ``[B, S]`` (True =
        padding) or None: padded positions enter every convolution as zeros, so they reach no
        other position (the seed's convolutions read them), and the decoder will not attend to
        them."""
        positions = torch.arange(src.shape[1], device=src.device)
        embedded = self.dropout(self.tok_embedding(src) + self.pos_embedding(positions))
        hidden = self.emb2hid(embedded)
        padding = None if key_padding_mask is None else key_padding_mask[:, :, None]
        for conv in self.convs:
            conv_input = self.dropout(hidden)
            if padding is not None:
                conv_input = conv_input.masked_fill(padding, 0.0)
            # The residual is the block's input before dropout, as in the seed.
            hidden = _glu_conv(conv, self.impl, conv_input, residual=hidden, residual_scale=_SCALE)
        conved = self.hid2emb(hidden)
        return EncoderOutput(conved, (conved + embedded) * _SCALE, key_padding_mask)


class ConvDecoder(torch.nn.Module):
    """The seed's ``Decoder``: embeddings, ``num_layers`` causal GLU convolution blocks each followed
    by attention over the encoder's output, and the output projection.  Teacher-forced through
    :meth:`forward`, one position at a time through :meth:`step` (:class:`IncrementalDecoder`).
    See :class:`ConvSeq2Seq` for the arguments."""

    def __init__(self, vocab_size: int, emb_dim: int, hid_dim: int, num_layers: int, kernel_size: int,
                 dropout: float, max_len: int, pad_index: int, impl: str) -> None:
        super().__init__()
        self.impl = impl
        self.tok_embedding = torch.nn.Embedding(vocab_size, emb_dim)
        self.pos_embedding = torch.nn.Embedding(max_len, emb_dim)
        self.emb2hid = torch.nn.Linear(emb_dim, hid_dim)
        self.hid2emb = torch.nn.Linear(hid_dim, emb_dim)
        self.attn_hid2emb = torch.nn.Linear(hid_dim, emb_dim)
        self.attn_emb2hid = torch.nn.Linear(emb_dim, hid_dim)
        self.fc_out = torch.nn.Linear(emb_dim, vocab_size)
        # The seed fills the causal left padding with the target pad index.
        self.convs = torch.nn.ModuleList(
            GLUConv1d(hid_dim, hid_dim, kernel_size, padding="causal", pad_value=float(pad_index))
            for _ in range(num_layers)
        )
        self.dropout = torch.nn.Dropout(dropout)

    def forward(self, tgt: Tensor, encoder: EncoderOutput) -> tuple[Tensor, Tensor]:
        """``tgt`` ``[B, T]`` -> ``(logits [B, T, V], attention [B, T, S])``, the attention weights
        of the last layer.  Only that layer materializes its weights (and attends with them); the
        others run the fused attention, which never forms them."""
        positions = torch.arange(tgt.shape[1], device=tgt.device)
        embedded = self.dropout(self.tok_embedding(tgt) + self.pos_embedding(positions))
        hidden = self.emb2hid(embedded)
        last = len(self.convs) - 1
        for index, conv in enumerate(self.convs):
            # Unlike the encoder's, the decoder's residual is the input after dropout.
            conv_input = self.dropout(hidden)
            conved = _glu_conv(conv, self.impl, conv_input)
            query = (self.attn_hid2emb(conved) + embedded) * _SCALE
            if index == last:
                attended, attention = _attention_and_weights(query, encoder)
            else:
                attended = _attention(query, encoder, self.impl)
            conved = (conved + self.attn_emb2hid(attended)) * _SCALE
            hidden = (conved + conv_input) * _SCALE
        return self.fc_out(self.dropout(self.hid2emb(hidden))), attention

    def initial_state(self, encoder: EncoderOutput) -> DecoderState:
        """The state before the first :meth:`step`: every convolution's window holds its padding."""
        batch = encoder.conved.shape[0]
        if self.impl == "fused":
            # In the dtype the steps compute in (autocast's, where it is on), which glu_conv1d_update
            # then writes directly, without a cast copy and a copy back.
            return DecoderState(encoder, tuple(autocast(conv.weight, conv.initial_conv_state(batch))[0]
                                               for conv in self.convs))
        return DecoderState(encoder, tuple(conv.initial_state(batch) for conv in self.convs))

    # generate() may replay step() from a CUDA graph: its state's tensors are updated in place and
    # the position is read on the device only.
    capturable = True

    def step(self, tokens: Tensor, position: Tensor, state: DecoderState) -> Tensor:
        """``tokens`` ``[N]`` at ``position`` (0-dim; the state holds the positions before it) -> the
        log-probabilities ``[N, V]`` of the next token, the last position of
        ``log_softmax(forward(prefix)[0])``, from the last token and the cache alone.  ``state``'s
        convolution windows move on by this position, in place."""
        embedded = self.dropout(self.tok_embedding(tokens) + self.pos_embedding(position))
        hidden = self.emb2hid(embedded)
        for conv, conv_state in zip(self.convs, state.conv_states):
            conv_input = self.dropout(hidden)
            conved = self._conv_step(conv, conv_input, conv_state, position)
            query = (self.attn_hid2emb(conved) + embedded) * _SCALE
            attended = _attention(query[:, None, :], state.encoder, self.impl)[:, 0]
            conved = (conved + self.attn_emb2hid(attended)) * _SCALE
            hidden = (conved + conv_input) * _SCALE
        logits = self.fc_out(self.dropout(self.hid2emb(hidden)))
        return torch.log_softmax(logits, dim=-1)

    def reorder(self, state: DecoderState, indices: Tensor, *, same_sources: bool = False) -> DecoderState:
        """The state of rows ``indices`` (LongTensor ``[N']``), in that order.  When every row keeps
        its source (:meth:`IncrementalDecoder.reorder`), the encoder's output stays as it is and the
        windows are gathered into their own tensors, which a captured step writes."""
        if same_sources:
            for window in state.conv_states:
                window.copy_(window.index_select(0, indices))
            return state
        return DecoderState(state.encoder.index_select(indices),
                            tuple(s.index_select(0, indices) for s in state.conv_states))

    def _conv_step(self, conv: GLUConv1d, x: Tensor, state: Tensor, position: Tensor) -> Tensor:
        """One causal position of ``conv``: ``x`` ``[N, C_in]`` -> ``out [N, C]``, ``state`` (see
        :class:`DecoderState`) moved on by ``x`` in place."""
        if self.impl == "fused":
            return conv.update(x, state, position)
        window = torch.cat([state, x[:, :, None]], dim=2)
        out = reference.glu_conv1d(window, conv.weight, conv.bias, padding="causal", pad_value=conv.pad_value)
        state.copy_(window[:, :, 1:])
        return out[:, :, -1]


class ConvSeq2Seq(torch.nn.Module):
    r"""The convolutional sequence-to-sequence model of Gehring et al. (2017), as the seed builds it.

    The encoder embeds tokens and positions (``E = emb_dim``), projects them to ``hid_dim`` and runs
    ``num_encoder_layers`` blocks ``h = (GLU(conv(dropout(h))) + h) * sqrt(1/2)`` (zero "same"
    padding; the residual is fused into :func:`transformer_kernels.glu_conv1d`), then projects back
    to ``E``: its output ``conved``, and ``combined = (conved + embedded) * sqrt(1/2)``.  Each of
    the ``num_decoder_layers`` decoder blocks convolves causally (left padding of value
    ``pad_index``, as the seed fills it), attends with one head and scale 1 (queries from the
    block's output and the target embedding, keys ``conved``, values ``combined``) and adds its
    input after dropout.  ``fc_out`` gives the logits.

    Parameters and ``state_dict`` keys are the seed's ``Seq2Seq(Encoder, Decoder)``'s:
    ``encoder.{tok_embedding, pos_embedding, emb2hid, hid2emb, convs.N}`` and
    ``decoder.{tok_embedding, pos_embedding, emb2hid, hid2emb, attn_hid2emb, attn_emb2hid, fc_out,
    convs.N}``, each ``convs.N`` a :class:`transformer_kernels.nn.GLUConv1d` holding
    ``nn.Conv1d(hid_dim, 2 * hid_dim, kernel_size)``'s ``weight`` and ``bias``; a checkpoint of the
    seed loads with ``strict=True``, into either ``impl``.

    Args:
        src_vocab_size, tgt_vocab_size: sizes of the source and target vocabularies.
        emb_dim: ``E``, the embedding width (and the attention's head dim).
        hid_dim: the convolutions' width.
        num_encoder_layers, num_decoder_layers: convolution blocks, ``>= 1`` each.
        kernel_size: the encoder's, odd (it pads ``(kernel_size - 1) // 2`` on each side), and the
            decoder's unless ``decoder_kernel_size`` is given.
        decoder_kernel_size: the decoder's, ``>= 1``, odd or even (it pads causally): the seed
            sets the two apart.  ``None``: ``kernel_size``.
        dropout: probability in ``[0, 1)``, applied where the seed applies it.
        max_len: positions of the positional embeddings: the longest source and target.
        pad_index: the padding token of both vocabularies, and the value of the decoder's causal
            padding.
        impl: ``"fused"`` (:func:`transformer_kernels.glu_conv1d`,
            :func:`transformer_kernels.scaled_dot_product_attention`) or ``"reference"`` (the
            seed's math from :mod:`transformer_kernels.reference`).  Same parameters either way.
        mask_source_padding: padded source positions (``src == pad_index``) enter every encoder
            convolution as zeros (as fairseq's ``FConvEncoder`` masks them) and get attention
            weight exactly 0, so a row padded at its end gives what it gives alone, unpadded.
            The seed does neither: its convolutions read the pad token's features and its
            attention attends to them, so its outputs depend on how much padding a batch has.
            ``False`` reproduces the seed exactly.

    The fused decoder never materializes attention weights except in its last layer, whose
    weights :meth:`forward` returns: that layer attends with them (a softmax and two batched
    matmuls, the seed's own math), so returning them costs nothing beyond the seed's work.
    ``emb_dim`` above 256 (the fused attention's head dim limit) attends that way in every layer.

    Shape:
        - ``src``: ``[B, S]`` and ``tgt``: ``[B, T]``, token ids (int64 or int32), ``S, T <= max_len``.
        - Output: ``logits`` ``[B, T, tgt_vocab_size]`` and ``attention`` ``[B, T, S]``.

    Example::

        >>> model = ConvSeq2Seq(1000, 1200, emb_dim=64, hid_dim=128, num_encoder_layers=2,
        ...                     num_decoder_layers=2)
        >>> src = torch.randint(2, 1000, (4, 11))
        >>> tgt = torch.randint(2, 1200, (4, 9))
        >>> logits, attention = model(src, tgt)   # [4, 9, 1200], [4, 9, 11]
    """

    def __init__(
        self,
        src_vocab_size: int,
        tgt_vocab_size: int,
        *,
        emb_dim: int = 256,
        hid_dim: int = 512,
        num_encoder_layers: int = 10,
        num_decoder_layers: int = 10,
        kernel_size: int = 3,
        dropout: float = 0.25,
        max_len: int = 100,
        pad_index: int = 1,
        impl: str = "fused",
        mask_source_padding: bool = True,
        decoder_kernel_size: Optional[int] = None,
    ) -> None:
        super().__init__()
        decoder_kernel_size = kernel_size if decoder_kernel_size is None else decoder_kernel_size
        for name, value in (
            ("src_vocab_size", src_vocab_size), ("tgt_vocab_size", tgt_vocab_size), ("emb_dim", emb_dim),
            ("hid_dim", hid_dim), ("num_encoder_layers", num_encoder_layers),
            ("num_decoder_layers", num_decoder_layers), ("kernel_size", kernel_size), ("max_len", max_len),
            ("decoder_kernel_size", decoder_kernel_size),
        ):
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd (the encoder pads (kernel_size - 1) // 2 on each side), "
                             f"got {kernel_size}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be a float in [0, 1), got {dropout!r}")
        vocab = min(src_vocab_size, tgt_vocab_size)
        if not is_int(pad_index) or not 0 <= pad_index < vocab:
            raise ValueError(f"pad_index must be an int in [0, min(src_vocab_size, tgt_vocab_size)) = [0, {vocab}), "
                             f"got {pad_index!r}")
        if impl not in _IMPLS:
            raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
        if not isinstance(mask_source_padding, bool):
            raise TypeError(f"mask_source_padding must be a bool, got {type(mask_source_padding).__name__}")
        self.max_len = max_len
        self.pad_index = pad_index
        self.mask_source_padding = mask_source_padding
        self.encoder = ConvEncoder(src_vocab_size, emb_dim, hid_dim, num_encoder_layers, kernel_size, dropout,
                                   max_len, impl)
        self.decoder = ConvDecoder(tgt_vocab_size, emb_dim, hid_dim, num_decoder_layers, decoder_kernel_size,
                                   dropout, max_len, pad_index, impl)

    @property
    def impl(self) -> str:
        return self.encoder.impl

    def extra_repr(self) -> str:
        return f"impl={self.impl!r}, max_len={self.max_len}, pad_index={self.pad_index}, " \
               f"mask_source_padding={self.mask_source_padding}"

    def encode(self, src: Tensor) -> EncoderOutput:
        """``src`` ``[B, S]`` -> what the decoder attends to (:class:`EncoderOutput`)."""
        self._check_tokens("src", src)
        return self.encoder(src, src.eq(self.pad_index) if self.mask_source_padding else None)

    def forward(self, src: Tensor, tgt: Tensor) -> tuple[Tensor, Tensor]:
        """Teacher-forced decoding.

        Args:
            src: ``[B, S]`` source token ids (int64 or int32), ``1 <= S <= max_len``.
            tgt: ``[B, T]`` token ids, the decoder's input (the target without its last token),
                ``1 <= T <= max_len``, on ``src``'s device.

        Returns:
            ``(logits, attention)``: ``logits`` ``[B, T, tgt_vocab_size]`` for the next token at
            every position, ``attention`` ``[B, T, S]`` the last decoder layer's attention weights.
        """
        encoder = self.encode(src)
        self._check_tokens("tgt", tgt)
        check_same_device("src", src, tgt=tgt)
        if tgt.shape[0] != src.shape[0]:
            raise ValueError(f"tgt must have src's batch size {src.shape[0]}, got shape {tuple(tgt.shape)}")
        return self.decoder(tgt, encoder)

    @torch.no_grad()
    def generate(
        self, src: Tensor, *, max_len: int, bos_index: int, eos_index: int, beam_size: int = 1,
        cuda_graph: Optional[bool] = None,
    ) -> Tensor:
        """Decode ``src`` greedily (``beam_size=1``) or by beam search, with caches.

        The encoder runs once; its output is carried with the beams.  Each decoder layer keeps its
        last inputs, fused in a ring that one kernel reads and updates in place
        (:meth:`GLUConv1d.update`), so a step costs one position, and the tokens are exactly those
        of re-running the decoder on the whole prefix every step.  On a GPU the steps after the first
        replay a CUDA graph.  Runs in evaluation mode (no dropout) whatever the module's mode, which
        it restores.

        Args:
            src: ``[B, S]`` token ids.
            max_len: the longest output, ``bos_index`` included; the decoder reads prefixes of up to
                ``max_len - 1`` tokens, whose positions the model's ``max_len`` must cover.
            bos_index, eos_index: the first token of every output, and the token that ends one.
            beam_size: hypotheses kept per row; see :func:`transformer_kernels.models.generate`.
            cuda_graph: None (replay the steps from a CUDA graph on a GPU), True (insist) or
                False (run every step eagerly).

        Returns:
            LongTensor ``[B, T]``, ``T <= max_len``: each row starts with ``bos_index``; after its
            ``eos_index`` it holds ``pad_index``.
        """
        if not is_int(max_len) or not 1 <= max_len <= self.max_len + 1:
            raise ValueError(f"max_len must be an int in [1, model max_len + 1 = {self.max_len + 1}] "
                             f"(the decoder's positions), got {max_len!r}")
        vocab = self.decoder.fc_out.out_features
        for name, value in (("bos_index", bos_index), ("eos_index", eos_index)):
            if not is_int(value) or not 0 <= value < vocab:
                raise ValueError(f"{name} must be an int in [0, tgt_vocab_size = {vocab}), got {value!r}")
        with in_eval_mode(self):
            encoder = self.encode(src)
            return generate(
                self.decoder, self.decoder.initial_state(encoder), batch_size=src.shape[0], max_len=max_len,
                bos_index=bos_index, eos_index=eos_index, pad_index=self.pad_index, beam_size=beam_size,
                device=src.device, cuda_graph=cuda_graph,
            )

    def _check_tokens(self, name: str, tokens: Tensor) -> None:
        check_tensor(name, tokens, ndim=2, dtypes=(torch.int64, torch.int32))
        if not 1 <= tokens.shape[1] <= self.max_len:
            raise ValueError(f"{name} must have 1 to max_len = {self.max_len} positions, got shape "
                             f"{tuple(tokens.shape)}")
