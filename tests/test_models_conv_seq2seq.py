"""models.ConvSeq2Seq: against a re-implementation of the seed's ``Seq2Seq(Encoder, Decoder)``
(checkpoints load strictly, same outputs, attention and gradients without source masking), fused
against reference (outputs, attention, loss, every gradient, float64), source padding masking,
cached against uncached generation, torch.compile, training, argument errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _helpers import ForwardSpy, assert_close_to_reference

from transformer_kernels.models import ConvSeq2Seq, RedecodingDecoder, generate

SRC_VOCAB, TGT_VOCAB, PAD, BOS = 23, 29, 1, 2
TINY = dict(emb_dim=8, hid_dim=16, num_encoder_layers=2, num_decoder_layers=2, max_len=12)


# ----------------------------------------------------------------------------
# The seed's model, re-implemented with its module structure and math
# ----------------------------------------------------------------------------


class SeedEncoder(torch.nn.Module):
    def __init__(self, vocab, emb, hid, layers, kernel_size, dropout, max_len):
        super().__init__()
        self.scale = torch.sqrt(torch.tensor([0.5]))  # a float32 tensor, as the seed's
        self.tok_embedding = torch.nn.Embedding(vocab, emb)
        self.pos_embedding = torch.nn.Embedding(max_len, emb)
        self.emb2hid = torch.nn.Linear(emb, hid)
        self.hid2emb = torch.nn.Linear(hid, emb)
        self.convs = torch.nn.ModuleList(
            torch.nn.Conv1d(hid, 2 * hid, kernel_size, padding=(kernel_size - 1) // 2) for _ in range(layers)
        )
        self.dropout = torch.nn.Dropout(dropout)

    def forward(self, src):
        pos = torch.arange(src.shape[1]).unsqueeze(0).repeat(src.shape[0], 1)
        embedded = self.dropout(self.tok_embedding(src) + self.pos_embedding(pos))
        conv_input = self.emb2hid(embedded).permute(0, 2, 1)
        for conv in self.convs:
            conved = F.glu(conv(self.dropout(conv_input)), dim=1)
            conv_input = conved = (conved + conv_input) * self.scale
        conved = self.hid2emb(conved.permute(0, 2, 1))
        return conved, (conved + embedded) * self.scale


class SeedDecoder(torch.nn.Module):
    def __init__(self, vocab, emb, hid, layers, kernel_size, dropout, pad_index, max_len):
        super().__init__()
        self.kernel_size, self.pad_index = kernel_size, pad_index
        self.scale = torch.sqrt(torch.tensor([0.5]))
        self.tok_embedding = torch.nn.Embedding(vocab, emb)
        self.pos_embedding = torch.nn.Embedding(max_len, emb)
        self.emb2hid = torch.nn.Linear(emb, hid)
        self.hid2emb = torch.nn.Linear(hid, emb)
        self.attn_hid2emb = torch.nn.Linear(hid, emb)
        self.attn_emb2hid = torch.nn.Linear(emb, hid)
        self.fc_out = torch.nn.Linear(emb, vocab)
        self.convs = torch.nn.ModuleList(torch.nn.Conv1d(hid, 2 * hid, kernel_size) for _ in range(layers))
        self.dropout = torch.nn.Dropout(dropout)

    def calculate_attention(self, embedded, conved, encoder_conved, encoder_combined):
        combined = (self.attn_hid2emb(conved.permute(0, 2, 1)) + embedded) * self.scale
        attention = F.softmax(torch.matmul(combined, encoder_conved.permute(0, 2, 1)), dim=2)
        attended = self.attn_emb2hid(torch.matmul(attention, encoder_combined))
        return attention, (conved + attended.permute(0, 2, 1)) * self.scale

    def forward(self, trg, encoder_conved, encoder_combined):
        pos = torch.arange(trg.shape[1]).unsqueeze(0).repeat(trg.shape[0], 1)
        embedded = self.dropout(self.tok_embedding(trg) + self.pos_embedding(pos))
        conv_input = self.emb2hid(embedded).permute(0, 2, 1)
        batch, hid = conv_input.shape[:2]
        for conv in self.convs:
            conv_input = self.dropout(conv_input)
            padding = torch.zeros(batch, hid, self.kernel_size - 1, dtype=conv_input.dtype).fill_(self.pad_index)
            conved = F.glu(conv(torch.cat((padding, conv_input), dim=2)), dim=1)
            attention, conved = self.calculate_attention(embedded, conved, encoder_conved, encoder_combined)
            conv_input = conved = (conved + conv_input) * self.scale
        return self.fc_out(self.dropout(self.hid2emb(conved.permute(0, 2, 1)))), attention


class SeedSeq2Seq(torch.nn.Module):
    # The seed's ENC_KERNEL_SIZE ("must be odd") and DEC_KERNEL_SIZE ("can be even or odd").
    def __init__(self, emb_dim, hid_dim, num_encoder_layers, num_decoder_layers, max_len, kernel_size=3,
                 dropout=0.0, decoder_kernel_size=None):
        super().__init__()
        self.encoder = SeedEncoder(SRC_VOCAB, emb_dim, hid_dim, num_encoder_layers, kernel_size, dropout, max_len)
        self.decoder = SeedDecoder(TGT_VOCAB, emb_dim, hid_dim, num_decoder_layers,
                                   decoder_kernel_size or kernel_size, dropout, PAD, max_len)

    def forward(self, src, trg):
        return self.decoder(trg, *self.encoder(src))


# ----------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------


def make_batch(batch=4, src_lengths=(7, 5, 3, 7), tgt_len=6, seed=0):
    """Source rows padded at their end to the longest, and a target (teacher-forced input)."""
    g = torch.Generator().manual_seed(seed)
    src_len = max(src_lengths)
    src = torch.randint(3, SRC_VOCAB, (batch, src_len), generator=g)
    src[torch.arange(src_len) >= torch.tensor(src_lengths)[:, None]] = PAD
    tgt = torch.randint(3, TGT_VOCAB, (batch, tgt_len), generator=g)
    return src, tgt


class SmoothDropout(torch.nn.Module):
    """Stands in for ``nn.Dropout`` in comparisons: a fixed elementwise function, so two models
    that apply it to the same values at the same places agree, whatever their layouts (real
    dropout draws its mask in memory order, and the seed keeps ``[B, C, L]`` where we keep
    ``[B, L, C]``)."""

    def forward(self, x):
        return x * (1.0 + 0.5 * torch.sin(3.0 * x))


def with_smooth_dropout(model):
    model.encoder.dropout = SmoothDropout()
    model.decoder.dropout = SmoothDropout()
    return model


def model_pair(**kwargs):
    """Fused and reference models with the same float64 parameters (the reference loads the
    fused one's state_dict, strict), without dropout unless asked."""
    config = TINY | {"dropout": 0.0} | kwargs
    fused = ConvSeq2Seq(SRC_VOCAB, TGT_VOCAB, impl="fused", **config).double()
    ref = ConvSeq2Seq(SRC_VOCAB, TGT_VOCAB, impl="reference", **config).double()
    ref.load_state_dict(fused.state_dict(), strict=True)
    return fused, ref


def run(model, src, tgt, seed=1):
    """Logits, attention, the loss and every parameter's gradient (by name), dropout drawn from ``seed``."""
    model.zero_grad()
    torch.manual_seed(seed)
    logits, attention = model(src, tgt)
    target = torch.roll(tgt, -1, dims=1)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=PAD)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return logits, attention, loss, grads


def assert_runs_agree(actual, expected, **criteria):
    logits, attention, loss, grads = actual
    names = ["logits", "attention", "loss", *(f"grad {name}" for name in grads)]
    assert list(grads) == list(expected[3])
    assert_close_to_reference(
        [logits, attention, loss, *grads.values()], [*expected[:3], *expected[3].values()], names, **criteria
    )


# ----------------------------------------------------------------------------
# The seed's checkpoints
# ----------------------------------------------------------------------------


def test_state_dict_is_the_seeds():
    seed = SeedSeq2Seq(**TINY)
    for impl in ("fused", "reference"):
        model = ConvSeq2Seq(SRC_VOCAB, TGT_VOCAB, impl=impl, **TINY)
        assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in seed.state_dict().items()}
        model.load_state_dict(seed.state_dict(), strict=True)
    seed.load_state_dict(model.state_dict(), strict=True)


@pytest.mark.parametrize("decoder_kernel_size", [None, 2, 5], ids=["shared", "decoder_k2", "decoder_k5"])
@pytest.mark.parametrize("dropout", ["none", "smooth"])
@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_seed_checkpoint_gives_the_seeds_outputs_attention_and_grads(impl, dropout, decoder_kernel_size):
    sizes = TINY | {"decoder_kernel_size": decoder_kernel_size}
    seed = SeedSeq2Seq(**sizes).double()
    model = ConvSeq2Seq(SRC_VOCAB, TGT_VOCAB, impl=impl, mask_source_padding=False, dropout=0.0, **sizes).double()
    model.load_state_dict(seed.state_dict(), strict=True)
    if dropout == "smooth":  # dropout sits where the seed's does, on the same values
        seed, model = with_smooth_dropout(seed), with_smooth_dropout(model)
    src, tgt = make_batch()
    # The seed scales by float32's sqrt(0.5), 3e-8 from the float64 value ours uses.
    assert_runs_agree(run(model, src, tgt), run(seed, src, tgt), atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------
# Fused against reference
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("mask_source_padding", [True, False])
@pytest.mark.parametrize("dropout", ["none", "smooth"])
def test_fused_matches_reference(mask_source_padding, dropout):
    fused, ref = model_pair(mask_source_padding=mask_source_padding)
    if dropout == "smooth":
        fused, ref = with_smooth_dropout(fused), with_smooth_dropout(ref)
    src, tgt = make_batch()
    assert_runs_agree(run(fused, src, tgt), run(ref, src, tgt), tol=1e-9)


def test_fused_runs_the_fused_ops_and_reference_none(monkeypatch):
    fused, ref = model_pair(num_decoder_layers=3)
    src, tgt = make_batch()
    spy = ForwardSpy(monkeypatch, ops=("attention", "glu_conv"), names=("eager",))
    fused(src, tgt)
    # Two encoder and three decoder convolutions; the decoder's last layer attends with the
    # weights it returns, the others through the fused op.
    assert sorted(op for op, _ in spy.calls) == ["attention"] * 2 + ["glu_conv"] * 5
    spy.calls.clear()
    ref(src, tgt)
    assert spy.calls == []


def test_wide_embedding_attends_without_the_fused_op():
    # emb_dim above the fused attention's head-dim limit (256): every layer materializes its weights.
    fused, ref = model_pair(emb_dim=260, num_decoder_layers=2)
    src, tgt = make_batch()
    assert_runs_agree(run(fused, src, tgt), run(ref, src, tgt), tol=1e-9)


# ----------------------------------------------------------------------------
# Source padding
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_masked_padding_gets_no_attention_and_rows_equal_their_unpadded_selves(impl):
    model = ConvSeq2Seq(SRC_VOCAB, TGT_VOCAB, impl=impl, **TINY).double().eval()
    lengths = (7, 5, 3, 7)
    src, tgt = make_batch(src_lengths=lengths)
    logits, attention = model(src, tgt)
    padded = src.eq(PAD)
    assert padded.any()
    assert attention.masked_select(padded[:, None, :]).eq(0).all()
    torch.testing.assert_close(attention.sum(-1), torch.ones_like(attention[..., 0]), atol=1e-12, rtol=0)
    for row, length in enumerate(lengths):
        alone_logits, alone_attention = model(src[row : row + 1, :length], tgt[row : row + 1])
        torch.testing.assert_close(logits[row : row + 1], alone_logits, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(attention[row : row + 1, :, :length], alone_attention, atol=1e-12, rtol=1e-12)


def test_unmasked_padding_is_attended_as_the_seed_does():
    model = ConvSeq2Seq(SRC_VOCAB, TGT_VOCAB, mask_source_padding=False, **TINY).double().eval()
    src, tgt = make_batch()
    _, attention = model(src, tgt)
    assert attention.masked_select(src.eq(PAD)[:, None, :]).gt(0).all()


@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_a_source_of_padding_only_attends_nowhere(impl):
    fused, ref = model_pair()
    model = fused if impl == "fused" else ref
    src, tgt = make_batch()
    src[1] = PAD
    logits, attention, _, grads = run(model, src, tgt)
    assert attention[1].eq(0).all() and torch.isfinite(logits).all()
    assert all(torch.isfinite(g).all() for g in grads.values())


# ----------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["fused", "reference"])
@pytest.mark.parametrize(("beam_size", "decoder_kernel_size"), [(1, None), (2, None), (3, None), (4, None), (1, 2),
                                                                 (3, 4)])
def test_cached_generation_gives_the_tokens_of_redecoding(impl, beam_size, decoder_kernel_size):
    torch.manual_seed(3)
    model = ConvSeq2Seq(SRC_VOCAB, TGT_VOCAB, impl=impl, decoder_kernel_size=decoder_kernel_size,
                        **TINY).double().eval()
    src, _ = make_batch(batch=4, src_lengths=(7, 5, 3, 6))
    max_len = model.max_len + 1
    redecoding = RedecodingDecoder(lambda src, tgt: model(src, tgt)[0])
    kwargs = dict(batch_size=src.shape[0], max_len=max_len, bos_index=BOS, pad_index=PAD, beam_size=beam_size)
    # eos: the token greedy decoding emits most after the first step, so hypotheses do end early.
    greedy = generate(redecoding, src, eos_index=-1, **(kwargs | {"beam_size": 1}))
    eos = int(greedy[:, 2:].flatten().mode().values)
    expected = generate(redecoding, src, eos_index=eos, **kwargs)
    actual = model.generate(src, max_len=max_len, bos_index=BOS, eos_index=eos, beam_size=beam_size)
    assert actual.tolist() == expected.tolist()
    ended = actual.eq(eos).cumsum(1).gt(0)
    assert ended[:, :-1].any(), "no hypothesis ended: the test would not exercise eos"
    assert actual[:, 1:][ended[:, :-1]].eq(PAD).all()


def test_generate_runs_in_eval_mode_and_restores_training_mode():
    torch.manual_seed(0)
    model = ConvSeq2Seq(SRC_VOCAB, TGT_VOCAB, **(TINY | {"dropout": 0.5})).train()
    src, _ = make_batch()
    first = model.generate(src, max_len=6, bos_index=BOS, eos_index=3)
    assert model.training
    assert torch.equal(model.generate(src, max_len=6, bos_index=BOS, eos_index=3), first)  # no dropout
    assert torch.equal(model.eval().generate(src, max_len=6, bos_index=BOS, eos_index=3), first)


def test_generation_positions_are_bounded_by_max_len():
    model = ConvSeq2Seq(SRC_VOCAB, TGT_VOCAB, **TINY).eval()
    src, _ = make_batch()
    out = model.generate(src, max_len=model.max_len + 1, bos_index=BOS, eos_index=3)
    assert out.shape[1] <= model.max_len + 1 and out[:, 0].eq(BOS).all()
    with pytest.raises(ValueError, match="max_len must be an int in"):
        model.generate(src, max_len=model.max_len + 2, bos_index=BOS, eos_index=3)


# ----------------------------------------------------------------------------
# torch.compile, training
# ----------------------------------------------------------------------------


def loss_of(model, src, tgt):
    logits, _ = model(src, tgt[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt[:, 1:].reshape(-1), ignore_index=PAD)


@torch._functorch.config.patch(enable_autograd_cache=False)
def test_torch_compile_fullgraph_training_step():
    # The whole model in one graph, forward and backward, through the ops' fake kernels and
    # autograd registrations.  aot_eager: inductor's C++ code generation for the whole training
    # graph takes tens of seconds on a CPU (tests/test_glu_conv.py and test_attention.py compile
    # the ops themselves with inductor).
    torch._dynamo.reset()
    model = ConvSeq2Seq(SRC_VOCAB, TGT_VOCAB, dropout=0.0, **TINY)
    src, tgt = make_batch(tgt_len=7)
    compiled = torch.compile(loss_of, fullgraph=True, backend="aot_eager")
    loss = compiled(model, src, tgt)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    expected = loss_of(model, src, tgt)
    expected_grads = torch.autograd.grad(expected, list(model.parameters()))
    names = ["loss", *(f"grad {name}" for name, _ in model.named_parameters())]
    assert_close_to_reference([loss, *grads], [expected, *expected_grads], names, atol=1e-5, rtol=1e-4)


def copy_task(batch, g):
    """Sources of lengths 3-8 padded at the end; the target is bos, the source's tokens, eos."""
    lengths = torch.randint(3, 9, (batch,), generator=g)
    src = torch.randint(4, SRC_VOCAB, (batch, 8), generator=g)
    src[torch.arange(8) >= lengths[:, None]] = PAD
    tgt = torch.full((batch, 10), PAD)
    tgt[:, 0] = BOS
    tgt[:, 1:9] = src
    tgt[torch.arange(batch), lengths + 1] = 3  # eos
    return src, tgt


def test_training_lowers_the_loss():
    model = ConvSeq2Seq(SRC_VOCAB, TGT_VOCAB, emb_dim=16, hid_dim=32, num_encoder_layers=2, num_decoder_layers=2,
                        dropout=0.1, max_len=12)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    held_out = copy_task(64, g)
    with torch.no_grad():
        before = loss_of(model.eval(), *held_out).item()
    model.train()
    for _ in range(60):
        loss = loss_of(model, *copy_task(32, g))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        after = loss_of(model.eval(), *held_out).item()
    assert after < 0.5 * before, (before, after)


# ----------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"emb_dim": 0}, ValueError, "emb_dim must be a positive int"),
    ({"num_decoder_layers": 0}, ValueError, "num_decoder_layers must be a positive int"),
    ({"kernel_size": 4}, ValueError, "kernel_size must be odd"),
    ({"decoder_kernel_size": 0}, ValueError, "decoder_kernel_size must be a positive int"),
    ({"dropout": 1.0}, ValueError, r"dropout must be a float in \[0, 1\)"),
    ({"pad_index": SRC_VOCAB}, ValueError, "pad_index must be an int in"),
    ({"impl": "naive"}, ValueError, "impl must be one of"),
    ({"mask_source_padding": 1}, TypeError, "mask_source_padding must be a bool"),
])
def test_bad_constructor_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        ConvSeq2Seq(SRC_VOCAB, TGT_VOCAB, **(TINY | kwargs))


def test_bad_forward_and_generate_arguments():
    model = ConvSeq2Seq(SRC_VOCAB, TGT_VOCAB, **TINY)
    src, tgt = make_batch()
    with pytest.raises(TypeError, match="src must have dtype in"):
        model(src.float(), tgt)
    with pytest.raises(ValueError, match="tgt must be 2-D"):
        model(src, tgt[0])
    with pytest.raises(ValueError, match=r"src must have 1 to max_len = 12 positions"):
        model(torch.cat([src, src], 1), tgt)
    with pytest.raises(ValueError, match="tgt must have src's batch size 4"):
        model(src, tgt[:2])
    with pytest.raises(ValueError, match="bos_index must be an int in"):
        model.generate(src, max_len=5, bos_index=TGT_VOCAB, eos_index=3)
    with pytest.raises(ValueError, match="beam_size must be >= 1"):
        model.generate(src, max_len=5, bos_index=BOS, eos_index=3, beam_size=0)

