"""Masked scaled-dot-product attention against the seeds' naive math and torch's attention paths.

Implementations:

- ``eager`` / ``triton`` / ``cuda``: ``transformer_kernels.scaled_dot_product_attention`` with
  ``key_padding_mask`` / ``is_causal`` on that backend (the ones this device has).
- ``reference``: the seeds' naive math (scores, ``masked_fill(-1e9)``, softmax, matmul);
  short sequences only on CUDA.
- ``torch_sdpa``: ``F.scaled_dot_product_attention`` with torch's own backend choice; padded cases
  get the equivalent dense bool mask ``[B, 1, Lq, Lk]`` (padding and causality folded in), as a
  torch user writes it.  ``torch_sdpa_<backend>``: the same forced onto each SDPA backend
  (``sdpa_kernel``): math (short sequences only on CUDA), flash (no masks: dense cases only),
  efficient, cudnn.
- ``flex_attention``: ``torch.compile``-d FlexAttention with a BlockMask built from the same
  padding/causal rule (outside the timing); it compiles per shape, so only cases marked ``flex``.
- ``sdpa_jagged`` (padded cases): SDPA on nested tensors of ``layout=torch.jagged``, the packing
  from and unpacking to the padded layout counted in.
- ``varlen_attn`` (padded cases, CUDA): ``torch.nn.attention.varlen.varlen_attn`` on packed
  ``cu_seqlens`` inputs, packing and unpacking counted in.
- ``flash_attn``: ``flash_attn_func`` (``flash_attn_varlen_func`` with packing for padded cases),
  when flash-attn is installed.

Inputs are ``[B, L, H, D]`` tensors viewed as ``[B, H, L, D]`` (what a fused projection
produces), and every implementation is timed up to the merged context ``[B, L, H * D]`` that the
output projection takes: both seed transformers merge the heads right after the attention
(``context.transpose(1, 2).contiguous().view(B, L, H * D)``).  The merge is free where an
output is laid out ``[B, L, H, D]`` (ours, torch's CPU flash SDPA, the packed paths), a copy
where it is ``[B, H, L, D]``-contiguous (the naive math, SDPA's math backend); and the gradient
each backward is given, laid out like its merged context, is ``[B, L, H, D]`` memory for every
one of them, as the output projection's backward hands it over.  Errors are measured on the rows
of real (not padded) tokens, against torch's SDPA in float64 (CPU: its math backend) or float32
(CUDA: no [B, H, L, L] scores at long lengths).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import transformer_kernels as tk
from transformer_kernels.reference import attention as reference_attention

from . import DIRECTIONS, Group, Impl, Setting, Target, attended_pairs, backends_for, max_abs_error

OP = "attention"
SDPA_BACKENDS = {"torch_sdpa_math": "MATH", "torch_sdpa_flash": "FLASH_ATTENTION",
                 "torch_sdpa_efficient": "EFFICIENT_ATTENTION", "torch_sdpa_cudnn": "CUDNN_ATTENTION"}
PEERS = ("torch_sdpa", *SDPA_BACKENDS, "flex_attention", "sdpa_jagged", "varlen_attn", "flash_attn")
# Materializing [B, H, L, L] scores: only up to this length on CUDA.
MATERIALIZED_MAX_LENGTH = 2048


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """One benchmarked shape.  ``padded``: key padding with lengths uniform in ``[L/4, L]`` (suffix
    padding, fixed seed), or, when ``padding`` is given, that fraction of every sequence padded;
    ``causal``: top-left causal.  ``family`` groups the cases a plot draws as one line."""

    name: str
    batch: int
    heads: int
    length: int
    head_dim: int
    causal: bool
    padded: bool
    padding: Optional[float] = None
    flex: bool = False  # FlexAttention compiles per shape: only a few cases
    family: Optional[str] = None

    def lengths(self) -> torch.Tensor:
        if self.padding is not None:
            return torch.full((self.batch,), max(1, round(self.length * (1 - self.padding))))
        generator = torch.Generator().manual_seed(0)
        return torch.randint(self.length // 4, self.length + 1, (self.batch,), generator=generator)

    def padded_fraction(self) -> float:
        return 1.0 - self.lengths().float().mean().item() / self.length if self.padded else 0.0


def _seed_cases() -> list[AttentionCase]:
    # The seeds: batch 128, embedding 512 split into 8 heads of 64, sentences of 16-64 tokens padded.
    return [
        AttentionCase("seeds_B128_L16_padded", 128, 8, 16, 64, False, True, family="seeds_padded"),
        AttentionCase("seeds_B128_L64_padded", 128, 8, 64, 64, False, True, family="seeds_padded"),
        AttentionCase("seeds_B128_L64_causal_padded", 128, 8, 64, 64, True, True),
    ]


CPU_TARGET_CASES = [
    AttentionCase("causal_B8_H8_L512_D64", 8, 8, 512, 64, True, False),
    AttentionCase("padded_causal_B16_H8_L512_D64", 16, 8, 512, 64, True, True),
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
                    length, head_dim, causal, False, flex=causal and (head_dim, length) == (64, 2048),
                    family=f"{kind}_16k_tokens_D{head_dim}",
                ))
    for length in (2048, 8192):
        for causal in (False, True):
            kind = "padded_causal" if causal else "padded"
            cases.append(AttentionCase(
                f"{kind}_B{16384 // length}_L{length}_D64", 16384 // length, 32, length, 64, causal, True,
                flex=causal and length == 2048, family=f"{kind}_16k_tokens_D64",
            ))
    return cases


def _padding_sweep(batch: int, heads: int, length: int, fractions: tuple[float, ...],
                   head_dim: int = 64) -> list[AttentionCase]:
    """Every sequence padded by the same fraction: the speed-up vs padding fraction plot."""
    return [
        AttentionCase(f"padfrac{round(100 * p)}_B{batch}_H{heads}_L{length}_D{head_dim}", batch, heads, length,
                      head_dim, False, True, padding=p, family=f"sweep_padding_B{batch}_L{length}_D{head_dim}")
        for p in fractions
    ]


def _length_sweep(tokens: int, heads: int, lengths: tuple[int, ...], head_dim: int = 64) -> list[AttentionCase]:
    """Padded causal batches of ``tokens`` tokens: the time and memory vs sequence length plots."""
    return [
        AttentionCase(f"padded_causal_B{tokens // length}_H{heads}_L{length}_D{head_dim}", tokens // length, heads,
                      length, head_dim, True, True, family=f"sweep_length_padded_causal_{tokens}_tokens_D{head_dim}")
        for length in lengths
    ]


def cases(setting: Setting) -> list[AttentionCase]:
    if setting.size == "tiny":
        return [
            AttentionCase("tiny_causal_B2_H2_L16_D8", 2, 2, 16, 8, True, False),
            *_length_sweep(64, 2, (16, 32), head_dim=8),
            *_padding_sweep(2, 2, 16, (0.0, 0.5), head_dim=8),
        ]
    if setting.cuda:
        sweep = _padding_sweep(16, 16, 2048, (0.0, 0.25, 0.5, 0.75))
        return _seed_cases() + _long_cases() + (sweep if setting.size == "full" else sweep[::3])
    if setting.size == "quick":
        return [_seed_cases()[0], *CPU_TARGET_CASES, *_length_sweep(2048, 8, (128, 256)),
                *_padding_sweep(8, 8, 256, (0.0, 0.5, 0.75))]
    return (_seed_cases() + CPU_TARGET_CASES + _length_sweep(4096, 8, (128, 256, 512))
            + _padding_sweep(8, 8, 512, (0.0, 0.25, 0.5, 0.75)))


def directions(case: AttentionCase, setting: Setting) -> tuple[str, ...]:
    # A quick run times the sweeps forward only: their plots need one direction.
    if setting.size == "quick" and case.family is not None and case.family.startswith("sweep_"):
        return ("fwd",)
    return setting.directions


_SEED_NAMES = [case.name for case in _seed_cases()]
_GPU_LONG = [case for case in _long_cases() if case.length >= 1024]
TARGETS = (
    # CPU: the eager path beats the naive reference everywhere ...
    [Target(OP, name, direction, "eager", "reference", 1.0, "cpu")
     for name in _SEED_NAMES + [case.name for case in CPU_TARGET_CASES] for direction in DIRECTIONS]
    # ... by 3x on the causal forward, and does not pay for padding (1.5x SDPA given the dense mask).
    + [Target(OP, "causal_B8_H8_L512_D64", "fwd", "eager", "reference", 3.0, "cpu")]
    + [Target(OP, "padded_causal_B16_H8_L512_D64", direction, "eager", "torch_sdpa", 1.5, "cpu")
       for direction in ("fwd", "fwd+bwd")]
    # GPU (H100, bf16): forward+backward at least as fast as every SDPA backend on dense shapes ...
    + [Target(OP, case.name, "fwd+bwd", "triton", baseline, 1.0, "cuda")
       for case in _GPU_LONG if not case.padded
       for baseline in ("torch_sdpa", "torch_sdpa_flash", "torch_sdpa_efficient", "torch_sdpa_cudnn")]
    # ... 2x SDPA given the dense mask on padded batches ...
    + [Target(OP, case.name, "fwd+bwd", "triton", "torch_sdpa", 2.0, "cuda") for case in _GPU_LONG if case.padded]
    # ... and 20x the naive reference at L = 2048.
    + [Target(OP, case.name, "fwd+bwd", "triton", "reference", 20.0, "cuda")
       for case in _GPU_LONG if case.length == 2048]
)


# ----------------------------------------------------------------------------
# Inputs and implementations
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Inputs:
    """Leaves ``[B, L, H, D]`` (requiring grad) and their ``[B, H, L, D]`` views; when padded, the
    lengths, the padding mask (True = padding) and the equivalent dense bool mask (True = attend)."""

    leaves: list[torch.Tensor]
    qkv: list[torch.Tensor]
    lengths: Optional[torch.Tensor] = None
    padding: Optional[torch.Tensor] = None
    dense_mask: Optional[torch.Tensor] = None

    @classmethod
    def make(cls, case: AttentionCase, setting: Setting) -> "Inputs":
        generator = torch.Generator().manual_seed(0)
        shape = (case.batch, case.length, case.heads, case.head_dim)
        leaves = [torch.randn(shape, generator=generator).to(setting.device, setting.dtype).requires_grad_()
                  for _ in range(3)]
        inputs = cls(leaves, [t.transpose(1, 2) for t in leaves])
        if case.padded:
            lengths = case.lengths().to(setting.device)
            positions = torch.arange(case.length, device=setting.device)
            inputs.lengths = lengths
            inputs.padding = positions[None, :] >= lengths[:, None]
            dense = (~inputs.padding)[:, None, None, :].expand(case.batch, 1, case.length, case.length)
            if case.causal:
                dense = dense & torch.ones(case.length, case.length, dtype=torch.bool, device=setting.device).tril()
            inputs.dense_mask = dense.contiguous()
        return inputs

    def real_rows(self) -> Optional[torch.Tensor]:
        """bool ``[B, L, 1]``: the merged context's rows of real tokens (what an error is measured on)."""
        return None if self.padding is None else (~self.padding)[:, :, None]


@functools.lru_cache(maxsize=None)
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex(case: AttentionCase, inputs: Inputs) -> Callable[[], torch.Tensor]:
    from torch.nn.attention.flex_attention import create_block_mask

    lengths = inputs.lengths

    def mask_mod(b, h, q_idx, kv_idx):
        keep = kv_idx >= 0
        if case.causal:
            keep = keep & (kv_idx <= q_idx)
        if lengths is not None:
            keep = keep & (kv_idx < lengths[b])
        return keep

    q, k, v = inputs.qkv
    block_mask = create_block_mask(mask_mod, case.batch if lengths is not None else None, None, case.length,
                                   case.length, device=str(q.device))
    flex = _compiled_flex_attention()
    return lambda: flex(q, k, v, block_mask=block_mask)


def _packed(inputs: Inputs, attend: Callable) -> Callable[[], torch.Tensor]:
    """Attention of padded inputs through a packed path: each ``[B, L, H, D]`` leaf packed to
    ``[T, H, D]`` (real tokens only), ``attend(q, k, v, cu_seqlens, max_length)``, unpacked back to
    ``[B, H, L, D]`` with zeros at padding."""
    real = ~inputs.padding
    lengths = inputs.lengths
    cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    max_length = int(lengths.max())

    def forward():
        q, k, v = (leaf[real] for leaf in inputs.leaves)
        out = attend(q, k, v, cu_seqlens, max_length)
        padded = out.new_zeros(inputs.leaves[0].shape)
        padded[real] = out
        return padded.transpose(1, 2)

    return forward


def _sdpa_jagged(case: AttentionCase, inputs: Inputs) -> Callable[[], torch.Tensor]:
    def attend(q, k, v, cu_seqlens, max_length):
        offsets = cu_seqlens.long()
        nested = [torch.nested.nested_tensor_from_jagged(t, offsets).transpose(1, 2) for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*nested, is_causal=case.causal)
        return out.transpose(1, 2).values()

    return _packed(inputs, attend)


def _varlen_attn(case: AttentionCase, inputs: Inputs) -> Callable[[], torch.Tensor]:
    from torch.nn.attention.varlen import varlen_attn

    window = (-1, 0) if case.causal else (-1, -1)
    return _packed(inputs, lambda q, k, v, cu, max_length: varlen_attn(
        q, k, v, cu, cu, max_length, max_length, window_size=window))


def _flash_attn(case: AttentionCase, inputs: Inputs) -> Callable[[], torch.Tensor]:
    import flash_attn

    if inputs.padding is None:
        q, k, v = inputs.leaves
        return lambda: flash_attn.flash_attn_func(q, k, v, causal=case.causal).transpose(1, 2)
    return _packed(inputs, lambda q, k, v, cu, max_length: flash_attn.flash_attn_varlen_func(
        q, k, v, cu, cu, max_length, max_length, causal=case.causal))


def _sdpa(case: AttentionCase, inputs: Inputs, impl: str) -> Callable[[], torch.Tensor]:
    q, k, v = inputs.qkv
    kwargs = {"attn_mask": inputs.dense_mask} if inputs.dense_mask is not None else {"is_causal": case.causal}
    if impl == "torch_sdpa":
        return lambda: F.scaled_dot_product_attention(q, k, v, **kwargs)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, SDPA_BACKENDS[impl])

    def forced():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)

    return forced


def _merged_heads(attend: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``attend`` followed by the seeds' head merge: ``[B, H, L, D]`` -> ``[B, L, H * D]``."""

    def merged():
        out = attend()
        return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)

    return merged


def _forward(case: AttentionCase, impl: str, inputs: Inputs) -> Callable[[], torch.Tensor]:
    """``impl``'s attention of the case's inputs, up to the merged context ``[B, L, H * D]``."""
    return _merged_heads(_attention(case, impl, inputs))


def _attention(case: AttentionCase, impl: str, inputs: Inputs) -> Callable[[], torch.Tensor]:
    q, k, v = inputs.qkv
    if impl == "reference":
        return lambda: reference_attention(q, k, v, is_causal=case.causal, key_padding_mask=inputs.padding)
    if impl in ("torch_sdpa", *SDPA_BACKENDS):
        return _sdpa(case, inputs, impl)
    peers = {"flex_attention": _flex, "sdpa_jagged": _sdpa_jagged, "varlen_attn": _varlen_attn,
             "flash_attn": _flash_attn}
    if impl in peers:
        return peers[impl](case, inputs)
    return lambda: tk.scaled_dot_product_attention(q, k, v, is_causal=case.causal, key_padding_mask=inputs.padding,
                                                   backend=impl)


def _skip_reason(case: AttentionCase, impl: str, setting: Setting) -> Optional[str]:
    materialized = setting.cuda and case.length > MATERIALIZED_MAX_LENGTH
    # The eager backend (the CPU's) materializes them on CUDA too: at L = 16384 (B1 H32) its
    # forward+backward peaked at 129 GiB dense and ran out of the H200's 140 GiB causal (2026-11-28).
    if impl in ("torch_sdpa_math", "reference", "eager") and materialized:
        return f"materializes [B, H, L, L] scores: only L <= {MATERIALIZED_MAX_LENGTH}"
    if impl in SDPA_BACKENDS and setting.size == "quick" and not setting.cuda:
        return "each SDPA backend forced: --full only on CPU (torch_sdpa is torch's own choice)"
    if impl == "torch_sdpa_flash" and case.padded and setting.cuda:
        return "SDPA's CUDA flash backend takes no mask"
    if impl == "flex_attention" and not case.flex:
        return "compiles per shape: only the cases marked flex (CUDA)"
    if impl in ("sdpa_jagged", "varlen_attn") and not case.padded:
        return "a packed path: padded cases only"
    if impl == "sdpa_jagged" and case.causal:
        return "SDPA on jagged nested tensors does not take is_causal"
    if impl == "varlen_attn" and not setting.cuda:
        return "varlen_attn runs on CUDA only"
    if impl == "flash_attn" and importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed"
    return None


def _flops(case: AttentionCase, direction: str) -> float:
    """Useful work: two matmuls of 2·D per (real query, key it sees) pair, per head: a sequence of n
    real tokens has n² pairs, n(n+1)/2 causal; its padding rows and keys none.  Backward 2.5x
    forward."""
    lengths = case.lengths().tolist() if case.padded else case.batch * [case.length]
    forward = 4 * case.heads * case.head_dim * attended_pairs(lengths, case.causal)
    return forward * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[direction]


def _case_groups(case: AttentionCase, setting: Setting) -> list[Group]:
    """The case's group per direction."""
    backends = backends_for(OP, setting)
    impls = [*backends.names, "reference", *PEERS]
    unavailable = dict(backends.unavailable)
    unavailable.update({impl: reason for impl in impls if impl not in unavailable
                        for reason in [_skip_reason(case, impl, setting)] if reason is not None})

    @functools.cache  # made when the case's first group is measured, shared by its directions and implementations
    def inputs() -> Inputs:
        return Inputs.make(case, setting)

    @functools.cache
    def exact() -> torch.Tensor:
        exact_qkv = [t.detach().to(setting.exact_dtype) for t in inputs().qkv]
        with torch.no_grad():
            return _merged_heads(_sdpa(case, dataclasses.replace(inputs(), qkv=exact_qkv), "torch_sdpa"))()

    def setup(impl: str) -> Impl:
        return Impl(_forward(case, impl, inputs()), inputs().leaves)

    return [Group(
        op=OP, case=case.name, direction=direction,
        setups={impl: functools.partial(setup, impl) for impl in impls if impl not in unavailable},
        unavailable=unavailable,
        error=lambda outputs: max_abs_error(outputs, exact(), inputs().real_rows()), flops=_flops(case, direction),
        ours=tuple(name for name in backends.names if name not in unavailable),
        params={"length": case.length, "padding": case.padded_fraction(), "family": case.family},
    ) for direction in directions(case, setting)]


def groups(setting: Setting) -> list[Group]:
    return [group for case in cases(setting) for group in _case_groups(case, setting)]
