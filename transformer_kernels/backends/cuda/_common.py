"""What the cuda op modules share: the raw ops and the tensor requirements of their kernels."""

from __future__ import annotations

from typing import Optional

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def raw_ops():
    """``torch.ops.transformer_kernels_C``, the ops ``transformer_kernels._C`` registers."""
    return torch.ops.transformer_kernels_C


def own_tensor(view: torch.Tensor) -> torch.Tensor:
    """``view``'s elements as a tensor of its own over the same memory (no copy), for an op to return
    where it made a view: autograd refuses in-place changes to a view made by an op's forward,
    which torch's own ops' outputs allow."""
    own = torch.empty(0, dtype=view.dtype, device=view.device)
    return own.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())


def dtype_reason(dtype: torch.dtype) -> Optional[str]:
    if dtype not in SUPPORTED_DTYPES:
        return f"the CUDA kernels support float16 and bfloat16, got {dtype} (float32 runs on Triton or eager)"
    return None


# The kernels' offsets within a tensor are 32-bit: a tensor holds fewer elements than this.
MAX_ELEMENTS = 1 << 31


def size_reason(**tensor_sizes: int) -> Optional[str]:
    """Why the kernels cannot address tensors of these sizes (``name=number of elements``), or None."""
    for name, size in tensor_sizes.items():
        if size >= MAX_ELEMENTS:
            return f"the CUDA kernels address fewer than 2**31 elements per tensor, got {size} in {name}"
    return None


def loads_in_chunks(t: torch.Tensor) -> bool:
    """Whether the kernels can read ``t`` in 16-byte chunks as it is: unit stride along the last dim,
    the other strides multiples of 8 elements (of size-1 dims: any), a 16-byte aligned start."""
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        return False
    if any(stride % 8 != 0 and size != 1 for size, stride in zip(t.shape[:-1], t.stride()[:-1])):
        return False
    return t.data_ptr() % 16 == 0


def in_chunks(t: torch.Tensor, contiguous: bool = False) -> torch.Tensor:
    """``t`` itself when the kernels can read it in 16-byte chunks as it is (:func:`loads_in_chunks`;
    with ``contiguous``, contiguous with an aligned start, for the kernels that read it as one run),
    else a contiguous copy, a fresh allocation and so aligned (``t.contiguous()`` would return a
    contiguous view into a larger buffer as it is, aligned or not)."""
    readable = t.is_contiguous() and t.data_ptr() % 16 == 0 if contiguous else loads_in_chunks(t)
    return t if readable else t.clone(memory_format=torch.contiguous_format)
