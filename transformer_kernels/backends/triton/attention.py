"""Triton backend of ``scaled_dot_product_attention``: the launchers of the flash-style forward
and backward kernels of :mod:`.attention_kernels` (whose docstring tells their algorithm and mask
switches), their tile configurations, and the configurations CI compiles.

Inputs arrive normalized by the op layer (see ``ops/attention.py``):
query ``[B, Hq, Lq, D]``, key ``[B, Hk, Lk, D]``, value ``[B, Hk, Lk, Dv]`` with
any strides, ``Hq % Hk == 0``.  The launchers hand the kernels 16-byte aligned
tensors whose head dims and strides are multiples of 16 elements, copying (and
zero-padding the head dim of) the rare input that is not, so loads vectorize.
A call's launches are built once per layout and then looked up and replayed with the call's
tensors (:class:`~._common.LaunchTemplates`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Callable, Optional

import torch
import triton

from ...ops.attention import (
    KEY_BOUNDS_MIN_LENGTH, MAX_HEAD_DIM, AttentionArgs, Causal, dropout_threshold, empty_grads, empty_lse,
    empty_output,
)
from ...ops.attention import grads_like_inputs as grads_contiguous
from . import interpreter_enabled
from ._common import (
    COMPILE_CAPABILITIES,
    TORCH_TO_TRITON_DTYPE,
    CompileTarget,
    KernelConfig,
    KernelLaunch,
    LaunchTemplates,
    TensorLayout,
    address_aligned,
    cdiv,
    check_prepared_launches,
    compute_capability,
    filled,
    input_precision,
    next_power_of_2,
    run_launches,
    strided_layout,
)
from .attention_kernels import (
    _attention_delta_kernel,
    _attention_forward_kernel,
    _attention_grad_key_value_kernel,
    _attention_grad_query_kernel,
    _attention_key_bounds_kernel,
)

__all__ = [
    "unsupported_reason", "empty_saved", "grads_contiguous", "forward", "prepare_forward", "backward", "compile_targets",
]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# CUDA caps the second grid dimension; larger batch*heads are launched in chunks.
_MAX_GRID_Y = 65535


# ---------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------


# ``block_m`` tiles queries and ``block_n`` keys, whichever of the two the
# kernel's program owns (forward and dQ own a query block, dK/dV a key block).
#
# Keyed by (kernel, head dim bucket): the bucket is max(BLOCK_D, BLOCK_DV)
# rounded up to 64, 128 or 256.  Each entry is compiled for sm_80 and sm_90 by
# tests/test_triton_compile.py (see compile_targets()): it fits in shared
# memory and does not spill (ptxas stack frame 0 as well as no local memory).
#
# FAST: 16-bit inputs without a dense mask or dropout (causal and key padding
# allowed) -- the cases the performance targets are about.  Starting points
# were the Triton flash-attention tutorial's tiles; they were shrunk, or given
# 8 warps, until the causal + key padding variant stayed within 255 registers
# on both architectures.
_FAST_CONFIGS: dict[tuple[str, int], KernelConfig] = {
    ("forward", 64): KernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
    ("forward", 128): KernelConfig(block_m=128, block_n=32, num_warps=8, num_stages=3),
    ("forward", 256): KernelConfig(block_m=32, block_n=32, num_warps=4, num_stages=2),
    ("grad_key_value", 64): KernelConfig(block_m=32, block_n=32, num_warps=4, num_stages=2),
    ("grad_key_value", 128): KernelConfig(block_m=16, block_n=64, num_warps=8, num_stages=2),
    ("grad_key_value", 256): KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1),
    ("grad_query", 64): KernelConfig(block_m=128, block_n=32, num_warps=8, num_stages=3),
    ("grad_query", 128): KernelConfig(block_m=32, block_n=64, num_warps=8, num_stages=2),
    ("grad_query", 256): KernelConfig(block_m=16, block_n=32, num_warps=8, num_stages=1),
}
# DENSE: FAST inputs with neither causal nor key padding.  Lighter switches
# do not always mean fewer registers: under triton 3.6 the FAST d128 forward
# and dK/dV tiles spill on sm_90 without them, so this table has its own
# entries there.  benchmarks/tune_attention.py on an H100 (triton 3.6) found
# faster tiles for every kernel; of those only the d64 forward compiles
# without spills under both triton versions on both architectures, and most
# others on sm_90 alone (the SM90 table below).
_DENSE_CONFIGS = {
    **_FAST_CONFIGS,
    ("forward", 64): KernelConfig(block_m=128, block_n=64, num_warps=4, num_stages=3),
    ("forward", 128): KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2),
    ("grad_key_value", 128): KernelConfig(block_m=32, block_n=32, num_warps=8, num_stages=2),
}
# MASKED: 16-bit inputs with a dense mask (a tile of mask pointers and values)
# or dropout (Philox state); smaller tiles keep them within registers.
_MASKED_CONFIGS: dict[tuple[str, int], KernelConfig] = {
    ("forward", 64): KernelConfig(block_m=64, block_n=32, num_warps=8, num_stages=2),
    ("forward", 128): KernelConfig(block_m=64, block_n=32, num_warps=8, num_stages=2),
    ("forward", 256): KernelConfig(block_m=32, block_n=16, num_warps=8, num_stages=1),
    ("grad_key_value", 64): KernelConfig(block_m=16, block_n=32, num_warps=8, num_stages=2),
    ("grad_key_value", 128): KernelConfig(block_m=16, block_n=16, num_warps=8, num_stages=2),
    ("grad_key_value", 256): KernelConfig(block_m=16, block_n=16, num_warps=8, num_stages=1),
    ("grad_query", 64): KernelConfig(block_m=32, block_n=32, num_warps=4, num_stages=2),
    ("grad_query", 128): KernelConfig(block_m=32, block_n=32, num_warps=8, num_stages=2),
    ("grad_query", 256): KernelConfig(block_m=16, block_n=32, num_warps=8, num_stages=1),
}
# SHORT: FAST and DENSE inputs whose queries and keys are all at most
# SHORT_MAX_LENGTH long (the seeds' padded batches, 16-64 tokens).  A query
# tile of 128 rows would leave half to seven eighths of every program's rows
# empty there; 64 rows is the smallest tile that still lowers to wgmma on
# sm_90 (a dot's M must be a multiple of 64), and dK/dV at head dim 128 gets
# 64 keys for the same reason.  dK/dV at head dim 64 keeps its FAST tile on
# sm_80, where every 64-key tile tried (16 to 64 queries, 4 or 8 warps)
# spills; sm_90 has its own (the SM90 table's "short" entry).
# Chosen by compiling, not yet timed on a GPU: benchmarks/tune_attention.py
# --short sweeps them.
SHORT_MAX_LENGTH = 64
_SHORT_CONFIGS: dict[tuple[str, int], KernelConfig] = {
    ("forward", 64): KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2),
    ("forward", 128): KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2),
    ("grad_key_value", 128): KernelConfig(block_m=32, block_n=64, num_warps=8, num_stages=2),
    ("grad_query", 64): KernelConfig(block_m=64, block_n=32, num_warps=4, num_stages=2),
    ("grad_query", 128): KernelConfig(block_m=64, block_n=32, num_warps=8, num_stages=2),
}
# SM90: Hopper's own tiles, by (table, kernel, head dim bucket), over the
# tables above.  The H100 sweep (benchmarks/tune_attention.py, triton 3.6,
# bf16, B16 L1024 and B8 L2048) found these faster than the shared entries:
# forward d128 by 17%, dQ d64 by 10% and d128 by 29%, dK/dV d128 by 39%.
# They compile without spills on sm_90 under triton 3.6 and 3.9 (dK/dV d128
# without causal or padding only), every dot a wgmma; on sm_80 they spill.
_SM90_CONFIGS: dict[tuple[str, str, int], KernelConfig] = {
    **{(table, "forward", 128): KernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=4)
       for table in ("dense", "fast")},
    **{(table, "grad_query", 64): KernelConfig(block_m=128, block_n=32, num_warps=4, num_stages=3)
       for table in ("dense", "fast")},
    **{(table, "grad_query", 128): KernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
       for table in ("dense", "fast")},
    ("dense", "grad_key_value", 128): KernelConfig(block_m=32, block_n=128, num_warps=8, num_stages=3),
    # dK/dV at head dim 64 (the seeds'), whose shared 32-key tiles are too short for wgmma: the
    # sweep's fastest d64 tile, (16, 128, 4, 4), 35% faster, spills under triton 3.6; its 3-stage
    # twin does not without causal or padding, and with them 8 warps hold it.  Chosen by compiling
    # (0 stack, wgmma, operands 3 deep under triton 3.6 and 3.9), not timed themselves.
    ("dense", "grad_key_value", 64): KernelConfig(block_m=16, block_n=128, num_warps=4, num_stages=3),
    # dK/dV at head dim 128 with causal or padding, whose shared tile owns 64 keys: on the H200
    # (2026-11-27 report) it made the causal backward slower than the dense one (the SM90 dense tile
    # above) where it should take half the time.  128 keys, the dense tile's, with 16-query steps
    # (the d64 sweep's fastest shape), is the one such tile that compiles without spilling under
    # triton 3.6 (stack 0 at 255 registers) and 3.9; chosen by compiling, not yet timed.
    ("fast", "grad_key_value", 128): KernelConfig(block_m=16, block_n=128, num_warps=8, num_stages=2),
    ("fast", "grad_key_value", 64): KernelConfig(block_m=16, block_n=128, num_warps=8, num_stages=3),
    # ... and 64 keys for SHORT inputs (an entry "short" is looked up before the SHORT table).
    ("short", "grad_key_value", 64): KernelConfig(block_m=32, block_n=64, num_warps=4, num_stages=2),
    # MASKED backward tiles own 64 keys (dK/dV) or 64 queries (dQ), wgmma's smallest M, where the
    # shared ones own 16 or 32; chosen by compiling like the dK/dV d64 ones above.
    **{("masked", "grad_key_value", bucket): KernelConfig(block_m=16, block_n=64, num_warps=8, num_stages=2)
       for bucket in (64, 128)},
    ("masked", "grad_query", 64): KernelConfig(block_m=64, block_n=32, num_warps=4, num_stages=2),
    ("masked", "grad_query", 128): KernelConfig(block_m=64, block_n=32, num_warps=8, num_stages=2),
    # Head dim 256: 64 queries for the forward and dQ, where the shared tiles' 16 or 32 rows do not
    # reach wgmma; two stages, which keep K and V in shared memory rather than registers.  (Neither
    # dK/dV at 256 nor the MASKED dQ at 256 has a 64-row tile that does not spill.)
    **{(table, "forward", 256): KernelConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)
       for table in ("dense", "fast")},
    ("masked", "forward", 256): KernelConfig(block_m=64, block_n=16, num_warps=8, num_stages=2),
    **{(table, "grad_query", 256): KernelConfig(block_m=64, block_n=16, num_warps=8, num_stages=2)
       for table in ("dense", "fast")},
}
# FLOAT32: tf32x3 dots (three tensor-core products, ~fp32 accuracy) hold a
# high and a low part of every operand, and each warp holds whole rows of the
# loop-invariant operand (Q, or K and V): past head dim 64 no tile shape stays
# within 255 registers, so on the GPU float32 is served up to head dim 64
# (``unsupported_reason``), with small tiles and every switch allowed.
_FLOAT32_CONFIGS: dict[tuple[str, int], KernelConfig] = {
    ("forward", 64): KernelConfig(block_m=32, block_n=16, num_warps=4, num_stages=1),
    ("grad_key_value", 64): KernelConfig(block_m=16, block_n=16, num_warps=8, num_stages=1),
    ("grad_query", 64): KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1),
}
MAX_FLOAT32_HEAD_DIM_ON_GPU = 64
# Triton before 3.9 (checked with 3.6) allocates registers differently: no
# single dK/dV tile serves head dim 256 under both without spilling, and with
# a dense mask or dropout none does under 3.6 at all (every tile of 16 to 32
# rows, 1 to 16 warps spills): there dK and dV take a pass each
# (``_GRAD_KEY_VALUE_APART``).
# Nor does one float32 dQ tile (with dropout's per-element Philox) serve both,
# nor, once 3.6 got the alignment hints that make its loads 16 bytes wide and
# pipelined (``_aligned_base``), the FAST dK/dV tile at head dim 64 and the
# MASKED forward at 256 (checked by tests/test_triton_compile.py).
_OLD_TRITON = tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 9)
if _OLD_TRITON:
    _FAST_CONFIGS[("grad_key_value", 64)] = KernelConfig(block_m=32, block_n=32, num_warps=8, num_stages=2)
    _FAST_CONFIGS[("grad_key_value", 256)] = KernelConfig(block_m=16, block_n=32, num_warps=8, num_stages=1)
    _DENSE_CONFIGS[("grad_key_value", 256)] = KernelConfig(block_m=16, block_n=32, num_warps=8, num_stages=1)
    _MASKED_CONFIGS[("forward", 256)] = KernelConfig(block_m=32, block_n=32, num_warps=8, num_stages=1)
    _FLOAT32_CONFIGS[("grad_query", 64)] = KernelConfig(block_m=16, block_n=32, num_warps=4, num_stages=1)
    _MASKED_CONFIGS[("grad_key_value", 256)] = KernelConfig(block_m=32, block_n=16, num_warps=8, num_stages=1)
# (table variant, head dim bucket) whose dK/dV kernel accumulates dK and dV in passes of their own
# (GRAD_KEY, GRAD_VALUE), each recomputing the scores: under triton 3.6 every tile holding both at
# head dim 256 with a dense mask or dropout spills; one gradient a pass, (32, 16, 8, 1) does not.
_GRAD_KEY_VALUE_APART = {("masked", 256)} if _OLD_TRITON else set()
# Under TRITON_INTERPRET=1 small, unequal tiles exercise the multi-block and
# diagonal paths at the short lengths the tests can afford.  Triton's jit chose
# interpreted or compiled kernels when this module was imported (the setting is
# read then, not per launch), so the tiles follow that choice; reading the
# environment on every launch cost host time.
_INTERPRETED = interpreter_enabled()
# Key bounds (their kernel's launch and allocation on every call) only from KEY_BOUNDS_MIN_LENGTH
# keys on (see there); shorter keys go without (``KEY_BOUNDS`` off: each block masked, reading its
# padding).  Under the interpreter, from two of its 16-key blocks on, so that the tests' short
# lengths take both ways.
_BOUNDED_KEYS_FROM = 33 if _INTERPRETED else KEY_BOUNDS_MIN_LENGTH
_INTERPRETER_CONFIGS = {
    "forward": KernelConfig(block_m=32, block_n=16, num_warps=1, num_stages=1),
    "grad_key_value": KernelConfig(block_m=16, block_n=32, num_warps=1, num_stages=1),
    "grad_query": KernelConfig(block_m=32, block_n=16, num_warps=1, num_stages=1),
}
# The delta pre-pass has no loop to pipeline: Triton's default stages.
_DELTA_CONFIG = KernelConfig(block_m=32, num_warps=4, num_stages=3)
_KEY_BOUNDS_CONFIG = KernelConfig(block_n=1024, num_warps=4, num_stages=1)


# The tables by mask variant (``_Masks.variant``) for 16-bit inputs.
_CONFIG_TABLES = {"dense": _DENSE_CONFIGS, "fast": _FAST_CONFIGS, "masked": _MASKED_CONFIGS}


def block_config(
    kernel: str, head_dim: int, head_dim_v: int, dtype: torch.dtype, variant: str, max_length: int,
    capability: Optional[int],
) -> KernelConfig:
    """The configuration ``kernel`` ("forward", "grad_key_value" or "grad_query") runs with;
    ``variant``: "dense", "fast" or "masked" (see ``_Masks.variant``); ``max_length``: the longer
    of the query and key lengths; ``capability``: the GPU's (``compute_capability``), None under
    the interpreter."""
    if _INTERPRETED:
        return _INTERPRETER_CONFIGS[kernel]
    return _table_config(kernel, head_dim_bucket(head_dim, head_dim_v), dtype, variant, max_length, capability)


def head_dim_bucket(head_dim: int, head_dim_v: int) -> int:
    """The tables' head dim key: max(head_dim, head_dim_v) rounded up to 64, 128 or 256."""
    return max(64, next_power_of_2(head_dim), next_power_of_2(head_dim_v))


# Bounded: decoding meets a new length on every step.
@functools.lru_cache(maxsize=4096)
def _table_config(
    kernel: str, bucket: int, dtype: torch.dtype, variant: str, max_length: int, capability: Optional[int]
) -> KernelConfig:
    """:func:`block_config` on a GPU, for head dim ``bucket`` (64, 128 or 256)."""
    if dtype == torch.float32:
        return _FLOAT32_CONFIGS[(kernel, bucket)]
    sm90 = capability is not None and capability >= 90
    if variant != "masked" and max_length <= SHORT_MAX_LENGTH:
        if sm90 and ("short", kernel, bucket) in _SM90_CONFIGS:
            return _SM90_CONFIGS[("short", kernel, bucket)]
        if (kernel, bucket) in _SHORT_CONFIGS:
            return _SHORT_CONFIGS[(kernel, bucket)]
    if sm90 and (variant, kernel, bucket) in _SM90_CONFIGS:
        return _SM90_CONFIGS[(variant, kernel, bucket)]
    return _CONFIG_TABLES[variant][(kernel, bucket)]


def unsupported_reason(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, args: AttentionArgs) -> Optional[str]:
    """Why the Triton kernels cannot serve these arguments, or ``None``."""
    if query.dtype not in SUPPORTED_DTYPES:
        return f"the triton backend supports float16, bfloat16 and float32, got {query.dtype}"
    if args.attn_mask is not None and args.attn_mask.dtype not in (torch.bool, query.dtype):
        return (f"the triton backend takes a float attn_mask of the query's dtype ({query.dtype}), "
                f"got {args.attn_mask.dtype}")
    head_dim = max(query.shape[-1], value.shape[-1])
    if head_dim > MAX_HEAD_DIM:
        return f"the triton backend supports head dims up to {MAX_HEAD_DIM}, got {head_dim}"
    if query.dtype == torch.float32 and query.is_cuda and head_dim > MAX_FLOAT32_HEAD_DIM_ON_GPU:
        return (
            f"the triton backend supports float32 on the GPU up to head dim {MAX_FLOAT32_HEAD_DIM_ON_GPU} "
            f"(its float32 kernels would spill registers), got {head_dim}; use float16/bfloat16 or backend='eager'"
        )
    return None


def _is_aligned(tensor: torch.Tensor) -> bool:
    return address_aligned(tensor) and _aligned_layout(tensor.shape, tensor.stride())


# Bounded: decoding meets a new length on every step.
@functools.lru_cache(maxsize=4096)
def _aligned_layout(shape: torch.Size, strides: tuple[int, ...]) -> bool:
    """Whether a tensor of this shape and these strides meets ``_aligned``'s rules, its address
    aside (looked up once per layout: every tensor of every call is checked)."""
    return (
        strides[-1] == 1
        and shape[-1] % 16 == 0
        and all(stride % 16 == 0 for stride, size in zip(strides[:-1], shape[:-1]) if size > 1)
    )


def _one_broadcast_slice(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with each broadcast (stride-0) leading dimension cut to one
    slice: all that a copy of it needs to hold before expanding again."""
    return tensor[tuple(slice(0, 1) if stride == 0 else slice(None) for stride in tensor.stride()[:-1])]


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` [B, H, L, E] as the kernels require it: 16-byte aligned, unit
    stride along E, other strides and E multiples of 16 elements.  Anything
    else (an odd head dim, an odd view) is copied with E zero-padded: zero
    columns change no dot product, and padded output columns are cut off.
    Broadcast (stride-0) dimensions stay broadcast: only one slice along
    them is copied, then expanded again."""
    if _is_aligned(tensor):
        return tensor
    source = _one_broadcast_slice(tensor)
    padded = source.new_zeros((*source.shape[:-1], cdiv(tensor.shape[-1], 16) * 16))
    padded[..., : tensor.shape[-1]] = source
    return padded.expand(*tensor.shape[:-1], padded.shape[-1])


def _unit_last_stride(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A mask with stride 1 along its last dimension, so every launch matches
    a compiled-and-checked variant (Triton turns a stride of 1 into a
    constant).  Broadcast (stride-0) leading dimensions stay broadcast."""
    if tensor is None or tensor.stride(-1) == 1:
        return tensor
    if tensor.shape[-1] == 1:
        return tensor.as_strided(tensor.shape, (*tensor.stride()[:-1], 1))
    return _one_broadcast_slice(tensor).contiguous().expand(tensor.shape)


def _mask_arguments(
    key_padding_mask: Optional[torch.Tensor],
    key_bounds: Optional[torch.Tensor],
    attn_mask: Optional[torch.Tensor],
) -> tuple[list, dict]:
    """The strides (in kernel order, from stride_kpb on) and the constexpr
    switches of the optional masks, as ``_Masks.pointers`` holds them; absent
    tensors have zero strides."""
    padding_strides = (0, 0) if key_padding_mask is None else key_padding_mask.stride()
    bounds_strides = (0, 0) if key_bounds is None else key_bounds.stride()
    mask_strides = (0, 0, 0, 0) if attn_mask is None else attn_mask.stride()
    strides = [*padding_strides, *bounds_strides, *mask_strides]
    switches = dict(
        HAS_KEY_PADDING=key_padding_mask is not None,
        KEY_BOUNDS=key_bounds is not None,
        HAS_DENSE_MASK=attn_mask is not None,
        MASK_IS_BOOL=attn_mask is not None and attn_mask.dtype == torch.bool,
    )
    return strides, switches


def _dropout_arguments(dropout_p: float, dropout_seed: Optional[torch.Tensor]) -> dict:
    if dropout_p == 0.0:
        return dict(dropout_seed_ptr=None, dropout_threshold=0, dropout_scale=1.0, HAS_DROPOUT=False)
    threshold, scale = dropout_threshold(dropout_p)
    return dict(dropout_seed_ptr=dropout_seed, dropout_threshold=threshold, dropout_scale=scale, HAS_DROPOUT=True)


@functools.lru_cache(maxsize=None)
def _config_arguments(config: KernelConfig, dtype: torch.dtype, head_dim: int, head_dim_v: int) -> dict:
    """The launch keyword arguments that follow from the configuration and the head dims; one
    dict per configuration, shared by its calls, which copy it and never change it."""
    return dict(
        BLOCK_D=next_power_of_2(head_dim),
        BLOCK_DV=next_power_of_2(head_dim_v),
        # float32 inputs: three tf32 products recover ~fp32 accuracy on tensor
        # cores (plain tf32 errs near 3e-4, far from torch's float32 math).
        INPUT_PRECISION=input_precision(dtype, allow_tf32=True),
        **config.launch_kwargs(),
    )


def _even_head_dim(query: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether both head dims fill their power-of-two blocks, so the forward
    and dQ kernels load K and V tiles without a column mask."""
    head_dim, head_dim_v = query.shape[-1], value.shape[-1]
    return head_dim == next_power_of_2(head_dim) and head_dim_v == next_power_of_2(head_dim_v)


def _chunked_launches(
    kernel, num_blocks: int, num_head_batches: int, config_args: dict, args: tuple, kwargs: dict
) -> list[KernelLaunch]:
    """The launches of ``kernel`` over a (blocks, batch*heads) grid, split
    where batch*heads passes CUDA's grid limit."""
    kwargs = {**kwargs, **config_args}
    if num_head_batches <= _MAX_GRID_Y:  # one launch, nearly always
        return [KernelLaunch(kernel, (num_blocks, num_head_batches), args, dict(kwargs, head_batch_start=0))]
    return [
        KernelLaunch(
            kernel,
            (num_blocks, min(_MAX_GRID_Y, num_head_batches - start)),
            args,
            dict(kwargs, head_batch_start=start),
        )
        for start in range(0, num_head_batches, _MAX_GRID_Y)
    ]


class _Masks:
    """A call's :class:`AttentionArgs` and the kernel arguments built from them;
    ``key_bounds`` ``[B, 3]`` int32 with a key padding mask of keys long enough
    (:func:`_empty_key_bounds`), which :func:`_key_bounds_launches` fills with what
    :func:`~transformer_kernels.ops.attention.key_padding_bounds` gives the
    other backends (first and last + 1 kept key, kept count), in one kernel;
    ``capability``: the GPU's the launches are for (``compute_capability``),
    which picks the tiles.

    Worked out once per call, shared by its launches:

    - ``pointers``: the masks' tensors in kernel order (key padding, key
      bounds, attn_mask; None where absent), each with stride 1 along its last
      dimension (a mask without is copied once, and the backward's kernels
      share the copy);
    - ``layout``: what the launches take from the masks besides their
      tensors' addresses, hashable: part of every launch template's key;
    - ``call_kwargs``: the keyword arguments that change from call to call
      (dropout's (seed, offset) tensor).
    """

    __slots__ = ("args", "key_bounds", "capability", "pointers", "layout", "call_kwargs")

    def __init__(self, args: AttentionArgs, key_bounds: Optional[torch.Tensor], capability: Optional[int]) -> None:
        if args.key_padding_mask is None and key_bounds is not None:
            raise ValueError("key_bounds come only with a key_padding_mask")
        self.args, self.key_bounds, self.capability = args, key_bounds, capability
        padding, attn_mask = _unit_last_stride(args.key_padding_mask), _unit_last_stride(args.attn_mask)
        self.pointers = (padding, key_bounds, attn_mask)
        self.layout = (
            None if padding is None else (padding.stride(), None if key_bounds is None else key_bounds.stride()),
            None if attn_mask is None else (attn_mask.stride(), attn_mask.dtype),
            args.causal, args.scale, args.dropout_p, capability,
        )
        self.call_kwargs = _call_kwargs(args)

    @classmethod
    def of(cls, args: AttentionArgs, device: torch.device) -> "_Masks":
        return cls(args, _empty_key_bounds(args.key_padding_mask), compute_capability(device))

    def arguments(self) -> tuple[list, dict]:
        """(mask strides, the scalar and constexpr keyword arguments that
        forward, dK/dV and dQ share), for building a launch template."""
        args = self.args
        strides, switches = _mask_arguments(*self.pointers)
        dropout = _dropout_arguments(args.dropout_p, args.dropout_seed)
        kwargs = dict(qk_scale=args.scale * math.log2(math.e), **dropout, CAUSAL=int(args.causal), **switches)
        return strides, kwargs

    @property
    def variant(self) -> str:
        """Which configuration table serves these masks: "masked" (a dense mask
        or dropout), "fast" (causal or key padding) or "dense" (none)."""
        args = self.args
        if args.attn_mask is not None or args.dropout_p > 0.0:
            return "masked"
        if args.causal != Causal.NONE or args.key_padding_mask is not None:
            return "fast"
        return "dense"


def _empty_key_bounds(padding: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The ``[B, 3]`` int32 key bounds that :func:`_key_bounds_launches` fills for ``padding``: None
    without key padding, and for keys too short for bounds to pay (``_BOUNDED_KEYS_FROM``)."""
    if padding is None or padding.shape[-1] < _BOUNDED_KEYS_FROM:
        return None
    return padding.new_empty((padding.shape[0], 3), dtype=torch.int32)


def _call_kwargs(args: AttentionArgs) -> dict:
    """The keyword arguments of the masked kernels that change from call to call: dropout's
    (seed, offset) tensor."""
    return {} if args.dropout_p == 0.0 else {"dropout_seed_ptr": args.dropout_seed}


_KERNELS = {
    "forward": _attention_forward_kernel,
    "grad_key_value": _attention_grad_key_value_kernel,
    "grad_query": _attention_grad_query_kernel,
}

# The kernels that load K and V tiles without a column mask where the head dims allow it.
_EVEN_HEAD_DIM_KERNELS = ("forward", "grad_query")
# Every launch of this backend, by layout (see ``LaunchTemplates``).
_TEMPLATES = LaunchTemplates()


def _masked_kernel_template(
    kernel_name: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, masks: _Masks,
    pointers: tuple, strides: tuple[int, ...], *extra_args, **extra_kwargs,
) -> tuple[KernelLaunch, ...]:
    """The template of the forward, dK/dV or dQ kernel's launches, whose arguments run:
    ``pointers``, the masks' pointers, ``strides`` (every stride of each tensor
    in turn), the masks' strides, the problem's sizes, ``extra_args``;
    then the shared scalars and switches (``EVEN_HEAD_DIM`` for the kernels of
    ``_EVEN_HEAD_DIM_KERNELS``) and ``extra_kwargs`` by name.
    ``query``/``key``/``value`` as ``_aligned`` returns them.  Built once per
    layout: the sizes, strides, dtype, masks, ``extra_*`` and the tile
    configuration are its key (the configuration is looked up on every call,
    so a table or ``block_config`` changed at run time, as the tile sweep
    does, takes effect)."""
    batch, num_q_heads, seq_len_q, head_dim = query.shape
    num_kv_heads, seq_len_k, head_dim_v = key.shape[1], key.shape[2], value.shape[3]
    config = block_config(
        kernel_name, head_dim, head_dim_v, query.dtype, masks.variant, max(seq_len_q, seq_len_k), masks.capability
    )
    layout = (
        kernel_name, query.shape, key.shape, value.shape, query.dtype, strides, masks.layout, config,
        extra_args, *extra_kwargs.values(),
    )

    def build() -> list[KernelLaunch]:
        mask_strides, kwargs = masks.arguments()
        if kernel_name in _EVEN_HEAD_DIM_KERNELS:
            kwargs["EVEN_HEAD_DIM"] = _even_head_dim(query, value)
        if kernel_name == "grad_key_value":  # a program per key block of a kv head
            num_blocks, num_head_batches = cdiv(seq_len_k, config.block_n), batch * num_kv_heads
        else:  # a program per query block of a query head
            num_blocks, num_head_batches = cdiv(seq_len_q, config.block_m), batch * num_q_heads
        return _chunked_launches(
            _KERNELS[kernel_name],
            num_blocks,
            num_head_batches,
            _config_arguments(config, query.dtype, head_dim, head_dim_v),
            (
                *pointers, *masks.pointers, *strides, *mask_strides,
                num_q_heads, num_q_heads // num_kv_heads, seq_len_q, seq_len_k, head_dim, head_dim_v,
                *extra_args,
            ),
            {**kwargs, **extra_kwargs},
        )

    return _TEMPLATES.template(layout, (*pointers, *masks.pointers), build, masks.call_kwargs)


def _forward_launches(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, masks: _Masks
) -> list[KernelLaunch]:
    """Launches of the forward kernel; ``out`` as ``_aligned`` returns it,
    ``lse`` ``[B, Hq, Lq]`` float32."""
    return filled(_forward_template(query, key, value, out, lse, masks), (query, key, value, out, lse,
                                                                          *masks.pointers), masks.call_kwargs)


def _forward_template(query, key, value, out, lse, masks: _Masks) -> tuple[KernelLaunch, ...]:
    """The template of :func:`_forward_launches`, whose pointers are ``query, key, value, out, lse``
    and ``masks.pointers``."""
    return _masked_kernel_template(
        "forward", query, key, value, masks,
        [query, key, value, out, lse],
        (*query.stride(), *key.stride(), *value.stride(), *out.stride(), *lse.stride()),
    )


def _key_bounds_launches(masks: _Masks) -> list[KernelLaunch]:
    """The launch filling ``masks.key_bounds``; none without them."""
    padding, bounds, _ = masks.pointers
    return [] if bounds is None else filled(_key_bounds_template(masks), (padding, bounds), {})


def _key_bounds_template(masks: _Masks) -> tuple[KernelLaunch, ...]:
    """The template of :func:`_key_bounds_launches` with key bounds, whose pointers are the padding
    mask and the bounds."""
    padding, bounds, _ = masks.pointers

    def build() -> list[KernelLaunch]:
        return [KernelLaunch(
            _attention_key_bounds_kernel,
            (padding.shape[0],),
            (padding, bounds, *padding.stride(), *bounds.stride(), padding.shape[1]),
            dict(_KEY_BOUNDS_CONFIG.launch_kwargs()),
        )]

    layout = ("key_bounds", padding.shape, padding.stride(), bounds.stride())
    return _TEMPLATES.template(layout, (padding, bounds), build, {})


@functools.lru_cache(maxsize=None)
def _delta_config_arguments(head_dim_v: int) -> dict:
    """The delta kernel's launch keyword arguments for a head dim, shared like ``_config_arguments``'s."""
    return dict(BLOCK_DV=next_power_of_2(head_dim_v), **_DELTA_CONFIG.launch_kwargs())


def _delta_launches(grad_out: torch.Tensor, out: torch.Tensor, delta: torch.Tensor) -> list[KernelLaunch]:
    """Launches of the backward pre-pass writing ``delta`` ``[B, Hq, Lq]``."""
    return filled(_delta_template(grad_out, out, delta), (grad_out, out, delta), {})


def _delta_template(grad_out: torch.Tensor, out: torch.Tensor, delta: torch.Tensor) -> tuple[KernelLaunch, ...]:
    """The template of :func:`_delta_launches`, whose pointers are ``grad_out, out, delta``."""
    batch, num_q_heads, seq_len_q, head_dim_v = out.shape

    def build() -> list[KernelLaunch]:
        return _chunked_launches(
            _attention_delta_kernel,
            cdiv(seq_len_q, _DELTA_CONFIG.block_m),
            batch * num_q_heads,
            _delta_config_arguments(head_dim_v),
            (grad_out, out, delta, *grad_out.stride(), *out.stride(), num_q_heads, seq_len_q, head_dim_v),
            {},
        )

    layout = ("delta", out.shape, grad_out.stride(), out.stride())
    return _TEMPLATES.template(layout, (grad_out, out, delta), build, {})


def grad_key_value_passes(variant: str, head_dim_bucket: int) -> tuple[tuple[bool, bool], ...]:
    """The dK/dV kernel's passes, each ``(GRAD_KEY, GRAD_VALUE)``: one for both, or one per gradient
    (``_GRAD_KEY_VALUE_APART``)."""
    if (variant, head_dim_bucket) in _GRAD_KEY_VALUE_APART:
        return (True, False), (False, True)
    return ((True, True),)


def _grad_key_value_launches(
    query, key, value, grad_out, lse, delta, dk, dv, grad_scores: Optional[torch.Tensor], masks: _Masks
) -> list[KernelLaunch]:
    """Launches of the dK/dV kernel; ``grad_scores`` ``[B, Hq, Lq, Lk]``
    float32 receives dS when given (its strides are zeros otherwise)."""
    pointers = (query, key, value, grad_out, lse, delta, dk, dv, grad_scores, *masks.pointers)
    templates = _grad_key_value_templates(query, key, value, grad_out, lse, delta, dk, dv, grad_scores, masks)
    return [launch for template in templates for launch in filled(template, pointers, masks.call_kwargs)]


def _grad_key_value_templates(
    query, key, value, grad_out, lse, delta, dk, dv, grad_scores: Optional[torch.Tensor], masks: _Masks
) -> list[tuple[KernelLaunch, ...]]:
    """The templates of :func:`_grad_key_value_launches`, one per pass, whose pointers are
    ``query, key, value, grad_out, lse, delta, dk, dv, grad_scores`` and ``masks.pointers``."""
    scores_strides = grad_scores.stride() if grad_scores is not None else (0, 0, 0, 0)
    bucket = head_dim_bucket(query.shape[-1], value.shape[-1])
    return [
        _masked_kernel_template(
            "grad_key_value", query, key, value, masks,
            [query, key, value, grad_out, lse, delta, dk, dv, grad_scores],
            (*query.stride(), *key.stride(), *value.stride(), *grad_out.stride(), *dk.stride(), *dv.stride(),
             *scores_strides),
            key.shape[1],
            scale=masks.args.scale, STORE_GRAD_SCORES=grad_scores is not None, GRAD_KEY=grad_key,
            GRAD_VALUE=grad_value,
        )
        for grad_key, grad_value in grad_key_value_passes(masks.variant, bucket)
    ]


def _grad_query_splits_keys(variant: str, capability: Optional[int]) -> bool:
    """Whether the dQ kernel runs its key blocks in the forward's two stages (``SPLIT_KEYS``) for
    masks of ``variant`` (``_Masks.variant``) on a GPU of compute ``capability``.

    A second loop body costs registers.  With a dense mask or dropout ("masked"), which hold
    registers of their own, the unmasked stage would shed little, so one masked stage takes
    every block.  With causality or key padding ("fast") the unmasked stage sheds the padding
    load and the causal test.  Without masks ("dense") it sheds the tail's column masks and
    fuses the scaling into exp2's argument (dQ d64 on sm_90: 326 instructions per iteration
    -> 277); on sm_90, and under the interpreter, that costs no program per SM, but on sm_80
    the d128 tile's 128 registers would grow to 156, halving its programs per SM."""
    if variant == "dense":
        return capability is None or capability >= 90
    return variant == "fast"


def _grad_query_launches(query, key, value, grad_out, lse, delta, dq, masks: _Masks) -> list[KernelLaunch]:
    """Launches of the dQ kernel."""
    return filled(_grad_query_template(query, key, value, grad_out, lse, delta, dq, masks),
                  (query, key, value, grad_out, lse, delta, dq, *masks.pointers), masks.call_kwargs)


def _grad_query_template(query, key, value, grad_out, lse, delta, dq, masks: _Masks) -> tuple[KernelLaunch, ...]:
    """The template of :func:`_grad_query_launches`, whose pointers are ``query, key, value,
    grad_out, lse, delta, dq`` and ``masks.pointers``."""
    return _masked_kernel_template(
        "grad_query", query, key, value, masks,
        [query, key, value, grad_out, lse, delta, dq],
        (*query.stride(), *key.stride(), *value.stride(), *grad_out.stride(), *dq.stride()),
        scale=masks.args.scale, SPLIT_KEYS=_grad_query_splits_keys(masks.variant, masks.capability),
    )


def _into(target: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """``target`` holding ``result``, which a kernel wrote with its last dim possibly zero-padded
    (see ``_aligned``): ``result`` itself when it is ``target``."""
    return target if result is target else target.copy_(result[..., : target.shape[-1]])


def _writable(target: torch.Tensor, width: int) -> torch.Tensor:
    """What a kernel writes for ``target``, whose input ``_aligned`` gave head dim ``width``:
    ``target`` itself when it has that width and is aligned, else a contiguous buffer."""
    if target.shape[-1] == width and _is_aligned(target):
        return target
    return target.new_empty((*target.shape[:-1], width))


def empty_saved(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, args: AttentionArgs, needs_backward: bool):
    """The forward keeps the row log-sum-exps for the backward pass, whether or not one runs."""
    return empty_lse(query)


def forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, args: AttentionArgs, needs_backward: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash-attention forward: ``out`` and ``lse`` (+inf on rows that see no key) in the layouts
    of :func:`~transformer_kernels.ops.attention.empty_output` and ``empty_lse``."""
    out, lse = empty_output(query, value), empty_lse(query)
    if args.scale <= 0.0:
        # The kernel scales each row's maximum score and the -inf of excluded keys, which needs a
        # scale > 0.  -query with -scale gives the same scores, and a zero scale gives what a
        # zeroed query (inf and NaN propagate alike) with scale 1 does.  Copies, for rare calls;
        # the backward, which scales neither, runs on the call as it is.
        negative = args.scale < 0.0
        query = -query if negative else query * 0.0
        args = dataclasses.replace(args, scale=-args.scale if negative else 1.0)
    query, key, value = _aligned(query), _aligned(key), _aligned(value)
    padded_out = _writable(out, value.shape[-1])
    masks = _Masks.of(args, query.device)
    run_launches([*_key_bounds_launches(masks), *_forward_launches(query, key, value, padded_out, lse, masks)], query)
    return _into(out, padded_out), lse


def prepare_forward(query, key, value, args: AttentionArgs, needs_backward: bool) -> Optional["_PreparedForward"]:
    """:func:`forward` prepared for the calls of this one's layout (see :class:`_PreparedForward`), or
    None where a call of it would copy an input: an unaligned layout, a mask without unit stride, a
    scale <= 0."""
    padding = args.key_padding_mask
    if (
        args.scale <= 0.0 or args.attn_mask is not None or (padding is not None and padding.stride(-1) != 1)
        or not all(_is_aligned(t) for t in (query, key, value, empty_output(query, value)))
    ):
        return None
    return _PreparedForward(query, key, value, args)


class _PreparedForward:
    """:func:`forward` for the calls of one layout: its tensors' shapes, strides, dtypes and device,
    the masks' layout and the scalars, which the caller's call plan holds fixed
    (``ops/_call_plans.py``); the inputs and the key padding mask have the layouts the kernels take
    as they are.

    The first call works out the launch templates; a later call allocates its outputs and puts its
    tensors into them, or, if an address is not 16-byte aligned or the tile table was swapped (as
    the tile sweep does), runs :func:`forward`.  What :func:`forward` does besides, each tensor's
    layout checked, the masks' arguments and the tile configuration worked out and the templates
    looked up by layout, is host time on every call at the seeds' short sequences.  With
    ``LaunchTemplates.verify`` set (the test suite sets it), every call also builds its launches
    as :func:`forward` would, and fails unless they are the same."""

    __slots__ = ("key_bounds", "forward", "capability", "block_config", "out_layout", "lse_layout",
                 "prepared_backward")

    def __init__(self, query, key, value, args: AttentionArgs) -> None:
        masks = _Masks.of(args, query.device)
        out, lse = empty_output(query, value), empty_lse(query)
        self.key_bounds = () if masks.key_bounds is None else _key_bounds_template(masks)
        self.forward = _forward_template(query, key, value, out, lse, masks)
        self.capability, self.block_config = masks.capability, block_config
        # empty_output's and empty_lse's results, made again from their layouts: 2 of the 5 us
        # those take per call go to working the layouts out.
        self.out_layout, self.lse_layout = TensorLayout.of(out), TensorLayout.of(lse)
        self.prepared_backward: Optional[_PreparedBackward] = None

    def __call__(self, query, key, value, args: AttentionArgs, needs_backward: bool, backend: str):
        """The registered op's implementation for this layout (same signature)."""
        if not _kept_launches_serve(self.block_config, query, key, value):
            return forward(query, key, value, args, needs_backward)
        # What this allocates is aligned (allocators hand out aligned blocks), in layouts checked once.
        out, lse = self.out_layout.empty(), self.lse_layout.empty()
        padding = args.key_padding_mask
        bounds, launches = self.key_bounds_launches(padding)
        launches += filled(self.forward, (query, key, value, out, lse, padding, bounds, None), _call_kwargs(args))
        if LaunchTemplates.verify:
            masks = _Masks(args, bounds, self.capability)
            expected = [*_key_bounds_launches(masks), *_forward_launches(query, key, value, out, lse, masks)]
            check_prepared_launches(launches, expected, "attention forward")
        run_launches(launches, query)
        return out, lse

    def backward(self, grad_out, query, key, value, out, lse, args: AttentionArgs, attn_mask_needs_grad: bool,
                 backend: str):
        """The registered backward's implementation (same signature) for the calls this forward
        ran, which the op's autograd hands it (``ctx.runner``): :class:`_PreparedBackward`, made
        for the first of them, where the later ones' ``grad_out`` has its layout, else
        :func:`backward`."""
        prepared = self.prepared_backward
        if prepared is None and _is_aligned(grad_out):
            prepared = _PreparedBackward(self, grad_out, query, key, value, out, lse, args)
            self.prepared_backward = prepared
        if prepared is None or not prepared.takes(grad_out):
            return backward(grad_out, query, key, value, out, lse, args, attn_mask_needs_grad)
        return prepared(grad_out, query, key, value, out, lse, args)

    def key_bounds_launches(self, padding: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], list]:
        """A call's key bounds (:func:`_empty_key_bounds`) and the launch filling them, from the kept
        template (none without bounds): what this forward and its prepared backward run first."""
        bounds = _empty_key_bounds(padding)
        return bounds, [] if bounds is None else filled(self.key_bounds, (padding, bounds), {})


def _kept_launches_serve(kept_block_config: Callable, *tensors: torch.Tensor) -> bool:
    """Whether a prepared call's kept launches serve a call of its layout on ``tensors``: each address
    16-byte aligned (plain eager tensors: their data pointers; what the call allocates is aligned),
    and the tile table (``block_config``) the one they were built from, which the tile sweep swaps."""
    addresses = 0
    for tensor in tensors:
        addresses |= tensor.data_ptr()
    return addresses % 16 == 0 and block_config is kept_block_config


class _PreparedBackward:
    """:func:`backward` for the calls of one layout, those of a :class:`_PreparedForward` (inputs,
    masks and scalars fixed, no ``attn_mask``) whose ``grad_out`` has the layout of the first one's
    (aligned as the kernels take it): the launch templates of its kernels (the key bounds' are the
    forward's) and the layouts of what it allocates, worked out once.  A call whose addresses are
    off 16 bytes, or that meets a swapped tile table (as the tile sweep does), runs
    :func:`backward`.  Under ``LaunchTemplates.verify`` every call also builds its launches as
    :func:`backward` would, and fails unless they are the same."""

    __slots__ = ("prepared_forward", "grad_out_layout", "delta", "grad_key_value", "grad_query", "block_config",
                 "grad_layouts", "delta_layout")

    def __init__(self, prepared_forward: _PreparedForward, grad_out, query, key, value, out, lse,
                 args: AttentionArgs) -> None:
        masks = _Masks.of(args, query.device)
        dq, dk, dv = empty_grads(query, key, value)
        delta = torch.empty_like(lse)
        self.prepared_forward = prepared_forward  # its key bounds template and capability serve here too
        self.grad_out_layout = strided_layout(grad_out)
        self.delta = _delta_template(grad_out, out, delta)
        self.grad_key_value = _grad_key_value_templates(query, key, value, grad_out, lse, delta, dk, dv, None, masks)
        self.grad_query = _grad_query_template(query, key, value, grad_out, lse, delta, dq, masks)
        self.block_config = block_config
        self.grad_layouts = tuple(TensorLayout.of(grad) for grad in (dq, dk, dv))
        self.delta_layout = TensorLayout.of(delta)

    def takes(self, grad_out: torch.Tensor) -> bool:
        return strided_layout(grad_out) == self.grad_out_layout

    def __call__(self, grad_out, query, key, value, out, lse, args: AttentionArgs):
        if not _kept_launches_serve(self.block_config, grad_out, query, key, value, out):
            return backward(grad_out, query, key, value, out, lse, args, False)
        # What this allocates is aligned (allocators hand out aligned blocks), in layouts checked once.
        dq, dk, dv = (layout.empty() for layout in self.grad_layouts)
        delta = self.delta_layout.empty()
        padding = args.key_padding_mask
        bounds, launches = self.prepared_forward.key_bounds_launches(padding)
        call_kwargs = _call_kwargs(args)
        launches += filled(self.delta, (grad_out, out, delta), {})
        pointers = (query, key, value, grad_out, lse, delta, dk, dv, None, padding, bounds, None)
        for template in self.grad_key_value:
            launches += filled(template, pointers, call_kwargs)
        launches += filled(self.grad_query, (query, key, value, grad_out, lse, delta, dq, padding, bounds, None),
                           call_kwargs)
        if LaunchTemplates.verify:
            masks = _Masks(args, bounds, self.prepared_forward.capability)
            expected = [
                *_key_bounds_launches(masks), *_delta_launches(grad_out, out, delta),
                *_grad_key_value_launches(query, key, value, grad_out, lse, delta, dk, dv, None, masks),
                *_grad_query_launches(query, key, value, grad_out, lse, delta, dq, masks),
            ]
            check_prepared_launches(launches, expected, "attention backward")
        run_launches(launches, query)
        return dq, dk, dv, query.new_empty(0, dtype=torch.float32)


def backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    args: AttentionArgs,
    attn_mask_needs_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flash-attention backward: ``dq, dk, dv`` in the layouts of
    :func:`~transformer_kernels.ops.attention.empty_grads` (GQA heads summed into their kv head)
    and ``dmask``, the float32 ``[B, Hq, Lq, Lk]`` gradient of the scaled, masked scores when
    ``attn_mask_needs_grad`` (else an empty tensor)."""
    grads = empty_grads(query, key, value)
    grad_out, query, key, value, out = (_aligned(t) for t in (grad_out, query, key, value, out))
    dq, dk, dv = (_writable(grad, aligned.shape[-1]) for grad, aligned in zip(grads, (query, key, value)))
    batch, num_q_heads, seq_len_q, _ = query.shape
    delta = torch.empty_like(lse)
    grad_scores = None
    if attn_mask_needs_grad:
        # Entries the kernels skip (above the diagonal, padded key blocks) have dS = 0.
        grad_scores = query.new_zeros((batch, num_q_heads, seq_len_q, key.shape[2]), dtype=torch.float32)
    masks = _Masks.of(args, query.device)
    run_launches(
        [
            *_key_bounds_launches(masks),
            *_delta_launches(grad_out, out, delta),
            *_grad_key_value_launches(query, key, value, grad_out, lse, delta, dk, dv, grad_scores, masks),
            *_grad_query_launches(query, key, value, grad_out, lse, delta, dq, masks),
        ],
        query,
    )
    if grad_scores is None:
        grad_scores = query.new_empty(0, dtype=torch.float32)
    return (*(_into(grad, result) for grad, result in zip(grads, (dq, dk, dv))), grad_scores)


# ---------------------------------------------------------------------------
# Compile targets
# ---------------------------------------------------------------------------

# The representative problem compiled for every target: grouped-query heads,
# lengths and head dims that are multiples of the tiles.  The kernels
# specialize on no argument value (see ``_kernel``), so the shape matters only
# through the table entry it selects.
_TARGET_BATCH, _TARGET_HEADS, _TARGET_KV_HEADS, _TARGET_LENGTH = 2, 4, 2, 256


# Representative switches per compile target: which of causal (bottom-right),
# key padding and "all" (also a float mask whose gradient is stored, and
# dropout) are on.
_TARGET_VARIANTS = {
    "dense": (False, False, False),
    "causal_padding": (True, True, False),
    "all_masks": (True, True, True),
}


def _target_launch(
    kernel_name: str, head_dim: int, dtype: torch.dtype, variant: str, length: int, key_length: int,
    capability: Optional[int], index: int = 0,
) -> KernelLaunch:
    """The launch (the ``index``-th of its kernel's, for dK/dV in passes) the backend makes on a GPU
    of compute ``capability`` for the representative problem with the switches of ``variant`` (a
    key of ``_TARGET_VARIANTS``), queries ``length`` and keys ``key_length`` long (with key
    padding, keys that short go without key bounds: ``_BOUNDED_KEYS_FROM``)."""
    causal, padded, all_masks = _TARGET_VARIANTS[variant]
    batch, heads, kv_heads = _TARGET_BATCH, _TARGET_HEADS, _TARGET_KV_HEADS
    query, grad_out, out, dq = (torch.empty(batch, heads, length, head_dim, dtype=dtype) for _ in range(4))
    key, value, dk, dv = (torch.empty(batch, kv_heads, key_length, head_dim, dtype=dtype) for _ in range(4))
    lse, delta = (torch.empty(batch, heads, length) for _ in range(2))
    key_padding_mask = key_bounds = attn_mask = grad_scores = None
    if padded:
        key_padding_mask = torch.zeros(batch, key_length, dtype=torch.bool)
        if key_length >= _BOUNDED_KEYS_FROM:
            key_bounds = torch.tensor([[0, key_length, key_length]] * batch, dtype=torch.int32)
    dropout_p, dropout_seed = 0.0, None
    if all_masks:
        attn_mask = torch.empty(batch, 1, length, key_length, dtype=dtype).expand(batch, heads, length, key_length)
        grad_scores = torch.empty(batch, heads, length, key_length)
        dropout_p, dropout_seed = 0.1, torch.tensor([1234567, 89], dtype=torch.int64)
    masks = _Masks(
        AttentionArgs(
            key_padding_mask, attn_mask, Causal.BOTTOM_RIGHT if causal else Causal.NONE, head_dim**-0.5,
            dropout_p, dropout_seed,
        ),
        key_bounds,
        capability,
    )
    if kernel_name == "forward":
        launches = _forward_launches(query, key, value, out, lse, masks)
    elif kernel_name == "grad_key_value":
        launches = _grad_key_value_launches(query, key, value, grad_out, lse, delta, dk, dv, grad_scores, masks)
    elif kernel_name == "grad_query":
        launches = _grad_query_launches(query, key, value, grad_out, lse, delta, dq, masks)
    elif kernel_name == "key_bounds":
        launches = _key_bounds_launches(masks)
    else:
        launches = _delta_launches(grad_out, out, delta)
    return launches[index]


# Which problems the compile targets stand for, each with the heaviest
# switches its table can be chosen with (lighter switches only remove code):
# (table variant, dtype, target switches, query length, key length, name
# suffix).  DENSE and FAST/SHORT compile in bfloat16, MASKED in float16, so
# both 16-bit types are covered.  Key padding compiles with key bounds and,
# for keys too short for them (queries longer: cross-attention), without.
_TARGET_PROBLEMS = (
    ("dense", torch.bfloat16, "dense", _TARGET_LENGTH, _TARGET_LENGTH, ""),
    ("fast", torch.bfloat16, "causal_padding", _TARGET_LENGTH, _TARGET_LENGTH, ""),
    ("fast", torch.bfloat16, "causal_padding", _TARGET_LENGTH, SHORT_MAX_LENGTH, "_short_keys"),
    ("fast", torch.bfloat16, "causal_padding", SHORT_MAX_LENGTH, SHORT_MAX_LENGTH, "_short"),
    ("masked", torch.float16, "all_masks", _TARGET_LENGTH, _TARGET_LENGTH, ""),
    ("masked", torch.float16, "all_masks", _TARGET_LENGTH, SHORT_MAX_LENGTH, "_short_keys"),
    ("masked", torch.float32, "all_masks", _TARGET_LENGTH, _TARGET_LENGTH, ""),
    ("masked", torch.float32, "all_masks", _TARGET_LENGTH, SHORT_MAX_LENGTH, "_short_keys"),
)


def compile_targets() -> list[CompileTarget]:
    """Every configuration the dispatcher can choose, on each architecture the
    one ``block_config`` picks there (``_table_config``): DENSE configs with no switch, FAST and
    SHORT ones with bottom-right causal and key padding, MASKED and FLOAT32
    ones with every switch on (bottom-right causal, key padding, float mask,
    dropout, dS store), key padding with key bounds and, for keys too short for them, without
    (``_short_keys``; SHORT ones always without).  A SHORT target only where the SHORT table, or
    the SM90 table's "short" entries, have one."""
    targets = []
    kernels_and_buckets = list(itertools.product(("forward", "grad_key_value", "grad_query"), (64, 128, 256)))
    for (variant, dtype, switches, length, key_length, suffix), (kernel_name, bucket) in itertools.product(
        _TARGET_PROBLEMS, kernels_and_buckets
    ):
        if length <= SHORT_MAX_LENGTH:
            if (kernel_name, bucket) not in _SHORT_CONFIGS and ("short", kernel_name, bucket) not in _SM90_CONFIGS:
                continue
        elif (kernel_name, bucket) not in (_FLOAT32_CONFIGS if dtype == torch.float32 else _CONFIG_TABLES[variant]):
            continue
        # Architectures whose launches compile one variant share a target: one configuration and,
        # for dQ, one SPLIT_KEYS.
        by_config: dict[tuple[KernelConfig, bool], list[int]] = {}
        for capability in COMPILE_CAPABILITIES:
            config = _table_config(kernel_name, bucket, dtype, variant, max(length, key_length), capability)
            splits = kernel_name == "grad_query" and _grad_query_splits_keys(variant, capability)
            by_config.setdefault((config, splits), []).append(capability)
        name = f"attention_{kernel_name}_{TORCH_TO_TRITON_DTYPE[dtype]}_d{bucket}_{switches}{suffix}"
        passes = grad_key_value_passes(variant, bucket) if kernel_name == "grad_key_value" else ((True, True),)
        for capabilities in by_config.values():
            for index, (grad_key, grad_value) in enumerate(passes):
                pass_name = "" if len(passes) == 1 else ("_dk" if grad_key else "_dv")
                launch = functools.partial(
                    _target_launch, kernel_name, bucket, dtype, switches, length, key_length, capabilities[0], index
                )
                targets.append(CompileTarget(name + pass_name, launch, tuple(capabilities)))
    for dtype, head_dim in ((torch.bfloat16, 64), (torch.float16, 256)):
        targets.append(CompileTarget(
            f"attention_delta_{TORCH_TO_TRITON_DTYPE[dtype]}_d{head_dim}",
            functools.partial(_target_launch, "delta", head_dim, dtype, "dense", _TARGET_LENGTH, _TARGET_LENGTH, None),
        ))
    targets.append(CompileTarget(
        "attention_key_bounds",
        functools.partial(_target_launch, "key_bounds", 64, torch.float16, "causal_padding", _TARGET_LENGTH,
                          _TARGET_LENGTH, None),
    ))
    return targets
