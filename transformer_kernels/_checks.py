"""Argument checks shared by every op: errors name the argument and what was expected."""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def check_tensor(
    name: str,
    tensor: object,
    *,
    ndim: Optional[int] = None,
    min_ndim: Optional[int] = None,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    floating: bool = False,
) -> torch.Tensor:
    """Check that ``tensor`` is a dense Tensor with the given rank and dtype."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (torch.strided) tensor, got layout {tensor.layout}")
    if tensor.is_nested:  # of layout torch.strided: its shape cannot be read
        raise TypeError(f"{name} must be a dense tensor, got a nested tensor")
    if ndim is not None and tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(tensor.shape)}")
    if min_ndim is not None and tensor.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimensions, got shape {tuple(tensor.shape)}")
    if floating and not tensor.is_floating_point():
        raise TypeError(f"{name} must have a floating-point dtype, got {tensor.dtype}")
    if dtypes is not None and tensor.dtype not in dtypes:
        expected = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({expected}), got {tensor.dtype}")
    return tensor


def check_same_dtype_device(reference_name: str, reference: torch.Tensor, **others: Optional[torch.Tensor]) -> None:
    """Check that every tensor in ``others`` has ``reference``'s dtype and device."""
    for name, tensor in others.items():
        if tensor is None:
            continue
        if tensor.device != reference.device:
            raise ValueError(
                f"{name} must be on the same device as {reference_name} ({reference.device}), got {tensor.device}"
            )
        if tensor.dtype != reference.dtype:
            raise TypeError(f"{name} must have the same dtype as {reference_name} ({reference.dtype}), got {tensor.dtype}")


def check_same_device(reference_name: str, reference: torch.Tensor, **others: Optional[torch.Tensor]) -> None:
    for name, tensor in others.items():
        if tensor is not None and tensor.device != reference.device:
            raise ValueError(
                f"{name} must be on the same device as {reference_name} ({reference.device}), got {tensor.device}"
            )


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: object, minimum: int) -> None:
    """A TypeError naming ``name`` unless ``value`` is an int (not a bool), a ValueError below ``minimum``."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def machine_device(name: str) -> torch.device:
    """The device ``name`` (``cpu``, ``cuda`` or ``cuda:N``) names, for a command-line option; a
    ValueError saying why where torch does not parse it or this machine lacks it."""
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ValueError(str(error)) from None
    if device.type == "cuda" and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()):
        raise ValueError(f"{name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"expected cpu, cuda or cuda:N, got {name}")
    return device
