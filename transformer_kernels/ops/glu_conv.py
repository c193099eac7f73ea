"""Fused GLU convolution of convolutional seq2seq models (Gehring et al., 2017).

One call computes ``conv1d`` + bias + ``F.glu`` + residual and scale, forward
and backward, plus :func:`glu_conv1d_step` for one-position-at-a-time
decoding.  Registered as ``torch.ops.transformer_kernels.glu_conv1d_forward``
(with a fake kernel and autograd through ``glu_conv1d_backward``) so it works
under ``torch.compile``.  The op's contract (:class:`GluConvArgs`, the output
layout :func:`empty_output`) comes first, then the public functions, their
checks and the registered ops.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Callable, Optional

import torch

from .._backend import backend_module, select_backend
from .._checks import check_same_dtype_device, check_tensor
from ._autocast import autocast
from ._call_plans import CallPlans, layout_key, prepared_forward
from ._library import RegisteredOp

__all__ = ["glu_conv1d", "glu_conv1d_step", "GluConvArgs"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_PADDINGS = ("same", "causal")


# --------------------------------------------------------------------------- the op's contract


@dataclasses.dataclass(frozen=True)
class GluConvArgs:
    """A GLU convolution's arguments besides its tensors: ``pad_left``/``pad_right`` positions of
    ``pad_value`` around ``x`` (explicit, so one op serves "same", "causal" and the unpadded
    window of :func:`glu_conv1d_step`), and ``residual_scale``.

    ``timed_choices``: whether the backend may choose how to compute the call by timing the ways
    on this machine (the eager backend does).  The public functions set it for plain eager calls
    only: a call that torch traces (torch.compile, export, a dispatch mode, a functorch transform)
    takes a fixed rule that depends on nothing measured, so that the layouts its fake kernel
    states are the real ones in every process that runs the traced graph, whatever sizes it
    meets.  A timed choice is kept per process and size class, so within one process a fake
    kernel of fixed sizes states the real layouts either way.
    """

    pad_left: int
    pad_right: int
    pad_value: float
    residual_scale: float
    timed_choices: bool = False

    def output_length(self, length_in: int, kernel_size: int) -> int:
        return self.pad_left + length_in + self.pad_right - kernel_size + 1

    def untimed(self) -> "GluConvArgs":
        return dataclasses.replace(self, timed_choices=False)


def is_channels_last(x: torch.Tensor) -> bool:
    """``x`` ``[B, C, L]`` is a contiguous ``[B, L, C]`` transposed (and not also contiguous)."""
    return not x.is_contiguous() and x.transpose(1, 2).is_contiguous()


def results_in_x_layout(x: torch.Tensor, weight: torch.Tensor, args: GluConvArgs, direction: str) -> bool:
    """``results_channel_last`` of a backend whose kernels read and write any strides: whether the
    output (``direction="forward"``) and ``grad_x`` (``"backward"``) are channel-last is whether
    ``x`` is."""
    return is_channels_last(x)


def empty_output(x: torch.Tensor, channels: int, length: int, channel_last: Optional[bool] = None) -> torch.Tensor:
    """An uninitialized ``[B, channels, length]`` tensor, channel-last when ``channel_last``, else
    contiguous; by default in ``x``'s memory layout.  Every backend returns its output and
    ``grad_x`` in the layout its ``results_channel_last`` states.  Not a view (of a transposed
    tensor): autograd refuses in-place changes to a view that an op's forward made."""
    batch = x.shape[0]
    if is_channels_last(x) if channel_last is None else channel_last:
        return torch.empty_strided((batch, channels, length), (length * channels, 1, channels), dtype=x.dtype,
                                   device=x.device)
    return x.new_empty(batch, channels, length)


# --------------------------------------------------------------------------- public functions


def glu_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    padding: str = "same",
    pad_value: float = 0.0,
    residual: Optional[torch.Tensor] = None,
    residual_scale: float = 1.0,
    backend: Optional[str] = None,
) -> torch.Tensor:
    r"""Convolution, GLU, residual and scale of one convolutional seq2seq layer, fused::

        z   = conv1d(pad(x, padding, pad_value), weight, bias)      # [B, 2*C, L]
        out = (F.glu(z, dim=1) + residual) * residual_scale           # [B, C, L]

    ``F.glu(z, dim=1)`` is ``z[:, :C] * sigmoid(z[:, C:])``.  The Triton forward
    kernel computes both halves of ``z`` in one program and never writes ``z``.

    Args:
        x: ``[B, C_in, L]`` as ``nn.Conv1d`` takes it, ``L >= 1``.  Either
            contiguous or channel-last (a contiguous ``[B, L, C_in]`` tensor
            transposed with ``.transpose(1, 2)``); on the GPU a channel-last
            ``x`` is read in place, without a copy, and the output is
            channel-last too, so a model can keep activations as ``[B, L, C]``
            and drop its permutes.  Any other strides work too (the Triton
            kernels read them in place); the output is then contiguous.
        weight: ``[2*C, C_in, k]``, ``k >= 1``, exactly as ``nn.Conv1d(C_in, 2*C, k)``
            holds it.  May come from a parametrization such as
            ``torch.nn.utils.parametrizations.weight_norm``; gradients then reach
            its parameters (``original0`` / ``original1``) through autograd.
        bias: ``[2*C]`` or ``None``.
        padding: ``"same"``: ``(k - 1) // 2`` positions before ``x`` and ``k // 2``
            after it (for odd ``k`` this is ``nn.Conv1d(..., padding=(k - 1) // 2)``;
            even ``k`` puts the extra position on the right, as fairseq does).
            ``"causal"``: ``k - 1`` positions before ``x`` and none after, so output
            position ``t`` sees inputs ``t - k + 1 .. t`` only (the decoder).
        pad_value: the value of every padding position, in both modes.  ``0.0``
            is ``nn.Conv1d``'s zero padding; the seq2seq decoder fills its left
            padding with the target pad index (e.g. ``pad_value=1.0``).  A finite
            value must fit the computation's dtype (float16: up to 65504), as
            ``F.pad`` requires; infinities and NaN pad as they are.
        residual: ``[B, C, L]`` (any strides) added to the GLU output, or ``None``
            (the same as zeros).
        residual_scale: multiplies ``glu + residual``; it applies whether or not
            ``residual`` is given (``residual=None`` means adding zero), so
            ``residual_scale=1.0`` (the default) leaves the sum unchanged.  The
            seq2seq encoder passes ``residual=x, residual_scale=math.sqrt(0.5)``;
            its decoder, whose residual comes after attention, passes neither.
            A Python number (not a tensor).
        backend: ``"auto"``, ``"triton"``, ``"cuda"`` or ``"eager"``; ``None``
            follows :func:`transformer_kernels.use_backend` and the
            ``TRANSFORMER_KERNELS_BACKEND`` environment variable.  ``"auto"``
            runs CPU tensors on eager, and CUDA tensors on the CUDA extension
            where it is built and preferred on the GPU's architecture (README,
            "Backends"), else on Triton, else on eager.

    Returns:
        ``[B, C, L]`` with ``x``'s dtype, channel-last if ``x`` is channel-last,
        except where the eager backend convolves with oneDNN (a CPU, float32,
        past a few positions): there the output and ``x``'s gradient are
        contiguous, as ``nn.Conv1d``'s are, since oneDNN's convolutions write
        and read that layout (a channel-last result would cost a transposing
        copy here and another in the next layer's convolution).

    Dtypes: float16, bfloat16, float32 (and float64 on the eager backend); all
    tensors share ``x``'s dtype and device.  Under ``torch.autocast`` the op
    runs in the autocast dtype the way ``nn.Conv1d`` does: float16/bfloat16/
    float32 tensors (``residual`` too) are cast to it, float64 ones are not.
    The Triton kernels accumulate in float32 and round once, at the output.

    Autograd: gradients for ``x``, ``weight``, ``bias`` and ``residual``
    (``grad_residual = grad_out * residual_scale``), deterministic (no atomics);
    not twice differentiable.  Padding positions take no gradient.
    Saved for backward: ``x``, ``weight`` and ``bias`` themselves (no copies).
    The Triton backend keeps only the weight in its kernels' layout
    ``[k, C_in, 2*C]`` (the size of ``weight``, packed once per step instead of
    twice): backward recomputes the pre-activation from ``x`` (one extra GEMM
    instead of a ``[B, 2*C, L]`` tensor per layer; the pre-activation's
    gradient ``[B, 2*C, L]`` exists only while backward runs).  The eager backend also keeps its pre-activation
    ``[B, L, 2*C]``, as ``nn.Conv1d`` + ``F.glu`` keep theirs, because on a CPU
    recomputing the convolution would cost more than the memory saves.
    Where the eager backend convolves with oneDNN both ways and its backward
    is the kernels of torch's own ops (float32 on a CPU, past a few hundred
    positions, outside ``torch.compile`` and dispatch modes), autograd records
    ``F.conv1d``, ``F.glu``, the add and the multiply themselves, as in the
    seed's layer, whose C++ nodes cost the host less than this op's Python
    backward: ``grad_fn`` is then torch's, and causal or non-zero padding
    saves a padded copy of ``x``, as the seed's ``F.pad`` does.
    """
    x, weight, bias, residual = autocast(x, x, weight, bias, residual)

    def checked() -> tuple[GluConvArgs, str]:
        check_tensor("x", x, ndim=3, dtypes=_DTYPES)
        channels_out, kernel_size = _check_weight_and_bias(x, weight, bias, "x")
        if padding not in _PADDINGS:
            raise ValueError(f"padding must be one of {_PADDINGS}, got {padding!r}")
        if x.shape[2] < 1:
            raise ValueError(f"x must have at least one position (L >= 1), got shape {tuple(x.shape)}")
        scalars = _check_pad_value(pad_value, x.dtype), _check_number("residual_scale", residual_scale)
        _check_residual(residual, (x.shape[0], channels_out, x.shape[2]), "x", x)
        pads = ((kernel_size - 1) // 2, kernel_size // 2) if padding == "same" else (kernel_size - 1, 0)
        args = GluConvArgs(*pads, *scalars, timed_choices=True)
        return args, select_backend("glu_conv", "glu_conv1d", backend, x, x, weight, bias, residual, args)

    (args, name), forward = _PLANS.decide(
        _plan_key((x, weight, bias, residual), padding, pad_value, residual_scale, backend), checked,
        lambda decision: _prepared_forward(decision, x, weight, bias, residual),
    )
    out, _ = glu_conv1d_forward.call_planned(forward, x, weight, bias, residual, _traced_untimed(forward, args),
                                             name)
    return out


def glu_conv1d_step(
    x_t: torch.Tensor,
    state: Optional[torch.Tensor],
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    pad_value: float = 0.0,
    residual: Optional[torch.Tensor] = None,
    residual_scale: float = 1.0,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""One decoding step of ``glu_conv1d(..., padding="causal")``.

    Feeding positions ``0, 1, ..., L-1`` one call at a time, each call getting
    the ``new_state`` of the previous one (the first getting ``state=None``),
    gives the columns of ``glu_conv1d(x, weight, bias, padding="causal",
    pad_value=pad_value, residual=residual, residual_scale=residual_scale)``
    (step ``t`` taking ``x[:, :, t]`` and ``residual[:, :, t]``).

    Args:
        x_t: ``[B, C_in]``, the input at the new position.
        state: ``[B, C_in, k - 1]``, the inputs at the ``k - 1`` previous
            positions, oldest first; or ``None`` for the first step, which
            starts from ``k - 1`` positions of ``pad_value`` (the causal
            padding).  A plain tensor: reorder it for beam search with
            ``state.index_select(0, beam_indices)``.
        weight: ``[2*C, C_in, k]`` as in :func:`glu_conv1d`.
        bias: ``[2*C]`` or ``None``.
        pad_value: fills the initial state when ``state`` is ``None``.
        residual: ``[B, C]`` or ``None``; residual_scale: as in :func:`glu_conv1d`.
        backend: as in :func:`glu_conv1d`.

    Returns:
        ``(out_t, new_state)``: ``out_t`` ``[B, C]``; ``new_state``
        ``[B, C_in, k - 1]`` holding the last ``k - 1`` inputs including ``x_t``.

    Differentiable like :func:`glu_conv1d`.
    """
    x_t, state, weight, bias, residual = autocast(x_t, x_t, state, weight, bias, residual)

    def checked() -> tuple[GluConvArgs, str]:
        check_tensor("x_t", x_t, ndim=2, dtypes=_DTYPES)
        channels_out, kernel_size = _check_weight_and_bias(x_t, weight, bias, "x_t")
        scalars = _check_pad_value(pad_value, x_t.dtype), _check_number("residual_scale", residual_scale)
        batch, channels_in = x_t.shape
        state_shape = (batch, channels_in, kernel_size - 1)
        if state is not None:
            check_tensor("state", state, ndim=3)
            if tuple(state.shape) != state_shape:
                raise ValueError(
                    f"state must have shape [B, C_in, k - 1] = {list(state_shape)}, got {tuple(state.shape)}"
                )
            check_same_dtype_device("x_t", x_t, state=state)
        _check_residual(residual, (batch, channels_out), "x_t", x_t)
        args = GluConvArgs(0, 0, *scalars, timed_choices=True)
        window = _empty_window(x_t, weight)
        return args, select_backend("glu_conv", "glu_conv1d_step", backend, window, window, weight, bias,
                                    None if residual is None else residual.unsqueeze(2), args)

    (args, name), forward = _PLANS.decide(
        _plan_key((x_t, state, weight, bias, residual), "step", pad_value, residual_scale, backend), checked,
        lambda decision: _prepared_forward(decision, _empty_window(x_t, weight), weight, bias,
                                           None if residual is None else residual.unsqueeze(2)),
    )
    if state is None:
        state = x_t.new_full((*x_t.shape, weight.shape[2] - 1), args.pad_value)
    window = torch.cat([state, x_t.unsqueeze(2)], dim=2)
    residual = None if residual is None else residual.unsqueeze(2)
    out, _ = glu_conv1d_forward.call_planned(forward, window, weight, bias, residual,
                                             _traced_untimed(forward, args), name)
    return out.squeeze(2), window[:, :, 1:]


# --------------------------------------------------------------------------- call plans

# glu_conv1d's and glu_conv1d_step's checked decisions (GluConvArgs and backend) per call layout
# (_call_plans.py); the padding ("step" for a step) is in every key.
_PLANS = CallPlans()


def _prepared_forward(decision: tuple[GluConvArgs, str], x, weight, bias, residual) -> Callable:
    """What a plan runs for the registered forward of a call of these tensors' layouts: the chosen
    backend's forward prepared for it, where the backend prepares one (``prepared_forward``)."""
    args, backend = decision
    return prepared_forward("glu_conv", backend, _glu_conv1d_forward, x, weight, bias, residual, args)


def _traced_untimed(forward: Optional[Callable], args: GluConvArgs) -> GluConvArgs:
    """``args`` for the op: without timed choices (``GluConvArgs.timed_choices``) for a call without
    a plan: every call that torch traces (and a plain call whose scalars are not floats)."""
    return args if forward is not None else args.untimed()


def _empty_window(x_t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor of the layout of the window a :func:`glu_conv1d_step` convolves, the
    contiguous ``[B, C_in, k]`` that ``torch.cat`` makes: from ``x_t``'s shape, dtype and device."""
    return x_t.new_empty(*x_t.shape, weight.shape[2])


def _plan_key(tensors: tuple, padding, pad_value, residual_scale, backend) -> Optional[tuple]:
    """The layout of a :func:`glu_conv1d` or :func:`glu_conv1d_step` call (its ``tensors``) that may
    have a plan (float scalars that are not NaN), holding all that its checks read; else None."""
    if not (type(pad_value) is float and type(residual_scale) is float and pad_value == pad_value
            and residual_scale == residual_scale and type(padding) is str):
        return None
    tensors = layout_key(backend, *tensors)
    # The signs tell 0.0 from -0.0, which compare equal.
    return None if tensors is None else (
        *tensors, padding, pad_value, math.copysign(1.0, pad_value), residual_scale, math.copysign(1.0, residual_scale)
    )


# --------------------------------------------------------------------------- argument checks


def _check_number(name: str, value: object) -> float:
    if type(value) is float:  # the common case, before the slower check against the numbers ABC
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a Python float, got {type(value).__name__}")
    return float(value)


def _check_pad_value(value: object, dtype: torch.dtype) -> float:
    """``pad_value`` as a float that ``dtype`` holds: infinities and NaN pass, a finite value past
    the dtype's range is refused, as ``F.pad`` refuses it."""
    value = _check_number("pad_value", value)
    # Comparisons, not math.isfinite: torch.compile traces them where pad_value is symbolic.
    if torch.finfo(dtype).max < abs(value) < math.inf:
        raise ValueError(f"pad_value = {value} overflows {dtype} (the computation's dtype), whose largest value is "
                         f"{torch.finfo(dtype).max}")
    return value


def _check_weight_and_bias(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], x_name: str
) -> tuple[int, int]:
    """Returns ``(C, k)``: GLU output channels and kernel size."""
    check_tensor("weight", weight, ndim=3)
    channels_in = x.shape[1]
    if channels_in < 1:
        # torch's conv1d returns zero channels here rather than the bias; no kernel has a meaning for it.
        raise ValueError(f"{x_name} must have at least one channel (C_in >= 1), got shape {tuple(x.shape)}")
    if weight.shape[1] != channels_in or weight.shape[2] < 1:
        raise ValueError(
            f"weight must have shape [2*C, C_in, k] with C_in = {x_name}.shape[1] = {channels_in} and k >= 1, "
            f"got weight of shape {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0 or weight.shape[0] % 2 != 0:
        raise ValueError(
            f"weight.shape[0] (the convolution's output channels, 2*C) must be even and positive so the GLU "
            f"can split it into two halves, got weight of shape {tuple(weight.shape)}"
        )
    if bias is not None:
        check_tensor("bias", bias, ndim=1)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(
                f"bias must have shape [2*C] = [{weight.shape[0]}] to match weight.shape[0], "
                f"got bias of shape {tuple(bias.shape)}"
            )
    check_same_dtype_device(x_name, x, weight=weight, bias=bias)
    return weight.shape[0] // 2, weight.shape[2]


def _check_residual(residual: Optional[torch.Tensor], expected: tuple[int, ...], x_name: str, x: torch.Tensor) -> None:
    if residual is None:
        return
    check_tensor("residual", residual, ndim=len(expected))
    if tuple(residual.shape) != expected:
        raise ValueError(f"residual must have the output's shape {list(expected)}, got {tuple(residual.shape)}")
    check_same_dtype_device(x_name, x, residual=residual)


# --------------------------------------------------------------------------- registered ops
#
# The forward's second output is what the backend keeps for backward besides the inputs: the
# eager backend's pre-activation [B, L_out, 2C], the Triton backend's packed weight (its backward
# recomputes the pre-activation from x).  It is not differentiable, and it is the backend's own
# state, which a fake asks the backend for (``empty_saved``), as it asks whether the output and
# grad_x are channel-last (``results_channel_last``).

glu_conv1d_forward = RegisteredOp(
    "glu_conv1d_forward", ("Tensor x", "Tensor weight", "Tensor? bias", "Tensor? residual"), GluConvArgs,
    "(Tensor, Tensor)",
)
glu_conv1d_backward = RegisteredOp(
    "glu_conv1d_backward", ("Tensor grad_out", "Tensor x", "Tensor weight", "Tensor? bias", "Tensor saved"),
    GluConvArgs, "(Tensor, Tensor, Tensor)",
    flags=("bool needs_grad_x", "bool needs_grad_weight", "bool needs_grad_bias"),
)


@glu_conv1d_forward.implement
def _glu_conv1d_forward(x, weight, bias, residual, args: GluConvArgs, backend: str):
    return backend_module("glu_conv", backend).forward(x, weight, bias, residual, args)


@glu_conv1d_forward.fake
def _glu_conv1d_forward_fake(x, weight, bias, residual, args: GluConvArgs, backend: str):
    module = backend_module("glu_conv", backend)
    out = empty_output(x, weight.shape[0] // 2, args.output_length(x.shape[2], weight.shape[2]),
                       module.results_channel_last(x, weight, args, "forward"))
    return out, module.empty_saved(x, weight, args)


@glu_conv1d_backward.implement
def _glu_conv1d_backward(
    grad_out, x, weight, bias, saved, args: GluConvArgs, needs_grad_x, needs_grad_weight, needs_grad_bias, backend
):
    """``(grad_x, grad_weight, grad_bias)``; a gradient not asked for is an empty tensor."""
    return backend_module("glu_conv", backend).backward(
        grad_out, x, weight, bias, saved, args, needs_grad_x, needs_grad_weight, needs_grad_bias
    )


@glu_conv1d_backward.fake
def _glu_conv1d_backward_fake(
    grad_out, x, weight, bias, saved, args, needs_grad_x, needs_grad_weight, needs_grad_bias, backend
):
    grad_x = x.new_empty(0)
    if needs_grad_x:
        channel_last = backend_module("glu_conv", backend).results_channel_last(x, weight, args, "backward")
        grad_x = empty_output(x, x.shape[1], x.shape[2], channel_last)
    grad_weight = weight.new_empty(weight.shape) if needs_grad_weight else weight.new_empty(0)
    grad_bias = weight.new_empty(weight.shape[0]) if needs_grad_bias and bias is not None else weight.new_empty(0)
    return grad_x, grad_weight, grad_bias


def _setup_context(ctx, tensors, args: GluConvArgs, output) -> None:
    x, weight, bias, _ = tensors
    # Saved: the inputs x, weight, bias (alive anyway) and the backend's second
    # output (a weight-sized copy for Triton) -- never a [B, 2C, L] tensor on the fused path.
    ctx.save_for_backward(x, weight, bias, output[1])
    ctx.mark_non_differentiable(output[1])
    # The saved pre-activation never has a gradient: do not allocate zeros for it on every backward.
    ctx.set_materialize_grads(False)
    ctx.has_bias = bias is not None
    ctx.args = args
    # The seeds' layers add their input back (residual=x): its two gradients are then summed here, in
    # one pass, instead of the residual's scaled (a pass) and added to x's by autograd (another).
    ctx.residual_is_x = tensors[3] is x


def _backward(ctx, grad_out, _grad_saved):
    x, weight, bias, saved = ctx.saved_tensors
    needs_x, needs_weight, needs_bias, needs_residual = ctx.needs_input_grad[:4]
    grad_x = grad_weight = grad_bias = grad_residual = None
    if grad_out is None:
        return (None, None, None, None), {}
    if needs_x or needs_weight or needs_bias:
        runner = glu_conv1d_forward.backward_runner(ctx, grad_out, x, weight, bias, saved)
        grad_x, grad_weight, grad_bias = glu_conv1d_backward.call_planned(
            runner, grad_out, x, weight, bias, saved, ctx.args, needs_x, needs_weight, needs_bias and ctx.has_bias,
            ctx.backend,
        )
    scale = ctx.args.residual_scale
    if needs_residual and ctx.residual_is_x:  # x's gradient is the sum of both
        grad_x = grad_x.add_(grad_out, alpha=scale)
    elif needs_residual:
        grad_residual = grad_out if scale == 1.0 else grad_out * scale
    grads = (grad_x if needs_x else None, grad_weight if needs_weight else None, grad_bias if needs_bias else None)
    return (*grads, grad_residual), {}


glu_conv1d_forward.register_autograd(_backward, _setup_context)


def _convolution_flops(x, weight, args: GluConvArgs) -> int:
    """torch's count for the convolution (``F.conv1d``; neither the bias nor the GLU counts)."""
    batch, channels_in, length = x
    channels_z, _, kernel_size = weight
    return 2 * batch * args.output_length(length, kernel_size) * channels_z * channels_in * kernel_size


@glu_conv1d_forward.count_flops
def _forward_flops(x, weight, bias, residual, args, backend) -> int:
    return _convolution_flops(x, weight, args)


@glu_conv1d_backward.count_flops
def _backward_flops(grad_out, x, weight, bias, saved, args, needs_grad_x, needs_grad_weight, needs_grad_bias,
                    backend) -> int:
    """As torch counts ``F.conv1d``'s backward: a convolution's worth per gradient of ``x`` and ``weight``."""
    return (int(needs_grad_x) + int(needs_grad_weight)) * _convolution_flops(x, weight, args)
