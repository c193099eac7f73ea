"""transformer_kernels.nn.MultiheadAttention against torch.nn.MultiheadAttention, module against module.

Implementations (the same parameters, ``need_weights=False`` as torch's Transformer layers and the
seeds call it):

- ``eager`` (CPU) / ``triton`` (CUDA): ``transformer_kernels.nn.MultiheadAttention`` with that
  ``backend``.
- ``torch_mha``: ``torch.nn.MultiheadAttention``.

Directions: ``fwd`` is inference: both modules in ``eval()`` under ``torch.no_grad()``, where torch's
module takes its own fast path (``torch._native_multi_head_attention``) whenever it can
(self-attention); ``fwd+bwd`` is a training step's share: ``train()`` (dropout 0), forward, then the
gradients of the input(s) and of every parameter.

Cases: the seeds' configuration (batch 128, embedding 512, 8 heads, sentences of 8-40 tokens padded
to 40): the encoder's padded self-attention, the decoder's causal self-attention (a causal
``attn_mask`` with ``is_causal=True``, the seed's call), and its cross-attention to the padded
source; then long padded sequences (1k-8k tokens, lengths uniform in ``[L/4, L]``, 16k tokens per
batch, embedding 1024 in 16 heads) on CUDA, and one 1k case on the CPU.  CPU runs float32, CUDA
bfloat16.  Each (case, direction) is one group whose implementations are timed interleaved
(``benchmarks/interleaved.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import pytest
import torch
from conftest import DEVICE, timed_call

import transformer_kernels.nn as tknn

OP = "multihead_attention"
CUDA = DEVICE.type == "cuda"
DTYPE = torch.bfloat16 if CUDA else torch.float32
OURS = "triton" if CUDA else "eager"
IMPLS = [OURS, "torch_mha"]
DIRECTIONS = ["fwd", "fwd+bwd"]


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
    devices: tuple[str, ...]

    def padding(self, device: torch.device) -> torch.Tensor:
        """bool ``[batch, length]``, True = padding."""
        generator = torch.Generator().manual_seed(0)
        lengths = torch.randint(self.min_length, self.length + 1, (self.batch,), generator=generator)
        return (torch.arange(self.length) >= lengths[:, None]).to(device)


def _seed_cases() -> list[MhaCase]:
    return [MhaCase(f"seeds_B128_L8-40_{kind}", 128, 40, 8, 512, 8, kind, ("cpu", "cuda"))
            for kind in ("self", "causal", "cross")]


def _long_cases() -> list[MhaCase]:
    cases = [MhaCase(f"long_B{16384 // length}_L{length}_self", 16384 // length, length, length // 4, 1024, 16,
                     "self", ("cuda",)) for length in (1024, 2048, 4096, 8192)]
    cases += [MhaCase(f"long_B{16384 // length}_L{length}_cross", 16384 // length, length, length // 4, 1024, 16,
                      "cross", ("cuda",)) for length in (2048, 8192)]
    cases.append(MhaCase("long_B2_L1024_self", 2, 1024, 256, 1024, 16, "self", ("cpu",)))
    return cases


ALL_CASES = _seed_cases() + _long_cases()
CASES = [case for case in ALL_CASES if DEVICE.type in case.devices]

_PADDED = [case for case in ALL_CASES if case.kind in ("self", "cross")]
TARGETS = (
    # CPU: the module is at least as fast as torch's on the seeds' padded batches ...
    [
        {"op": OP, "case": case.name, "direction": direction, "impl": "eager", "baseline": "torch_mha",
         "min_speedup": 1.0, "device": "cpu"}
        for case in _PADDED if "cpu" in case.devices
        for direction in DIRECTIONS
    ]
    # ... and 1.5x torch's on every padded batch on the GPU.
    + [
        {"op": OP, "case": case.name, "direction": direction, "impl": "triton", "baseline": "torch_mha",
         "min_speedup": 1.5, "device": "cuda"}
        for case in _PADDED if "cuda" in case.devices
        for direction in DIRECTIONS
    ]
)


def make_module(case: MhaCase, impl: str, reference: torch.nn.MultiheadAttention) -> torch.nn.MultiheadAttention:
    if impl == "torch_mha":
        return reference
    ours = tknn.MultiheadAttention(case.embed_dim, case.heads, batch_first=True, device=DEVICE, dtype=DTYPE,
                                   backend=impl)
    ours.load_state_dict(reference.state_dict())
    return ours


def make_inputs(case: MhaCase) -> dict:
    """Leaves ``x`` (and ``memory`` for cross-attention) ``[B, L, E]`` and the forward's keyword arguments."""
    def sequence():
        return torch.randn(case.batch, case.length, case.embed_dim, device=DEVICE, dtype=DTYPE, requires_grad=True)

    x = sequence()
    if case.kind == "self":
        return {"leaves": [x], "args": (x, x, x), "kwargs": {"key_padding_mask": case.padding(DEVICE)}}
    if case.kind == "causal":
        not_after = torch.ones(case.length, case.length, dtype=torch.bool, device=DEVICE).triu(1)
        return {"leaves": [x], "args": (x, x, x), "kwargs": {"attn_mask": not_after, "is_causal": True}}
    memory = sequence()
    return {"leaves": [x, memory], "args": (x, memory, memory), "kwargs": {"key_padding_mask": case.padding(DEVICE)}}


def make_forward(module: torch.nn.MultiheadAttention, direction: str, inputs: dict) -> Callable[[], torch.Tensor]:
    module.train(direction != "fwd")
    return lambda: module(*inputs["args"], **inputs["kwargs"], need_weights=False)[0]


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_multihead_attention(compare, case, direction):
    torch.manual_seed(0)
    reference = torch.nn.MultiheadAttention(case.embed_dim, case.heads, batch_first=True, device=DEVICE, dtype=DTYPE)
    inputs = make_inputs(case)
    factories = {}
    for impl in IMPLS:
        module = make_module(case, impl, reference)
        leaves = inputs["leaves"] + list(module.parameters())
        factories[impl] = functools.partial(timed_call, functools.partial(make_forward, module, direction, inputs),
                                            direction, leaves)
    compare(factories, op=OP, case=case.name, direction=direction, ours=OURS)
