"""What the cuda op modules share: the raw ops and the tensor requirements of their kernels."""

from __future__ import annotations

from typing import Optional

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def raw_ops():
    """``torch.ops.transformer_kernels_C``, the ops ``transformer_kernels._C`` registers."""
    return torch.ops.transformer_kernels_C


def dtype_reason(dtype: torch.dtype) -> Optional[str]:
    if dtype not in SUPPORTED_DTYPES:
        return f"the CUDA kernels support float16 and bfloat16, got {dtype} (float32 runs on Triton or eager)"
    return None


def loads_in_chunks(t: torch.Tensor) -> bool:
    """Whether the kernels can read ``t`` in 16-byte chunks as it is: unit stride along the last dim,
    the other strides multiples of 8 elements (of size-1 dims: any), a 16-byte aligned start."""
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        return False
    if any(stride % 8 != 0 and size != 1 for size, stride in zip(t.shape[:-1], t.stride()[:-1])):
        return False
    return t.data_ptr() % 16 == 0


def in_chunks(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when :func:`loads_in_chunks`, else a contiguous copy (fresh allocations are aligned)."""
    return t if loads_in_chunks(t) else t.contiguous()
