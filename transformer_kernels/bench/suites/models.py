"""The seed models, whole: a training step and greedy generation, fused against the seeds' math.

Implementations:

- ``eager`` / ``triton`` / ``cuda``: the model with ``impl="fused"``, its ops on that backend
  (:func:`transformer_kernels.use_backend`).
- ``reference``: the same model and weights with ``impl="reference"`` (the seeds' naive math; for
  ConvSeq2Seq that is the seed notebook's model).
- ``nn_transformer`` (Transformer steps): the same model with its encoder-decoder stack swapped for
  ``torch.nn.Transformer(batch_first=True)`` holding the same weights, called with torch's padding
  masks and a causal ``tgt_mask``.
- ``redecoding`` (generation): the fused model's search re-running the whole decoder on the prefix
  at every step (:class:`~transformer_kernels.models.RedecodingDecoder`), where ``generate`` keeps
  caches (and, on a GPU, replays its steps from a CUDA graph; the first two steps, eager and
  captured, are inside the time).
- ``eager_steps`` (generation, on a GPU): the fused model's ``generate`` with ``cuda_graph=False``,
  every step run eagerly: what the graph's replays save.

Cases, on padded batches with source and target lengths uniform in 8-40 (fixed seed):

- ``<model>_train_*``, direction ``fwd+bwd``: forward, the token-mean cross-entropy and the gradient
  of every parameter, in ``train()`` with dropout 0, so every implementation computes the same loss
  (its error is measured against the reference model in float64 on CPU, float32 on GPUs).  The
  optimizer's update is the same for every implementation and is left out.
- ``<model>_greedy40_*``, direction ``fwd``: greedy decoding of 40 tokens (``eval()``, no grad).  Its
  error is the fraction of tokens that differ from the reference model's (untrained weights have
  near-ties, where a rounding difference picks another token and the rest of the row follows it).

``seeds_*`` cases are the seed notebooks' configurations at batch 128 (``--full``, and every GPU
run); the CPU's ``--quick`` run times a smaller ``small_*`` configuration.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ... import use_backend
from ...models import ConvSeq2Seq, RedecodingDecoder, Transformer, generate
from ...train import logits_of
from . import GEMM_DIRECTION_COST, Group, Impl, Setting, Target, backends_for

OP = "models"
PAD, BOS, EOS = 0, 1, 2
GENERATED_TOKENS = 40


@dataclasses.dataclass(frozen=True)
class ModelCase:
    """A model family, its size and the batch.  ``sizes``: the constructor's size arguments."""

    name: str
    model: str  # "transformer" or "convs2s"
    sizes: dict
    batch: int
    vocab: int
    min_length: int = 8
    max_length: int = 40

    def build(self, impl: str) -> torch.nn.Module:
        model_class = Transformer if self.model == "transformer" else ConvSeq2Seq
        # max_len covers the longest target and the generated tokens' positions.
        return model_class(self.vocab, self.vocab, **self.sizes, dropout=0.0, pad_index=PAD, impl=impl,
                           max_len=max(self.max_length, GENERATED_TOKENS) + 1)

    def tokens(self, generator: torch.Generator, device: torch.device) -> torch.Tensor:
        """``[batch, max_length]`` ids in ``[3, vocab)``, each row padded after its length."""
        lengths = torch.randint(self.min_length, self.max_length + 1, (self.batch,), generator=generator)
        ids = torch.randint(3, self.vocab, (self.batch, self.max_length), generator=generator)
        return ids.masked_fill(torch.arange(self.max_length) >= lengths[:, None], PAD).to(device)


_SEED_TRANSFORMER = dict(d_model=512, nhead=8, num_encoder_layers=6, num_decoder_layers=6, dim_feedforward=2048)
_SEED_CONVS2S = dict(emb_dim=256, hid_dim=512, num_encoder_layers=10, num_decoder_layers=10, kernel_size=3)
SEED_CASES = [
    ModelCase("transformer_seeds_B128_L8-40", "transformer", _SEED_TRANSFORMER, 128, 8000),
    ModelCase("convs2s_seeds_B128_L8-40", "convs2s", _SEED_CONVS2S, 128, 8000),
]
SMALL_CASES = [
    ModelCase("transformer_small_B16_L8-40", "transformer",
              dict(d_model=128, nhead=4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=512), 16, 1000),
    ModelCase("convs2s_small_B16_L8-40", "convs2s",
              dict(emb_dim=64, hid_dim=128, num_encoder_layers=3, num_decoder_layers=3, kernel_size=3), 16, 1000),
]
TINY_CASES = [
    ModelCase("transformer_tiny_B2_L3-8", "transformer",
              dict(d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=32), 2, 24, 3, 8),
    ModelCase("convs2s_tiny_B2_L3-8", "convs2s",
              dict(emb_dim=8, hid_dim=16, num_encoder_layers=1, num_decoder_layers=1, kernel_size=3), 2, 24, 3, 8),
]


def _train(case: ModelCase) -> str:
    return case.name.replace(f"{case.model}_", f"{case.model}_train_", 1)


def _greedy(case: ModelCase) -> str:
    return case.name.replace(f"{case.model}_", f"{case.model}_greedy{GENERATED_TOKENS}_", 1)


TARGETS = (
    # GPU: the training step 1.5x the seeds' math (ConvSeq2Seq 1.3x), the Transformer's 1.2x torch's;
    # cached generation 3x re-decoding.
    [Target(OP, _train(SEED_CASES[0]), "fwd+bwd", "triton", "reference", 1.5, "cuda"),
     Target(OP, _train(SEED_CASES[0]), "fwd+bwd", "triton", "nn_transformer", 1.2, "cuda"),
     Target(OP, _train(SEED_CASES[1]), "fwd+bwd", "triton", "reference", 1.3, "cuda")]
    + [Target(OP, _greedy(case), "fwd", "triton", "redecoding", 3.0, "cuda") for case in SEED_CASES]
    # CPU: fused at least as fast as the seeds' math in every case.
    + [Target(OP, name, direction, "eager", "reference", 1.0, "cpu")
       for case in SEED_CASES + SMALL_CASES
       for name, direction in ((_train(case), "fwd+bwd"), (_greedy(case), "fwd"))]
)


def cases(setting: Setting) -> list[ModelCase]:
    if setting.size == "tiny":
        return TINY_CASES
    if setting.size == "quick" and not setting.cuda:
        return SMALL_CASES
    return SEED_CASES


@dataclasses.dataclass
class Inputs:
    """The batch and the fused model every implementation copies its weights from."""

    src: torch.Tensor
    tgt: torch.Tensor
    fused: torch.nn.Module

    @classmethod
    def make(cls, case: ModelCase, setting: Setting) -> "Inputs":
        generator = torch.Generator().manual_seed(0)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            fused = case.build("fused")
        src, tgt = case.tokens(generator, setting.device), case.tokens(generator, setting.device)
        tgt[:, 0] = BOS
        return cls(src, tgt, fused.to(setting.device, setting.dtype))


def _copy(inputs: Inputs, case: ModelCase, impl: str, dtype: torch.dtype) -> torch.nn.Module:
    model = case.build(impl).to(inputs.src.device, dtype)
    model.load_state_dict(inputs.fused.state_dict())
    return model


class _TorchStack(torch.nn.Module):
    """``torch.nn.Transformer`` in the place of the model's ``transformer``, with its masks."""

    def __init__(self, model: Transformer, sizes: dict) -> None:
        super().__init__()
        self.stack = torch.nn.Transformer(**sizes, dropout=0.0, batch_first=True)
        self.stack.load_state_dict(model.transformer.state_dict())

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_key_padding_mask: torch.Tensor) -> torch.Tensor:
        causal = torch.nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], tgt.device, tgt.dtype)
        return self.stack(src, tgt, tgt_mask=causal, src_key_padding_mask=src_key_padding_mask,
                          memory_key_padding_mask=src_key_padding_mask, tgt_is_causal=True)


def _model_for(impl: str, case: ModelCase, inputs: Inputs) -> torch.nn.Module:
    """The model an implementation runs (the fused one for every backend)."""
    dtype = next(inputs.fused.parameters()).dtype
    if impl == "reference":
        return _copy(inputs, case, "reference", dtype)
    if impl == "nn_transformer":
        model = copy.deepcopy(inputs.fused)
        model.transformer = _TorchStack(inputs.fused, case.sizes).to(inputs.src.device, dtype)
        return model
    return inputs.fused


def _loss(model: torch.nn.Module, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    logits = logits_of(model, src, tgt[:, :-1])
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten(), ignore_index=PAD)


def _generate(model: torch.nn.Module, src: torch.Tensor, redecoding: bool,
              cuda_graph: Optional[bool] = None) -> torch.Tensor:
    """Greedy decoding of ``src``: cached (``model.generate``, given ``cuda_graph``) or re-running the
    model on every prefix."""
    model.eval()
    if redecoding:
        return generate(RedecodingDecoder(functools.partial(logits_of, model)), src, batch_size=src.shape[0],
                        max_len=GENERATED_TOKENS + 1, bos_index=BOS, eos_index=EOS, pad_index=PAD, device=src.device)
    return model.generate(src, max_len=GENERATED_TOKENS + 1, bos_index=BOS, eos_index=EOS, cuda_graph=cuda_graph)


def _on_backend(backend: str, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``fn`` with the fused ops on ``backend``."""

    def run() -> torch.Tensor:
        with use_backend(backend):
            return fn()

    return run


def _case_groups(case: ModelCase, setting: Setting) -> list[Group]:
    backends = backends_for("attention", setting)

    @functools.cache  # made when the case's first group is measured, shared by its groups
    def inputs() -> Inputs:
        return Inputs.make(case, setting)

    @functools.cache
    def exact_model() -> torch.nn.Module:
        return _copy(inputs(), case, "reference", setting.exact_dtype)

    def backend(impl: str) -> str:
        """The backend of the fused ops an implementation calls: its own, or ours here (re-decoding;
        the reference and torch's stack call none)."""
        return impl if impl in backends.names else setting.ours

    def train_setup(impl: str) -> Impl:
        model = _model_for(impl, case, inputs()).train()
        data = inputs()
        return Impl(_on_backend(backend(impl), lambda: _loss(model, data.src, data.tgt)), list(model.parameters()))

    def greedy_setup(impl: str) -> Impl:
        model = _model_for(impl, case, inputs())
        src = inputs().src
        cuda_graph = False if impl == "eager_steps" else None
        return Impl(_on_backend(backend(impl), lambda: _generate(model, src, impl == "redecoding", cuda_graph)), [])

    def train_error(loss: torch.Tensor) -> float:
        with torch.no_grad():
            exact = _loss(exact_model().train(), inputs().src, inputs().tgt)
        return abs(loss.item() - exact.item())

    @functools.cache
    def exact_tokens() -> torch.Tensor:
        return _generate(exact_model(), inputs().src, redecoding=False)

    def greedy_error(tokens: torch.Tensor) -> float:
        exact = exact_tokens()
        width = max(tokens.shape[1], exact.shape[1])
        tokens, exact = (F.pad(t, (0, width - t.shape[1]), value=PAD) for t in (tokens, exact))
        return tokens.ne(exact).double().mean().item()

    forward_flops = _forward_flops(case)
    train_impls = [*backends.ours, "reference"] + (["nn_transformer"] if case.model == "transformer" else [])
    greedy_impls = [*backends.ours, "reference", "redecoding"] + (["eager_steps"] if setting.cuda else [])
    return [
        Group(op=OP, case=_train(case), direction="fwd+bwd",
              setups={impl: functools.partial(train_setup, impl) for impl in train_impls},
              unavailable=backends.unavailable, error=train_error,
              flops=GEMM_DIRECTION_COST["fwd+bwd"] * forward_flops, ours=backends.ours, params={"family": None}),
        Group(op=OP, case=_greedy(case), direction="fwd",
              setups={impl: functools.partial(greedy_setup, impl) for impl in greedy_impls},
              unavailable=backends.unavailable, error=greedy_error, flops=None, ours=backends.ours,
              params={"family": None}),
    ]


def _forward_flops(case: ModelCase) -> float:
    """Useful work of a forward: 2 FLOPs per weight per real token it is applied to (embeddings and
    attention's scores excluded): the encoder's weights to the source's tokens, the decoder's and the
    output projection's to the target's, but for the cross-attention's key and value projections
    (two thirds of its ``in_proj``), which read the source."""
    generator = torch.Generator().manual_seed(0)
    source, target = (float(case.tokens(generator, torch.device("cpu")).ne(PAD).sum()) for _ in "st")
    with torch.device("meta"):  # counts the weights without allocating them
        parameters = case.build("fused").named_parameters()
    flops = 0.0
    for name, parameter in parameters:
        if "embedding" in name:
            continue
        if name.startswith(("encoder.", "transformer.encoder.")):
            tokens = source
        elif ".multihead_attn.in_proj_" in name:
            tokens = (target + 2 * source) / 3
        else:
            tokens = target
        flops += 2.0 * parameter.numel() * tokens
    return flops


def groups(setting: Setting) -> list[Group]:
    return [group for case in cases(setting) for group in _case_groups(case, setting)]
