"""transformer_kernels.models.Transformer: fused against reference math, torch.nn.Transformer's
state_dict and outputs, cached generation against re-running forward, padding, torch.compile,
training."""

import collections
import math

import pytest
import torch
import torch.nn.functional as F
from _helpers import ForwardSpy, OpRecorder, assert_close_to_reference

from transformer_kernels.models import RedecodingDecoder, Transformer, generate
from transformer_kernels.models.transformer import _CachedDecoder
from transformer_kernels.ops.attention import Causal



SRC_VOCAB, TGT_VOCAB = 11, 13
PAD, BOS, EOS = 0, 1, 2
TINY = dict(d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=24, dropout=0.0)
# float64 agreement of two orders of the same arithmetic
TOL = 1e-9


def tiny_model(impl: str = "fused", dtype: torch.dtype = torch.float64, **overrides) -> Transformer:
    return Transformer(SRC_VOCAB, TGT_VOCAB, **(TINY | overrides), impl=impl).to(dtype)


def tokens(vocab: int, lengths: list[int], length: int) -> torch.Tensor:
    """``[len(lengths), length]`` random non-special tokens, row ``b`` padded after ``lengths[b]``."""
    out = torch.randint(EOS + 1, vocab, (len(lengths), length))
    return out.masked_fill(torch.arange(length) >= torch.tensor(lengths)[:, None], PAD)


def batch(src_lengths=(7, 4, 6), tgt_lengths=(5, 6, 3)):
    src = tokens(SRC_VOCAB, list(src_lengths), max(src_lengths))
    return src, tokens(TGT_VOCAB, list(tgt_lengths), max(tgt_lengths))


def loss_of(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=PAD)


def loss_and_grads(model: Transformer, src: torch.Tensor, tgt: torch.Tensor):
    model.zero_grad()
    logits = model(src, tgt[:, :-1])
    loss = loss_of(logits, tgt[:, 1:])
    loss.backward()
    return logits, loss, {name: p.grad for name, p in model.named_parameters()}


# ----------------------------------------------------------------------------
# Fused against reference
# ----------------------------------------------------------------------------


def test_fused_matches_reference_outputs_loss_and_every_gradient():
    fused = tiny_model("fused")
    reference = tiny_model("reference")
    reference.load_state_dict(fused.state_dict(), strict=True)
    src, tgt = batch()
    logits, loss, grads = loss_and_grads(fused, src, tgt)
    expected_logits, expected_loss, expected_grads = loss_and_grads(reference, src, tgt)
    assert set(grads) == set(expected_grads) and all(g is not None for g in grads.values())
    names = ["logits", "loss", *grads]
    assert_close_to_reference(
        [logits, loss, *grads.values()], [expected_logits, expected_loss, *expected_grads.values()], names, tol=TOL
    )


def test_all_padding_source_attends_to_nothing():
    # A source of padding only: its queries see no key, so attention gives 0 (not the seeds' uniform
    # average of the padding, not NaN) on both paths, and gradients stay finite.
    fused = tiny_model("fused")
    reference = tiny_model("reference")
    reference.load_state_dict(fused.state_dict())
    src, tgt = batch(src_lengths=(5, 0, 3))
    logits, loss, grads = loss_and_grads(fused, src, tgt)
    expected_logits, expected_loss, expected_grads = loss_and_grads(reference, src, tgt)
    assert_close_to_reference(
        [logits, loss, *grads.values()], [expected_logits, expected_loss, *expected_grads.values()],
        ["logits", "loss", *grads], tol=TOL,
    )
    layer = fused.transformer.decoder.layers[0].multihead_attn
    q, k, v = (torch.randn(3, 2, 4, 8, dtype=torch.float64) for _ in range(3))
    out = layer.attend(q, k, v, key_padding_mask=src.eq(PAD)[:, :4])
    torch.testing.assert_close(out[1], layer.out_proj.bias.expand(4, -1), rtol=0, atol=0)


def test_fused_runs_on_the_ops_with_unexpanded_masks(monkeypatch):
    model = tiny_model("fused", num_encoder_layers=1, num_decoder_layers=1)
    src, tgt = batch()
    spy = ForwardSpy(monkeypatch, ops=("attention", "qkv"), names=("eager",))
    model(src, tgt)
    attention = [args[3] for (op, _), args in zip(spy.calls, spy.inputs) if op == "attention"]
    # encoder self (padded), decoder self (causal), cross (padded); three packed projections + q + kv
    assert [args.causal for args in attention] == [Causal.NONE, Causal.TOP_LEFT, Causal.NONE]
    assert all(args.attn_mask is None for args in attention)
    assert [args.key_padding_mask is None for args in attention] == [False, True, False]
    for args in (attention[0], attention[2]):
        assert torch.equal(args.key_padding_mask, src.eq(PAD))
    assert [op for op, _ in spy.calls].count("qkv") == 4


def test_in_projection_gradients_gather_without_zero_filled_copies():
    """The packed in-projection is used whole (self-attention) or split once into its query and
    key-value rows (cross-attention), so backward joins the parts' gradients in one op: a slice per
    part would fill a zero gradient of the whole parameter for each part and add them up, kernels a
    host-bound GPU step pays for."""
    model = tiny_model("fused")
    src, tgt = batch()
    with OpRecorder() as recorder:
        logits = model(src, tgt)
        torch.autograd.grad(logits.sum(), list(model.parameters()))
    counts = collections.Counter(recorder.ops)
    assert counts["slice_backward"] == 0
    assert counts["split_with_sizes"] == 2 * TINY["num_decoder_layers"]  # weight and bias per layer


def test_reference_runs_no_fused_op(monkeypatch):
    model = tiny_model("reference", num_encoder_layers=1, num_decoder_layers=1)
    spy = ForwardSpy(monkeypatch, ops=("attention", "qkv"), names=("eager",))
    model(*batch())
    assert spy.calls == []


@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_dropout_in_training_only(impl):
    model = tiny_model(impl, dropout=0.5)
    src, tgt = batch()
    torch.manual_seed(1)
    first = model(src, tgt)
    torch.manual_seed(1)
    assert torch.equal(model(src, tgt), first)  # drawn from torch's generator
    model.eval()
    evaluated = model(src, tgt)
    assert not torch.allclose(first, evaluated)
    without_dropout = tiny_model(impl, dropout=0.0).eval()
    without_dropout.load_state_dict(model.state_dict())
    torch.testing.assert_close(evaluated, without_dropout(src, tgt), rtol=0, atol=0)


# ----------------------------------------------------------------------------
# torch.nn.Transformer
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_stack_is_nn_transformer(impl):
    model = tiny_model(impl)
    torch_transformer = torch.nn.Transformer(
        TINY["d_model"], TINY["nhead"], TINY["num_encoder_layers"], TINY["num_decoder_layers"],
        TINY["dim_feedforward"], dropout=0.0, batch_first=True, dtype=torch.float64,
    )
    assert list(model.transformer.state_dict()) == list(torch_transformer.state_dict())
    model.transformer.load_state_dict(torch_transformer.state_dict(), strict=True)
    torch_transformer.load_state_dict(model.transformer.state_dict(), strict=True)

    lengths, tgt_len = torch.tensor([7, 3, 5]), 6
    padding = torch.arange(7) >= lengths[:, None]
    src = torch.randn(3, 7, TINY["d_model"], dtype=torch.float64, requires_grad=True)
    tgt = torch.randn(3, tgt_len, TINY["d_model"], dtype=torch.float64, requires_grad=True)
    out = model.transformer(src, tgt, padding)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(tgt_len, dtype=torch.float64)
    expected = torch_transformer(
        src, tgt, tgt_mask=causal, src_key_padding_mask=padding, memory_key_padding_mask=padding, tgt_is_causal=True
    )
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, [src, tgt, *model.transformer.parameters()], grad)
    expected_grads = torch.autograd.grad(expected, [src, tgt, *torch_transformer.parameters()], grad)
    names = ["out", "grad src", "grad tgt", *(f"grad {n}" for n, _ in model.transformer.named_parameters())]
    assert_close_to_reference([out, *grads], [expected, *expected_grads], names, tol=TOL)


def test_built_on_the_meta_device_then_loaded_matches():
    """The usual recipe for a large model: built on the meta device, ``to_empty``, then a strict
    ``load_state_dict``.  The positional table, in no state_dict, is computed again where the
    tensors are made (it was left as uninitialized memory); a later ``.to(dtype)`` computes it there."""
    model = tiny_model()
    with torch.device("meta"):
        built = Transformer(SRC_VOCAB, TGT_VOCAB, **TINY)
    built.to_empty(device="cpu").to(torch.float64).load_state_dict(model.state_dict())
    src, tgt = batch()
    torch.testing.assert_close(built(src, tgt), model(src, tgt), rtol=0, atol=0)
    torch.testing.assert_close(built.positional_encoding, model.positional_encoding, rtol=0, atol=0)


def test_stack_initializes_like_nn_transformer():
    # Xavier-uniform matrices, zero attention biases, unit norms (same distributions, not values).
    # linear2 [64, 256]: Xavier's bound is 0.137, nn.Linear's own 1 / sqrt(256) = 0.0625.
    model = Transformer(SRC_VOCAB, TGT_VOCAB, d_model=64, nhead=4, dim_feedforward=256)
    layer = model.transformer.decoder.layers[0]
    bound = (6 / (64 + 256)) ** 0.5
    assert 0.9 * bound < layer.linear2.weight.abs().max() <= bound
    assert torch.equal(layer.self_attn.in_proj_bias, torch.zeros(3 * 64))
    assert torch.equal(layer.norm3.weight, torch.ones(64))


# ----------------------------------------------------------------------------
# Padding
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_padded_rows_match_unpadded(impl):
    model = tiny_model(impl).eval()
    src_lengths, tgt_lengths = [8, 3, 5, 1], [4, 6, 2, 5]
    src, tgt = batch(src_lengths, tgt_lengths)
    logits = model(src, tgt)
    for row, (s, t) in enumerate(zip(src_lengths, tgt_lengths)):
        alone = model(src[row : row + 1, :s], tgt[row : row + 1, :t])
        assert_close_to_reference(logits[row : row + 1, :t], alone, f"row {row}", tol=TOL)


# ----------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------


def eos_prone_model(impl: str) -> Transformer:
    """A model whose hypotheses end at different steps (the eos logit raised)."""
    model = tiny_model(impl).eval()
    with torch.no_grad():
        model.output_projection.bias[EOS] += 0.15
    return model


@pytest.mark.parametrize("beam_size", [1, 2, 3, 4])
@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_cached_generation_matches_rerunning_forward(impl, beam_size):
    torch.manual_seed(3)
    model = eos_prone_model(impl)
    src, _ = batch(src_lengths=(9, 4, 6, 2, 7, 5), tgt_lengths=(1,) * 6)
    max_len = 10
    cached = model.generate(src, max_len=max_len, bos_index=BOS, eos_index=EOS, beam_size=beam_size)
    full = generate(RedecodingDecoder(model), src, batch_size=src.shape[0], max_len=max_len, bos_index=BOS,
                    eos_index=EOS, pad_index=PAD, beam_size=beam_size)
    assert cached.dtype == torch.long and cached[:, 0].eq(BOS).all()
    assert torch.equal(cached, full)
    ended = cached.eq(EOS).any(1)
    assert ended.any() and not ended.all(), "the search should end some rows with eos and not others"
    for row in cached[ended]:
        after = row[row.tolist().index(EOS) + 1 :]
        assert after.eq(PAD).all()


def test_fused_decoding_steps_call_the_registered_ops_directly(monkeypatch):
    """A decoding step's projections and attentions skip the public functions (their checks and
    backend choice cost host time on the order of a step's tiny ops) with the arguments those would
    build; the encoder and the memory's projections go through them."""
    import transformer_kernels.models.transformer as transformer_module

    torch.manual_seed(0)
    model = tiny_model("fused").eval()
    src, _ = batch()
    public = []
    for name in ("scaled_dot_product_attention", "qkv_projection"):
        real = getattr(transformer_module, name)
        monkeypatch.setattr(transformer_module, name, lambda *a, _real=real, _name=name, **k: public.append(_name) or _real(*a, **k))
    spy = ForwardSpy(monkeypatch, ops=("attention",), names=("eager",))
    model.generate(src, max_len=4, bos_index=BOS, eos_index=EOS)
    encoder_layers, decoder_layers = TINY["num_encoder_layers"], TINY["num_decoder_layers"]
    assert public.count("scaled_dot_product_attention") == encoder_layers
    assert public.count("qkv_projection") == encoder_layers + decoder_layers  # encoder qkv, memory kv
    step_args = [args[3] for args in spy.inputs[encoder_layers:]]
    # Each step: self- and cross-attention per layer.
    assert len(step_args) >= 2 * decoder_layers and len(step_args) % (2 * decoder_layers) == 0
    scale = 1.0 / math.sqrt(TINY["d_model"] // TINY["nhead"])  # the public function's default
    for args in step_args:
        assert (args.causal, args.attn_mask, args.dropout_p, args.scale) == (Causal.NONE, None, 0.0, scale)
    # The first step's self-attention sees cache position 0 of max_len = 4; its cross-attention the source.
    assert step_args[0].key_padding_mask.tolist() == [[False, True, True, True]] * src.shape[0]
    assert torch.equal(step_args[1].key_padding_mask, src.eq(PAD))


@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_cached_step_log_probs_match_forward(impl):
    # The cache, position by position along a fixed prefix (every row of every step, not only the argmax).
    model = tiny_model(impl).eval()
    src, tgt = batch()
    tgt[:, 0] = BOS
    with torch.no_grad():
        expected = model(src, tgt).log_softmax(-1)
        padding = src.eq(PAD)
        state = model.transformer.decoder.initial_state(
            model.transformer.encoder(model._embed(model.src_embedding, src), padding), padding, tgt.shape[1]
        )
        decoder = _CachedDecoder(model)
        for t in range(tgt.shape[1]):
            log_probs = decoder.step(tgt[:, t], torch.tensor(t), state)
            assert_close_to_reference(log_probs, expected[:, t], f"step {t}", tol=TOL)


@pytest.mark.parametrize("beam_size", [1, 2])
def test_generation_without_decoder_layers_matches_rerunning_forward(beam_size):
    torch.manual_seed(3)
    model = tiny_model("fused", num_decoder_layers=0).eval()
    src, _ = batch()
    cached = model.generate(src, max_len=5, bos_index=BOS, eos_index=EOS, beam_size=beam_size)
    full = generate(RedecodingDecoder(model), src, batch_size=src.shape[0], max_len=5, bos_index=BOS,
                    eos_index=EOS, pad_index=PAD, beam_size=beam_size)
    assert torch.equal(cached, full)


def test_generate_restores_training_mode():
    model = tiny_model(dropout=0.3).train()
    src, _ = batch()
    first = model.generate(src, max_len=6, bos_index=BOS, eos_index=EOS)
    assert model.training
    assert torch.equal(model.generate(src, max_len=6, bos_index=BOS, eos_index=EOS), first)  # no dropout


# ----------------------------------------------------------------------------
# torch.compile and training
# ----------------------------------------------------------------------------


@torch._inductor.config.patch(fx_graph_cache=False)
@torch._functorch.config.patch(enable_autograd_cache=False)
def test_torch_compile_fullgraph_training_step():
    torch._dynamo.reset()
    model = tiny_model("fused", dtype=torch.float32, num_encoder_layers=1, num_decoder_layers=1)
    src, tgt = batch()

    def step_loss(src, tgt):
        return loss_of(model(src, tgt[:, :-1]), tgt[:, 1:])

    compiled = torch.compile(step_loss, fullgraph=True)
    loss = compiled(src, tgt)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    expected = step_loss(src, tgt)
    expected_grads = torch.autograd.grad(expected, list(model.parameters()))
    names = ["loss", *(f"grad {n}" for n, _ in model.named_parameters())]
    assert_close_to_reference([loss, *grads], [expected, *expected_grads], names, tol=1e-5)


def test_short_training_run_lowers_the_loss():
    # Copy task: the target is the source followed by eos.
    model = tiny_model("fused", dtype=torch.float32, d_model=32, nhead=4, dim_feedforward=64)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        lengths = torch.randint(3, 9, (32,)).tolist()
        src = tokens(SRC_VOCAB, lengths, max(lengths))
        tgt = torch.cat([torch.full((32, 1), BOS), src, torch.full((32, 1), PAD)], dim=1)
        tgt[torch.arange(32), torch.tensor(lengths) + 1] = EOS
        optimizer.zero_grad()
        loss = loss_of(model(src, tgt[:, :-1]), tgt[:, 1:])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses


# ----------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, message", [
    ({"impl": "naive"}, ValueError, "impl must be one of"),
    ({"src_vocab_size": 0}, ValueError, "src_vocab_size must be >= 1"),
    ({"tgt_vocab_size": 12.0}, TypeError, "tgt_vocab_size must be an int"),
    ({"d_model": 10, "nhead": 4}, ValueError, "d_model must be divisible by nhead"),
    ({"num_encoder_layers": -1}, ValueError, "num_encoder_layers must be >= 0"),
    ({"dropout": 1.0}, ValueError, r"dropout must be in \[0, 1\)"),
    ({"pad_index": SRC_VOCAB}, ValueError, "pad_index must be a token of both vocabularies"),
])
def test_rejects_bad_constructor_arguments(kwargs, error, message):
    arguments = {"src_vocab_size": SRC_VOCAB, "tgt_vocab_size": TGT_VOCAB, **TINY} | kwargs
    with pytest.raises(error, match=message):
        Transformer(**arguments)


@pytest.mark.parametrize("call, error, message", [
    (lambda m, src: m(src.float(), src), TypeError, "src must hold token ids"),
    (lambda m, src: m(src, src[0]), ValueError, r"tgt must have shape \[B, L\]"),
    (lambda m, src: m(src, src.new_ones(3, 17)), ValueError, "1 <= L <= max_len = 16"),
    (lambda m, src: m(src, src[:2]), ValueError, "same batch size"),
    (lambda m, src: m.generate(src, max_len=17, bos_index=BOS, eos_index=EOS), ValueError, "max_len must be at most"),
    (lambda m, src: m.generate(src, max_len=5, bos_index=BOS, eos_index=TGT_VOCAB), ValueError, "eos_index must be"),
])
def test_rejects_bad_call_arguments(call, error, message):
    model = tiny_model(max_len=16)
    src, _ = batch()
    with pytest.raises(error, match=message):
        call(model, src)
