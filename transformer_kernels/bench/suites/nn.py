"""transformer_kernels.nn.MultiheadAttention against torch.nn.MultiheadAttention, module against module.

Implementations (the same parameters, ``need_weights=False`` as torch's Transformer layers and the
seeds call it):

- ``eager`` / ``triton`` / ``cuda``: ``transformer_kernels.nn.MultiheadAttention`` with that ``backend``.
- ``torch_mha``: ``torch.nn.MultiheadAttention``.

Directions: ``fwd`` is inference: both modules in ``eval()`` under ``torch.no_grad()``, where torch's
module takes its own fast path (``torch._native_multi_head_attention``) whenever it can
(self-attention); ``fwd+bwd`` is a training step's share: ``train()`` (dropout 0), forward, then the
gradients of the input(s) and of every parameter.

Cases: the seeds' configuration (batch 128, embedding 512, 8 heads, sentences of 8-40 tokens padded
to 40): the encoder's padded self-attention, the decoder's causal self-attention (a causal
``attn_mask`` with ``is_causal=True``, the seed's call), and its cross-attention to the padded
source; then long padded sequences (1k-8k tokens, lengths uniform in ``[L/4, L]``, 16k tokens per
batch, embedding 1024 in 16 heads) on CUDA, and one 1k case on the CPU.  Errors: against torch's
module in float64 (CPU) or float32 (CUDA), on the rows of real tokens.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

import transformer_kernels.nn as tknn

from . import GEMM_DIRECTION_COST, Group, Impl, Setting, Target, attended_pairs, backends_for, max_abs_error

OP = "multihead_attention"
DIRECTIONS = ("fwd", "fwd+bwd")


@dataclasses.dataclass(frozen=True)
class MhaCase:
    """One benchmarked call.  ``kind``: ``"self"`` (key padding), ``"causal"`` (self-attention with a
    causal mask and the ``is_causal`` hint, no padding) or ``"cross"`` (queries of length ``length``
    attending to a padded memory of the same length).  Lengths are uniform in ``[min_length, length]``
    (fixed seed), every sequence padded to ``length``."""

    name: str
    batch: int
    length: int
    min_length: int
    embed_dim: int
    heads: int
    kind: str

    def padding(self, device: torch.device) -> torch.Tensor:
        """bool ``[batch, length]``, True = padding."""
        generator = torch.Generator().manual_seed(0)
        lengths = torch.randint(self.min_length, self.length + 1, (self.batch,), generator=generator)
        return (torch.arange(self.length) >= lengths[:, None]).to(device)

    @property
    def padded(self) -> bool:
        return self.kind in ("self", "cross")


SEED_CASES = [MhaCase(f"seeds_B128_L8-40_{kind}", 128, 40, 8, 512, 8, kind) for kind in ("self", "causal", "cross")]
GPU_LONG_CASES = (
    [MhaCase(f"long_B{16384 // length}_L{length}_self", 16384 // length, length, length // 4, 1024, 16, "self")
     for length in (1024, 2048, 4096, 8192)]
    + [MhaCase(f"long_B{16384 // length}_L{length}_cross", 16384 // length, length, length // 4, 1024, 16, "cross")
       for length in (2048, 8192)]
)
CPU_LONG_CASES = [MhaCase("long_B2_L1024_self", 2, 1024, 256, 1024, 16, "self")]

TARGETS = (
    # CPU: the module is at least as fast as torch's on the seeds' padded batches ...
    [Target(OP, case.name, direction, "eager", "torch_mha", 1.0, "cpu")
     for case in SEED_CASES + CPU_LONG_CASES if case.padded for direction in DIRECTIONS]
    # ... and 1.5x torch's on every padded batch on the GPU.
    + [Target(OP, case.name, direction, "triton", "torch_mha", 1.5, "cuda")
       for case in SEED_CASES + GPU_LONG_CASES if case.padded for direction in DIRECTIONS]
)


def cases(setting: Setting) -> list[MhaCase]:
    if setting.size == "tiny":
        return [MhaCase(f"tiny_B2_L8_{kind}", 2, 8, 3, 16, 2, kind) for kind in ("self", "causal")]
    if setting.cuda:
        return SEED_CASES + GPU_LONG_CASES
    if setting.size == "quick":
        return [case for case in SEED_CASES if case.padded]  # the ones with targets
    return SEED_CASES + CPU_LONG_CASES


@dataclasses.dataclass
class Inputs:
    """Leaves ``x`` (and ``memory`` for cross-attention) ``[B, L, E]``, the forward's positional and
    keyword arguments, and torch's module every implementation copies its parameters from."""

    leaves: list[torch.Tensor]
    args: tuple
    kwargs: dict
    torch_mha: torch.nn.MultiheadAttention

    @classmethod
    def make(cls, case: MhaCase, setting: Setting) -> "Inputs":
        generator = torch.Generator().manual_seed(0)

        def sequence():
            x = torch.randn(case.batch, case.length, case.embed_dim, generator=generator)
            return x.to(setting.device, setting.dtype).requires_grad_()

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            module = torch.nn.MultiheadAttention(case.embed_dim, case.heads, batch_first=True)
        module = module.to(setting.device, setting.dtype)
        x = sequence()
        if case.kind == "self":
            return cls([x], (x, x, x), {"key_padding_mask": case.padding(setting.device)}, module)
        if case.kind == "causal":
            not_after = torch.ones(case.length, case.length, dtype=torch.bool, device=setting.device).triu(1)
            return cls([x], (x, x, x), {"attn_mask": not_after, "is_causal": True}, module)
        memory = sequence()
        return cls([x, memory], (x, memory, memory), {"key_padding_mask": case.padding(setting.device)}, module)


def _module(case: MhaCase, impl: str, inputs: Inputs, dtype: torch.dtype) -> torch.nn.MultiheadAttention:
    if impl == "torch_mha":
        module = inputs.torch_mha
    else:
        module = tknn.MultiheadAttention(case.embed_dim, case.heads, batch_first=True, backend=impl,
                                         device=inputs.leaves[0].device, dtype=dtype)
        module.load_state_dict(inputs.torch_mha.state_dict())
    return module


def _impl(case: MhaCase, impl: str, inputs: Inputs, direction: str) -> Impl:
    module = _module(case, impl, inputs, inputs.leaves[0].dtype)
    module.train(direction != "fwd")
    return Impl(lambda: module(*inputs.args, **inputs.kwargs, need_weights=False)[0],
                [*inputs.leaves, *module.parameters()])


def _exact(case: MhaCase, inputs: Inputs, dtype: torch.dtype) -> torch.Tensor:
    module = inputs.torch_mha
    exact = torch.nn.MultiheadAttention(case.embed_dim, case.heads, batch_first=True, device=inputs.leaves[0].device,
                                        dtype=dtype).eval()
    exact.load_state_dict({name: t.to(dtype) for name, t in module.state_dict().items()})
    with torch.no_grad():
        args = [t.detach().to(dtype) for t in inputs.args]
        return exact(*args, **inputs.kwargs, need_weights=False)[0]


def _forward_flops(case: MhaCase) -> float:
    """Useful work: each projection 2·E² per real token it reads (the query and output projections
    the queries', the key and value projections the keys'), and attention's two matmuls 2·E per
    (real query, key it sees) pair; a padded self-attention's padding rows and keys count nothing."""
    lengths = case.batch * [float(case.length)]
    if case.padded:
        lengths = (~case.padding(torch.device("cpu"))).sum(1).double().tolist()
    keys = sum(lengths)
    queries = keys if case.kind == "self" else case.batch * case.length
    pairs = case.length * keys if case.kind == "cross" else attended_pairs(lengths, case.kind == "causal")
    return 4 * case.embed_dim**2 * (queries + keys) + 4 * case.embed_dim * pairs


def _case_groups(case: MhaCase, setting: Setting) -> list[Group]:
    """The case's group per direction."""
    backends = backends_for("attention", setting)

    @functools.cache  # made when the case's first group is measured, shared by its directions and implementations
    def inputs() -> Inputs:
        return Inputs.make(case, setting)

    @functools.cache
    def exact() -> torch.Tensor:
        return _exact(case, inputs(), setting.exact_dtype)

    def error(outputs) -> float:
        rows = None
        if case.padded and case.kind == "self":
            rows = ~case.padding(setting.device)[:, :, None]
        return max_abs_error(outputs, exact(), rows)

    def setup(impl: str, direction: str) -> Impl:
        return _impl(case, impl, inputs(), direction)

    forward = _forward_flops(case)
    return [Group(
        op=OP, case=case.name, direction=direction,
        setups={impl: functools.partial(setup, impl, direction) for impl in [*backends.ours, "torch_mha"]},
        unavailable=backends.unavailable, error=error, flops=forward * GEMM_DIRECTION_COST[direction],
        ours=backends.ours,
        params={"length": case.length, "family": None}, reference="torch_mha",
    ) for direction in DIRECTIONS if direction in setting.directions]


def groups(setting: Setting) -> list[Group]:
    return [group for case in cases(setting) for group in _case_groups(case, setting)]
