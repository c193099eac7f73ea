"""The GLU convolution's decoding step in place: :func:`glu_conv1d_update`.

:func:`~transformer_kernels.glu_conv1d_step` is functional: it convolves ``cat([state, x_t])`` and
returns the new state as a view of that window, so a decoder that keeps its state in one buffer
pays, per layer and step, the ``cat``, the convolution and a copy back.  Here the state is a ring
of ``k`` slots that the backend reads around the new input and writes the new input into, in one
kernel on Triton and on the CUDA extension: input position ``p`` lives in slot ``p % k``.  The slot
the new input takes holds position ``p - k``, which no output of this step reads, so no program of
the kernel overwrites what another still reads.  Inference only, like ``causal_conv1d_update`` (Mamba's), whose in-place
update and ``cache_seqlens`` ring this follows.  Registered as
``torch.ops.transformer_kernels.glu_conv1d_update`` (mutating its ``conv_state``, with a fake
kernel), so it works under ``torch.compile`` and CUDA graphs (the position is read on the device).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from .._backend import backend_module, select_backend
from .._checks import check_same_device, check_tensor
from ._autocast import autocast
from ._call_plans import CallPlans, layout_key
from ._library import RegisteredOp
from .glu_conv import _DTYPES, _check_number, _check_residual, _check_weight_and_bias

__all__ = ["glu_conv1d_update", "GluUpdateArgs"]


@dataclasses.dataclass(frozen=True)
class GluUpdateArgs:
    """The update's arguments besides its tensors."""

    residual_scale: float


def glu_conv1d_update(
    x_t: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    position: torch.Tensor,
    residual: Optional[torch.Tensor] = None,
    residual_scale: float = 1.0,
    backend: Optional[str] = None,
) -> torch.Tensor:
    r"""One decoding step of ``glu_conv1d(..., padding="causal")`` that updates its state in place.

    ``conv_state`` is a ring of the last ``k`` inputs: input position ``p`` is
    ``conv_state[:, :, p % k]``.  The call convolves the ``k - 1`` inputs before
    ``position`` (read from the ring) and ``x_t``, then writes ``x_t`` into slot
    ``position % k``.  Starting from a ring filled with the padding value
    (:meth:`transformer_kernels.nn.GLUConv1d.initial_conv_state`) at position 0,
    steps ``0, 1, ..., L-1`` give the columns of ``glu_conv1d(x, weight, bias,
    padding="causal", pad_value=..., residual=residual, residual_scale=residual_scale)``,
    as :func:`glu_conv1d_step` does, without the window's ``cat`` and the copy of
    the new state: on Triton one kernel reads the ring and ``x_t``, writes the
    output and stores ``x_t`` into the ring.

    Args:
        x_t: ``[B, C_in]``, the input at ``position``.
        conv_state: ``[B, C_in, k]``, the ring (any strides), written in place; it
            must not overlap ``x_t`` or ``residual``.  For beam search reorder it
            with ``conv_state.copy_(conv_state.index_select(0, beams))``.
        weight: ``[2*C, C_in, k]`` as in :func:`glu_conv1d`.
        bias: ``[2*C]`` or ``None``.
        position: an integer tensor on ``x_t``'s device, 0-dim (every row at the
            same position) or ``[B]`` (a position per row): the non-negative
            position of ``x_t`` in its sequence.  Read on the device, so a CUDA
            graph that captures the call reads the position of each replay.
        residual: ``[B, C]`` or ``None``; residual_scale: as in :func:`glu_conv1d`.
        backend: as in :func:`glu_conv1d`.  The cuda backend's kernel takes a
            contiguous ``conv_state`` with a 16-byte aligned start, of float16 or
            bfloat16, with ``C_in * k`` a multiple of 8 (it writes the ring in
            place, so it never takes a copy of it).

    Returns:
        ``out_t`` ``[B, C]``.

    Under ``torch.autocast`` it computes in the autocast dtype, as
    :func:`glu_conv1d_step` does; a ``conv_state`` of another dtype is then read
    cast and written back (two copies of the ring a call: keep the ring in the
    autocast dtype to avoid them).

    Not differentiable: for gradients use :func:`glu_conv1d_step`.  Raises
    ``RuntimeError`` where autograd would have to record the call.
    """
    caller_state = conv_state
    x_t, conv_state, weight, bias, residual = autocast(x_t, x_t, conv_state, weight, bias, residual)

    def checked() -> tuple[GluUpdateArgs, str]:
        check_tensor("x_t", x_t, ndim=2, dtypes=_DTYPES)
        channels_out, kernel_size = _check_weight_and_bias(x_t, weight, bias, "x_t")
        batch, channels_in = x_t.shape
        check_tensor("conv_state", conv_state, ndim=3)
        if tuple(conv_state.shape) != (batch, channels_in, kernel_size):
            raise ValueError(f"conv_state must have shape [B, C_in, k] = {[batch, channels_in, kernel_size]}, "
                             f"got {tuple(conv_state.shape)}")
        if any(stride == 0 and size > 1 for size, stride in zip(conv_state.shape, conv_state.stride())):
            raise RuntimeError("conv_state is expanded (a stride of 0: elements share memory), so it cannot be "
                               "written in place")
        if conv_state.dtype != x_t.dtype:
            raise TypeError(f"conv_state must have the same dtype as x_t ({x_t.dtype}), got {conv_state.dtype}")
        check_tensor("position", position, dtypes=(torch.int32, torch.int64))
        if position.shape not in ((), (batch,)):
            raise ValueError(f"position must have shape [] or [B] = [{batch}], got {tuple(position.shape)}")
        check_same_device("x_t", x_t, conv_state=conv_state, position=position)
        _check_residual(residual, (batch, channels_out), "x_t", x_t)
        args = GluUpdateArgs(_check_number("residual_scale", residual_scale))
        return args, select_backend("glu_conv_update", "glu_conv1d_update", backend, x_t, x_t, conv_state, position,
                                    weight, bias, residual, args)

    key = layout_key(backend, x_t, conv_state, position, weight, bias, residual)
    if key is not None and type(residual_scale) is float and residual_scale == residual_scale:
        key = (*key, residual_scale, math.copysign(1.0, residual_scale))  # the sign tells 0.0 from -0.0
    else:  # no plan: a scalar the checks convert, or NaN (which no key equals)
        key = None
    args, name = _PLANS.decide(key, checked, lambda _: None)[0]
    tensors = (x_t, conv_state, weight, bias, residual)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError("glu_conv1d_update is not differentiable (it updates conv_state in place): use "
                           "glu_conv1d_step for gradients, or call it under torch.no_grad()")
    out = glu_conv1d_update_op(x_t, conv_state, position, weight, bias, residual, args, name)
    if conv_state is not caller_state:  # autocast cast the ring (a copy): the update goes to the caller's
        caller_state.copy_(conv_state)
    return out


# glu_conv1d_update's checked decisions (GluUpdateArgs and backend) per call layout (_call_plans.py).
_PLANS = CallPlans()


glu_conv1d_update_op = RegisteredOp(
    "glu_conv1d_update",
    ("Tensor x_t", "Tensor(a!) conv_state", "Tensor position", "Tensor weight", "Tensor? bias", "Tensor? residual"),
    GluUpdateArgs, "Tensor",
)


@glu_conv1d_update_op.implement
def _glu_conv1d_update(x_t, conv_state, position, weight, bias, residual, args: GluUpdateArgs, backend: str):
    out = backend_module("glu_conv_update", backend).forward(x_t, conv_state, position, weight, bias, residual, args)
    # A kernel's write is no torch op: the version counter says that conv_state changed, so that
    # autograd refuses a backward that saved it before (as torch's own in-place ops make it).
    torch.autograd.graph.increment_version(conv_state)
    return out


@glu_conv1d_update_op.fake
def _glu_conv1d_update_fake(x_t, conv_state, position, weight, bias, residual, args: GluUpdateArgs, backend: str):
    return x_t.new_empty(x_t.shape[0], weight.shape[0] // 2)
