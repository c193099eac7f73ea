"""Masked scaled-dot-product attention against torch SDPA (each backend),
FlexAttention and the seeds' naive math.

Implementations:

- ``eager`` (CPU) / ``triton`` (CUDA): ``transformer_kernels.scaled_dot_product_attention``
  with ``key_padding_mask`` / ``is_causal``.
- ``torch_sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with
  torch's own backend choice; padded cases get the equivalent dense bool mask
  ``[B, 1, Lq, Lk]`` (padding and causality folded in), as a torch user would
  write it.  On CUDA also each SDPA backend forced through
  ``torch.nn.attention.sdpa_kernel``: ``torch_sdpa_flash`` (no masks, so dense
  cases only), ``torch_sdpa_efficient``, ``torch_sdpa_cudnn``,
  ``torch_sdpa_math`` (short sequences only: it materializes the scores).
- ``flex_attention`` (CUDA): ``torch.compile``-d FlexAttention with a block mask
  built from the same padding/causal rule (outside the timing).
- ``reference``: the seeds' naive math (scores, ``masked_fill(-1e9)``, softmax,
  matmul); short sequences only on CUDA.

Inputs are ``[B, L, H, D]`` tensors viewed as ``[B, H, L, D]`` (what a fused
projection produces).  Directions: ``fwd`` (no autograd), ``bwd`` (gradients
of a stored forward), ``fwd+bwd``.  CPU runs fp32, CUDA bf16.  Each (case,
direction) is one group whose implementations are timed interleaved
(``benchmarks/interleaved.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, timed_call

import transformer_kernels as tk
from transformer_kernels.reference import attention as reference_attention

OP = "attention"
CUDA = DEVICE.type == "cuda"
DTYPE = torch.bfloat16 if CUDA else torch.float32
OURS = "triton" if CUDA else "eager"


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """One benchmarked shape.  ``padded``: key padding with lengths uniform in
    ``[L/4, L]`` (suffix padding, fixed seed); ``causal``: top-left causal."""

    name: str
    batch: int
    heads: int
    length: int
    head_dim: int
    causal: bool
    padded: bool
    devices: tuple[str, ...]
    flex: bool = False  # FlexAttention compiles per shape: only a few cases

    def lengths(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)
        return torch.randint(self.length // 4, self.length + 1, (self.batch,), generator=generator)


def _seed_cases() -> list[AttentionCase]:
    # The seeds: batch 128, embedding 512 split into 8 heads of 64, sentences of 16-64 tokens padded.
    return [
        AttentionCase("seeds_B128_L16_padded", 128, 8, 16, 64, False, True, ("cpu", "cuda")),
        AttentionCase("seeds_B128_L64_padded", 128, 8, 64, 64, False, True, ("cpu", "cuda")),
        AttentionCase("seeds_B128_L64_causal_padded", 128, 8, 64, 64, True, True, ("cpu", "cuda")),
    ]


def _cpu_target_cases() -> list[AttentionCase]:
    return [
        AttentionCase("causal_B8_H8_L512_D64", 8, 8, 512, 64, True, False, ("cpu",)),
        AttentionCase("padded_causal_B16_H8_L512_D64", 16, 8, 512, 64, True, True, ("cpu",)),
    ]


def _long_cases() -> list[AttentionCase]:
    # 16k tokens per batch, 2048 model width: heads = 2048 / head_dim.
    cases = []
    for head_dim, lengths in ((64, (1024, 2048, 16384)), (128, (2048, 8192))):
        for length in lengths:
            for causal in (False, True):
                kind = "causal" if causal else "dense"
                cases.append(AttentionCase(
                    f"{kind}_B{16384 // length}_L{length}_D{head_dim}", 16384 // length, 2048 // head_dim,
                    length, head_dim, causal, False, ("cuda",), flex=causal and (head_dim, length) == (64, 2048),
                ))
    for length in (2048, 8192):
        for causal in (False, True):
            kind = "padded_causal" if causal else "padded"
            cases.append(AttentionCase(
                f"{kind}_B{16384 // length}_L{length}_D64", 16384 // length, 32, length, 64, causal, True,
                ("cuda",), flex=causal and length == 2048,
            ))
    return cases


ALL_CASES = _seed_cases() + _cpu_target_cases() + _long_cases()
CASES = [case for case in ALL_CASES if DEVICE.type in case.devices]

SDPA_BACKENDS = {"torch_sdpa_flash": "FLASH_ATTENTION", "torch_sdpa_efficient": "EFFICIENT_ATTENTION",
                 "torch_sdpa_cudnn": "CUDNN_ATTENTION", "torch_sdpa_math": "MATH"}
IMPLS = [OURS, "torch_sdpa", *SDPA_BACKENDS, "flex_attention", "reference"] if CUDA else [OURS, "torch_sdpa", "reference"]
DIRECTIONS = ["fwd", "bwd", "fwd+bwd"]
# Materializing [B, H, L, L] scores: only up to this length on CUDA.
MATERIALIZED_MAX_LENGTH = 2048

_CPU_CASE_NAMES = [case.name for case in ALL_CASES if "cpu" in case.devices]
_GPU_LONG = [case for case in ALL_CASES if "cuda" in case.devices and case.length >= 1024]
_GPU_DENSE = [case.name for case in _GPU_LONG if not case.padded]
_GPU_PADDED = [case.name for case in _GPU_LONG if case.padded]

TARGETS = (
    # CPU: the eager path beats the naive reference everywhere ...
    [
        {"op": OP, "case": name, "direction": direction, "impl": "eager", "baseline": "reference",
         "min_speedup": 1.0, "device": "cpu"}
        for name in _CPU_CASE_NAMES
        for direction in DIRECTIONS
    ]
    # ... by 3x on the causal forward, and does not pay for padding (1.5x SDPA given the dense mask).
    + [
        {"op": OP, "case": "causal_B8_H8_L512_D64", "direction": "fwd", "impl": "eager", "baseline": "reference",
         "min_speedup": 3.0, "device": "cpu"},
    ]
    + [
        {"op": OP, "case": "padded_causal_B16_H8_L512_D64", "direction": direction, "impl": "eager",
         "baseline": "torch_sdpa", "min_speedup": 1.5, "device": "cpu"}
        for direction in ("fwd", "fwd+bwd")
    ]
    # GPU (H100, bf16): forward+backward at least as fast as every SDPA backend on dense shapes ...
    + [
        {"op": OP, "case": name, "direction": "fwd+bwd", "impl": "triton", "baseline": baseline,
         "min_speedup": 1.0, "device": "cuda"}
        for name in _GPU_DENSE
        for baseline in ("torch_sdpa", "torch_sdpa_flash", "torch_sdpa_efficient", "torch_sdpa_cudnn")
    ]
    # ... 2x SDPA given the dense mask on padded batches ...
    + [
        {"op": OP, "case": name, "direction": "fwd+bwd", "impl": "triton", "baseline": "torch_sdpa",
         "min_speedup": 2.0, "device": "cuda"}
        for name in _GPU_PADDED
    ]
    # ... and 20x the naive reference at L = 2048.
    + [
        {"op": OP, "case": name, "direction": "fwd+bwd", "impl": "triton", "baseline": "reference",
         "min_speedup": 20.0, "device": "cuda"}
        for name in [case.name for case in _GPU_LONG if case.length == 2048]
    ]
)


# ----------------------------------------------------------------------------
# Inputs and implementations
# ----------------------------------------------------------------------------


def make_inputs(case: AttentionCase, device: torch.device, dtype: torch.dtype) -> dict:
    """Leaves ``[B, L, H, D]`` (requiring grad), their ``[B, H, L, D]`` views, the padding mask
    (True = padding) and the equivalent dense bool mask (True = attend) when padded."""
    shape = (case.batch, case.length, case.heads, case.head_dim)
    leaves = [torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]
    inputs = {"leaves": leaves, "qkv": [t.transpose(1, 2) for t in leaves], "padding": None, "dense_mask": None}
    if case.padded:
        lengths = case.lengths().to(device)
        positions = torch.arange(case.length, device=device)
        padding = positions[None, :] >= lengths[:, None]
        dense = (~padding)[:, None, None, :].expand(case.batch, 1, case.length, case.length)
        if case.causal:
            dense = dense & torch.ones(case.length, case.length, dtype=torch.bool, device=device).tril()
        inputs.update(padding=padding, lengths=lengths, dense_mask=dense.contiguous())
    return inputs


@functools.lru_cache(maxsize=None)
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex_block_mask(case: AttentionCase, inputs: dict):
    from torch.nn.attention.flex_attention import create_block_mask

    lengths = inputs.get("lengths")

    def mask_mod(b, h, q_idx, kv_idx):
        keep = kv_idx >= 0
        if case.causal:
            keep = keep & (kv_idx <= q_idx)
        if lengths is not None:
            keep = keep & (kv_idx < lengths[b])
        return keep

    batch = case.batch if lengths is not None else None
    return create_block_mask(mask_mod, batch, None, case.length, case.length, device=str(DEVICE))


def skip_reason(case: AttentionCase, impl: str) -> Optional[str]:
    if impl == "torch_sdpa_flash" and case.padded:
        return "SDPA's flash backend takes no mask"
    if impl == "flex_attention" and not case.flex:
        return "FlexAttention compiles per shape: only the cases marked flex"
    if impl in ("torch_sdpa_math", "reference") and CUDA and case.length > MATERIALIZED_MAX_LENGTH:
        return f"materializes [B, H, L, L] scores: only L <= {MATERIALIZED_MAX_LENGTH}"
    return None


def make_forward(case: AttentionCase, impl: str, inputs: dict) -> Callable[[], torch.Tensor]:
    q, k, v = inputs["qkv"]
    padding, dense_mask = inputs["padding"], inputs["dense_mask"]
    if impl in ("eager", "triton"):
        return lambda: tk.scaled_dot_product_attention(
            q, k, v, is_causal=case.causal, key_padding_mask=padding, backend=impl
        )
    if impl == "reference":
        return lambda: reference_attention(q, k, v, is_causal=case.causal, key_padding_mask=padding)
    if impl == "flex_attention":
        block_mask = _flex_block_mask(case, inputs)
        flex = _compiled_flex_attention()
        return lambda: flex(q, k, v, block_mask=block_mask)
    if dense_mask is not None:
        sdpa_kwargs = {"attn_mask": dense_mask}
    else:
        sdpa_kwargs = {"is_causal": case.causal}
    if impl == "torch_sdpa":
        return lambda: F.scaled_dot_product_attention(q, k, v, **sdpa_kwargs)

    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, SDPA_BACKENDS[impl])

    def forced():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, **sdpa_kwargs)

    return forced


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_attention(compare, case, direction):
    inputs = make_inputs(case, DEVICE, DTYPE)
    skipped = {impl: skip_reason(case, impl) for impl in IMPLS if skip_reason(case, impl)}
    factories = {
        impl: functools.partial(timed_call, functools.partial(make_forward, case, impl, inputs), direction,
                                inputs["leaves"])
        for impl in IMPLS if impl not in skipped
    }
    compare(factories, op=OP, case=case.name, direction=direction, ours=OURS, skipped=skipped)
