"""Fused QKV projection vs the seeds' three linears, nn.MultiheadAttention's packed linear + chunk,
and a bare ``torch.matmul`` of the same GEMM.

Implementations:

- ``eager`` / ``triton`` / ``cuda``: ``transformer_kernels.qkv_projection`` on that backend.
- ``reference``: the seeds' path, three ``nn.Linear``-style weights (separate leaf tensors), each
  ``F.linear`` + ``view`` + ``transpose`` + ``contiguous``.
- ``mha_packed``: ``F.linear`` with the packed weight, ``chunk(3)``, ``view`` + ``transpose`` (no copy).
- ``torch_matmul``: ``torch.matmul(x, weight.t())`` on ``[T, E]``, the same GEMM without bias or head
  split: the speed of light (no error column: its output is not the projection's).

Directions: ``fwd``, ``bwd`` and ``fwd+bwd`` (gradients for x, weights and biases from one
``[B, H, L, Dh]`` gradient per output, as attention's backward returns them).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

import transformer_kernels as tk
from transformer_kernels.reference import qkv_projection as reference_qkv

from . import DIRECTIONS, GEMM_DIRECTION_COST, Group, Impl, Setting, Target, backends_for, max_abs_error

OP = "qkv_projection"
PEERS = ("mha_packed", "torch_matmul")


@dataclasses.dataclass(frozen=True)
class QkvCase:
    name: str
    batch: int
    length: int
    embed_dim: int
    heads: int
    family: str = ""


# Seeds: batch 128, lengths 16-64, E = 512, 8 heads.  Large: 4k-64k tokens, E 512-4096 (head dim 64 or 128).
SEED_CASES = [QkvCase(f"seeds_B128_L{length}_E512", 128, length, 512, 8, "seeds_B128_E512") for length in (16, 32, 64)]
LARGE_CASES = [QkvCase("tok4k_E1024", 4, 1024, 1024, 16), QkvCase("tok16k_E2048", 8, 2048, 2048, 16),
               QkvCase("tok64k_E512", 32, 2048, 512, 8), QkvCase("tok64k_E4096", 16, 4096, 4096, 32)]
CPU_CASES = [SEED_CASES[0], SEED_CASES[2], LARGE_CASES[0]]

TARGETS = (
    [Target(OP, case.name, direction, "eager", "reference", 1.0, "cpu") for case in CPU_CASES for direction in DIRECTIONS]
    + [Target(OP, case.name, "fwd", impl, "torch_matmul", 0.9, "cuda")
       for impl in ("triton", "cuda") for case in SEED_CASES + LARGE_CASES]
    + [Target(OP, case.name, "fwd+bwd", impl, "reference", 1.3, "cuda")
       for impl in ("triton", "cuda") for case in SEED_CASES + LARGE_CASES]
)


def cases(setting: Setting) -> list[QkvCase]:
    if setting.size == "tiny":
        return [QkvCase(f"tiny_B2_L{length}_E32", 2, length, 32, 4, "tiny_B2_E32") for length in (8, 16)]
    if setting.cuda:
        return SEED_CASES + LARGE_CASES
    if setting.size == "quick":
        return SEED_CASES
    return CPU_CASES


def directions(case: QkvCase, setting: Setting) -> tuple[str, ...]:
    if setting.size == "quick" and case is not SEED_CASES[0]:
        return ("fwd",)  # the length plot's points
    return setting.directions


@dataclasses.dataclass
class Inputs:
    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor

    @classmethod
    def make(cls, case: QkvCase, setting: Setting) -> "Inputs":
        generator = torch.Generator().manual_seed(0)
        e = case.embed_dim
        x = torch.randn(case.batch, case.length, e, generator=generator)
        weight = torch.randn(3 * e, e, generator=generator) / e**0.5
        bias = torch.randn(3 * e, generator=generator)
        return cls(*(t.to(setting.device, setting.dtype).requires_grad_() for t in (x, weight, bias)))


def _impl(case: QkvCase, impl: str, inputs: Inputs) -> Impl:
    x, weight, bias = inputs.x, inputs.weight, inputs.bias
    head_dim = case.embed_dim // case.heads

    def head_split(y):
        return y.view(case.batch, case.length, case.heads, head_dim).transpose(1, 2)

    if impl == "reference":
        # The seeds train three weights: separate leaves.
        weights = [w.detach().clone().requires_grad_() for w in weight.chunk(3)]
        biases = [b.detach().clone().requires_grad_() for b in bias.chunk(3)]
        return Impl(lambda: tuple(head_split(F.linear(x, w, b)).contiguous() for w, b in zip(weights, biases)),
                    (x, *weights, *biases))
    if impl == "mha_packed":
        return Impl(lambda: tuple(head_split(y) for y in F.linear(x, weight, bias).chunk(3, dim=-1)), (x, weight, bias))
    if impl == "torch_matmul":
        x2d = x.detach().view(-1, case.embed_dim).requires_grad_()
        return Impl(lambda: (torch.matmul(x2d, weight.t()),), (x2d, weight), comparable=False)
    return Impl(lambda: tk.qkv_projection(x, weight, bias, num_heads=case.heads, backend=impl), (x, weight, bias))


def _case_groups(case: QkvCase, setting: Setting) -> list[Group]:
    """The case's group per direction."""
    backends = backends_for("qkv", setting)

    @functools.cache  # made when the case's first group is measured, shared by its directions and implementations
    def inputs() -> Inputs:
        return Inputs.make(case, setting)

    @functools.cache
    def exact() -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            tensors = (inputs().x, inputs().weight, inputs().bias)
            return reference_qkv(*(t.detach().to(setting.exact_dtype) for t in tensors), case.heads)

    def setup(impl: str) -> Impl:
        return _impl(case, impl, inputs())

    forward = 2 * case.batch * case.length * case.embed_dim * 3 * case.embed_dim
    return [Group(
        op=OP, case=case.name, direction=direction,
        setups={impl: functools.partial(setup, impl) for impl in [*backends.ours, "reference", *PEERS]},
        unavailable=backends.unavailable, error=lambda outputs: max_abs_error(outputs, exact()),
        flops=forward * GEMM_DIRECTION_COST[direction], ours=backends.ours,
        params={"length": case.length, "family": case.family or None},
    ) for direction in directions(case, setting)]


def groups(setting: Setting) -> list[Group]:
    return [group for case in cases(setting) for group in _case_groups(case, setting)]
