"""GLU convolution composed of PyTorch ops: the CPU path and the fallback.

Three ways to run the convolution, chosen per call by :func:`algorithm` from
the device, dtype, kernel size and the number of output positions ``B * L_out``,
and where oneDNN competes, by timing the ways on this machine (plain eager calls
only: a call that torch traces takes the fixed rule, see
``GluConvArgs.timed_choices``):

* **Winograd F(2, 3)** (:mod:`.winograd`; kernel size 3, float32 or float64 on a
  CPU, past a few hundred positions, unless oneDNN's convolution times faster):
  four GEMMs of half the rows on transformed windows, two thirds of the direct
  GEMM work, in every direction.  The GEMMs are compute bound there, so where
  the BLAS runs as fast as oneDNN's kernels no implementation doing the direct
  product count can run faster.

* **im2col GEMM** (few output positions, and every other dtype or device):
  one GEMM on unfolded windows, using ``weight`` in the layout ``nn.Conv1d``
  holds it, so nothing copies or reorders the weight::

    xpad = pad(x) as channel-last [B, Lp, C_in]                 (Lp = pad_left + L + pad_right)
    cols[b*L_out + s, ci*k + tap] = xpad[b, s + tap, ci]        [B*L_out, C_in*k]
    z = bias + cols @ weight.view(2C, C_in*k).T                   [B*L_out, 2C], channel-last

  Backward transposes the same GEMM: ``grad_weight = (gz.T @ cols).view(2C, C_in, k)``
  and ``grad_cols = gz @ weight.view(2C, C_in*k)``, folded back onto
  ``grad_xpad`` with ``k`` shifted adds (col2im).

* **oneDNN convolution** (float32 on a CPU with oneDNN, past the im2col
  GEMM's few positions where Winograd does not apply or times slower):
  ``F.conv1d`` forward and ``aten.convolution_backward`` backward, which
  reorder the weight into oneDNN's blocked layout on every call.  (Convolving a
  channel-last ``x`` as the channels-last image ``[B, C_in, 1, L]`` it is in
  memory would skip reordering the activations, but oneDNN runs another
  algorithm there: at C = 512 its float32 output erred 4x as much as
  ``F.conv1d``'s, for no gain in speed forward and backward together.)  That
  fixed cost loses to the im2col GEMM for a few output positions (decoding
  steps, short batches; a few hundred in the backward) and is repaid by
  oneDNN's faster GEMM kernels beyond them.  Where oneDNN is fast, the weight
  gradient is the im2col GEMM on oneDNN's GEMM kernels instead (see
  ``_GEMM_WEIGHT_GRADIENT_MIN_DEPTH``), and up to a few hundred positions the
  input gradient too (``_GEMM_INPUT_GRADIENT_MAX_POSITIONS``).

``torch.conv_tbc`` (fairseq's per-tap GEMMs on ``[T, B, C]``) is no option:
it needs the weight permuted to ``[k, C_in, 2C]``, a copy per call that
costs more than either direct path saves.

Every way, ``out = (glu(z) + residual) * residual_scale`` is written into one
output tensor (in ``x``'s layout, or contiguous after oneDNN: see
:func:`results_channel_last`), and ``forward`` returns the pre-activation
``z`` (logically ``[B, L_out, 2C]``; channel-last after the GEMMs, a
transposed ``[B, 2C, L_out]`` after oneDNN) for backward: the GEMMs are the
whole cost, so recomputing them would make training slower than plain PyTorch.
"""

from __future__ import annotations

import bisect
import functools
from typing import Optional

import torch
import torch.nn.functional as F

from ...ops.glu_conv import GluConvArgs, empty_output, is_channels_last
from . import _tuning, onednn, winograd

__all__ = [
    "forward", "prepare_forward", "backward", "unsupported_reason", "empty_saved", "results_channel_last", "algorithm",
    "padded_rows",
]

# Crossovers in output positions (B * L_out), measured on a 2-core AVX-512 CPU,
# C = 512, k = 3, channel-last activations with a residual, interleaved rounds.
# oneDNN's convolution reorders the weight on every call: in the forward that
# costs as much as the im2col GEMM's unfolding from a few dozen positions on, in
# the backward it loses to im2col until Winograd takes over.
_IM2COL_MAX_POSITIONS_FORWARD = 16
_IM2COL_MAX_POSITIONS_BACKWARD = 255
# Winograd's weight transforms (and the weight gradient's four outputs) are a
# fixed cost per call, about as large as C_in * C_out, like its savings per
# position, so its crossover hardly moves with the channels: forward 1.09x the
# best direct path at 160 positions and 1.2x at 320; backward 1.1x at 256-320;
# 1.3x both ways at 2048.
_WINOGRAD_MIN_POSITIONS_FORWARD = 160
_WINOGRAD_MIN_POSITIONS_BACKWARD = 256
# The backward's im2col GEMM keeps this many positions untimed; past them, up to
# _IM2COL_MAX_POSITIONS_BACKWARD, it is timed against oneDNN's convolution (a stack of 10 layers of
# B=4, L=40, 160 positions, fwd+bwd ran 0.73x the seed with im2col and 0.94x with oneDNN where
# oneDNN's GEMM outran the BLAS 2.2x; B=2, L=20, 40 positions, 1.13x with im2col either way).
_IM2COL_MAX_POSITIONS_BACKWARD_UNTIMED = 64
# Winograd and the im2col GEMM run their GEMMs on the BLAS; oneDNN's convolution runs all of its
# work on its own kernels.  Which is faster depends on the CPU, the thread count and the size (on
# the CI's AMD EPYC, on one day, Winograd ran the seeds' layers 1.14-1.24x as fast as oneDNN at
# one thread and 0.53-0.87x at two; on days when oneDNN's GEMM ran 2.2x the BLAS, 0.62-0.78x), so
# where oneDNN and another apply they are timed (see algorithm), once per size class: the largest
# of these output position counts (half octaves) that a call reaches, timed at about that many
# positions (the ratios hardly move past the last, and a timed run stays within tens of
# milliseconds at C = 512).
_SIZE_CLASSES = tuple(round(2 ** (half_octave / 2)) for half_octave in range(12, 23))  # 64 ... 2048
# Where oneDNN's GEMM kernels outrun the BLAS by this much (:func:`.onednn.speedup`), the oneDNN
# backward computes some gradients as im2col GEMMs on them:
_FAST_ONEDNN_SPEEDUP = 1.3
# ... and past those, the weight gradient leaves oneDNN's convolution backward for the im2col GEMM
# on oneDNN's GEMM kernels (the input gradient stays): C = 512, k = 3, the backward against the
# seed's 1.36x at 160 positions, 1.18x at 320, 1.05x at 640, 0.8x at 2048 (its windows and the
# transposed gradient outgrow the cache); C = 256 tied, C = 128 lost 5-9%.  Its float32 error
# stayed within 1.1x (max) of torch's convolution backward from 160 to 4096 positions.
_GEMM_WEIGHT_GRADIENT_MIN_DEPTH = 1536
_GEMM_WEIGHT_GRADIENT_MAX_POSITIONS = 1024
# ... and up to this many positions, the input gradient leaves it too, for the im2col GEMM's
# (grad_z @ W, then col2im) on oneDNN's GEMM kernels: C = 512, k = 3, the whole backward 1.16x as
# fast at 160 positions, 1.12x at 320, 1.03x at 640, level at 960; C = 128 level or slower.
_GEMM_INPUT_GRADIENT_MAX_POSITIONS = 640
# That GEMM's 2C-deep contraction summed in blocks of this depth: in one pass (or blocks of 512)
# oneDNN's input gradient erred 2.1x its convolution backward's (RMS, C = 512), in blocks of 256
# 1.4x, in the same time.
_INPUT_GRADIENT_BLOCK = 256
# Up to this many positions, the oneDNN backward may compute some gradient as a GEMM.
_GEMM_GRADIENTS_MAX_POSITIONS = max(_GEMM_WEIGHT_GRADIENT_MAX_POSITIONS, _GEMM_INPUT_GRADIENT_MAX_POSITIONS)


def algorithm(x: torch.Tensor, weight: torch.Tensor, length_out: int, direction: str, timed: bool = True) -> str:
    """How ``direction`` (``"forward"`` or ``"backward"``) convolves ``x`` ``[B, C_in, L]`` with
    ``weight`` ``[2C, C_in, k]`` (only its shape is read) into ``L_out`` positions:
    ``"winograd"``, ``"onednn"`` or ``"im2col"``.

    A fixed rule first: Winograd where it applies (kernel size 3, float32 or float64 on a CPU,
    from ``_WINOGRAD_MIN_POSITIONS_*``), else oneDNN's convolution (float32 on a CPU with oneDNN)
    past the im2col GEMM's few positions, else the im2col GEMM.  Where oneDNN applies and the rule
    chose another past ``_IM2COL_MAX_POSITIONS_FORWARD`` / ``_IM2COL_MAX_POSITIONS_BACKWARD_UNTIMED``,
    the faster of the two, timed (:func:`_timed_choice`), unless not ``timed``
    (``GluConvArgs.timed_choices``) or under ``torch.use_deterministic_algorithms(True)``."""
    positions = x.shape[0] * length_out
    on_cpu = x.device.type == "cpu"
    forward = direction == "forward"
    onednn_applies = on_cpu and x.dtype == torch.float32 and onednn.enabled()
    if (on_cpu and weight.shape[2] == winograd.KERNEL_SIZE and x.dtype in (torch.float32, torch.float64)
            and positions >= (_WINOGRAD_MIN_POSITIONS_FORWARD if forward else _WINOGRAD_MIN_POSITIONS_BACKWARD)):
        ruled = "winograd"
    elif onednn_applies and positions > (_IM2COL_MAX_POSITIONS_FORWARD if forward else _IM2COL_MAX_POSITIONS_BACKWARD):
        ruled = "onednn"
    else:
        ruled = "im2col"
    untimed_positions = _IM2COL_MAX_POSITIONS_FORWARD if forward else _IM2COL_MAX_POSITIONS_BACKWARD_UNTIMED
    if ruled == "onednn" or not (onednn_applies and timed and _tuning.enabled() and positions > untimed_positions):
        return ruled
    return _timed_choice(x, weight, length_out, direction, (ruled, "onednn"))


def _call_algorithm(x: torch.Tensor, weight: torch.Tensor, args: GluConvArgs, direction: str) -> str:
    return algorithm(x, weight, args.output_length(x.shape[2], weight.shape[2]), direction, args.timed_choices)


def _timed_choice(x: torch.Tensor, weight: torch.Tensor, length_out: int, direction: str,
                  candidates: tuple[str, ...]) -> str:
    """The fastest of ``candidates`` for ``direction`` at this size, timed once per process,
    thread count and size class (``_SIZE_CLASSES``) on random tensors of the call's channels and
    layout, at about the class's positions.  (Only calls of concrete sizes are timed: a traced
    call takes the fixed rule, ``GluConvArgs.timed_choices``.)

    The backward is timed on what the forward chosen at this size leaves it (its pre-activation's
    and its output's layouts): each is fast on its own forward's, and the other's layouts made it
    slower (a small ConvSeq2Seq's training step, Winograd forward and oneDNN backward as timed
    apart, ran 0.88x the seeds' math, both ways on oneDNN 0.95x)."""
    channels_z, channels_in, kernel_size = weight.shape
    dtype, channel_last = x.dtype, is_channels_last(x)
    size_class = _SIZE_CLASSES[bisect.bisect_right(_SIZE_CLASSES, x.shape[0] * length_out) - 1]
    forward_choice = None if direction == "forward" else algorithm(x, weight, length_out, "forward")
    key = ("glu_conv1d", direction, candidates, forward_choice, dtype, channels_in, channels_z, kernel_size,
           channel_last, size_class, torch.get_num_threads())
    timed_length = min(length_out, size_class)
    timed_batch = size_class // timed_length

    def make_runs():
        generator = torch.Generator().manual_seed(0)
        rows = torch.randn(timed_batch, timed_length + kernel_size - 1, channels_in, generator=generator, dtype=dtype)
        x_timed = rows.transpose(1, 2) if channel_last else rows.transpose(1, 2).contiguous()
        weight_timed = torch.randn(channels_z, channels_in, kernel_size, generator=generator, dtype=dtype)
        bias_timed = torch.randn(channels_z, generator=generator, dtype=dtype)
        args = GluConvArgs(0, 0, 0.0, 1.0)
        if forward_choice is None:
            return {chosen: functools.partial(_forward, x_timed, weight_timed, bias_timed, None, args, chosen)
                    for chosen in candidates}
        _, z = _forward(x_timed, weight_timed, bias_timed, None, args, forward_choice)
        grad_out = empty_output(x_timed, channels_z // 2, timed_length, _channel_last_result(x_timed, forward_choice))
        grad_out.normal_(generator=generator)
        return {chosen: functools.partial(_backward, grad_out, x_timed, weight_timed, bias_timed, z, args, chosen,
                                          True, True, True)
                for chosen in candidates}

    return _tuning.fastest(key, make_runs)


def empty_saved(x: torch.Tensor, weight: torch.Tensor, args: GluConvArgs) -> torch.Tensor:
    """What ``forward`` returns for backward (for the fake kernel): the pre-activation
    ``[B, L_out, 2C]``: contiguous after the im2col GEMM, the first ``L_out`` positions of a
    contiguous ``[B, 2 * ceil(L_out / 2), 2C]`` after Winograd, a transposed contiguous
    ``[B, 2C, L_out]`` after oneDNN."""
    length_out = args.output_length(x.shape[2], weight.shape[2])
    chosen = _call_algorithm(x, weight, args, "forward")
    if chosen == "onednn":
        return x.new_empty(x.shape[0], weight.shape[0], length_out).transpose(1, 2)
    if chosen == "winograd":
        return x.new_empty(x.shape[0], 2 * winograd.tiles(length_out), weight.shape[0])[:, :length_out]
    return x.new_empty(x.shape[0], length_out, weight.shape[0])


def results_channel_last(x: torch.Tensor, weight: torch.Tensor, args: GluConvArgs, direction: str) -> bool:
    """Whether the output (``direction="forward"``) and ``grad_x`` (``"backward"``) are channel-last:
    in ``x``'s layout, except on the oneDNN path, whose convolutions write and read contiguous
    ``[B, C, L]`` (see :func:`_channel_last_result`)."""
    return _channel_last_result(x, _call_algorithm(x, weight, args, direction))


def _channel_last_result(x: torch.Tensor, chosen: str) -> bool:
    """Results in ``x``'s layout, unless oneDNN convolves: its output and input gradient are
    contiguous, and so is what its next layer's convolution reads without a copy, so a seeds'
    stack of channel-last layers would pay a transposing copy per layer and direction (3-6% of a
    layer at C = 512, L = 40)."""
    return is_channels_last(x) and chosen != "onednn"


def unsupported_reason(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
    args: GluConvArgs,
) -> Optional[str]:
    return None


def padded_rows(x: torch.Tensor, pad_left: int, pad_right: int, pad_value: float) -> torch.Tensor:
    """``x`` padded with ``pad_value`` along positions, as a contiguous ``[B, Lp, C_in]``."""
    return winograd.padded_rows(x.transpose(1, 2), pad_left, pad_left + x.shape[2] + pad_right, pad_value)


def _windows(x: torch.Tensor, kernel_size: int, pad_left: int, pad_right: int, pad_value: float) -> torch.Tensor:
    """im2col ``[B * L_out, C_in * k]``: row ``b * L_out + s``, column ``ci * k + tap`` holds ``xpad[b, s + tap, ci]``."""
    padded = padded_rows(x, pad_left, pad_right, pad_value)
    batch, padded_length, channels_in = padded.shape
    length_out = padded_length - kernel_size + 1
    return padded.unfold(1, kernel_size, 1).reshape(batch * length_out, channels_in * kernel_size)


def _conv_input(x: torch.Tensor, pad_left: int, pad_right: int, pad_value: float) -> tuple[torch.Tensor, int]:
    """``(input, padding)`` for ``F.conv1d``: ``x`` itself with its symmetric zero padding
    left to oneDNN, else ``x`` padded explicitly (asymmetric or non-zero padding) into a
    contiguous ``[B, C_in, Lp]``, the layout oneDNN convolves without a copy, and 0."""
    if pad_left == pad_right and pad_value == 0.0:
        return x, pad_left
    return F.pad(x, (pad_left, pad_right), value=pad_value), 0


def forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    residual: Optional[torch.Tensor],
    args: GluConvArgs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, z)``: ``out`` in ``x``'s layout; ``z`` ``[B, L_out, 2C]`` (strides as
    :func:`empty_saved` states) kept for backward."""
    return _forward(x, weight, bias, residual, args, _call_algorithm(x, weight, args, "forward"))


def prepare_forward(x, weight, bias, residual, args: GluConvArgs) -> Optional["_ForwardOnTorchAutograd"]:
    """:func:`forward` for the calls of this one's layout, where autograd may record it as torch's
    own ops (see :class:`_ForwardOnTorchAutograd`): float32 on a CPU with oneDNN built in; else None."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and torch.backends.mkldnn.is_available():
        return _FORWARD_ON_TORCH_AUTOGRAD
    return None


class _ForwardOnTorchAutograd:
    """:func:`forward`, and for a call that autograd records where both directions convolve with
    oneDNN as torch's own ops do, those ops (:meth:`recorded_by_autograd`).

    There this backend's backward is ``glu_backward`` and ``convolution_backward``, the very
    kernels the autograd nodes of ``F.conv1d`` + ``F.glu`` + add + mul run, so the op's Python
    ``autograd.Function`` would add host time and nothing else: at a small ConvSeq2Seq's layers
    (C = 128, 320-640 positions, 2 threads) it made a layer's forward and backward 0.90x as fast
    as the seed's ops, recorded by autograd 0.96-0.97x (torch's ops alone, without the call's
    checks and choices, 1.00-1.03x: the seed pads in an op of its own)."""

    __slots__ = ()

    def __call__(self, x, weight, bias, residual, args: GluConvArgs, backend: str):
        """The registered op's implementation (same signature)."""
        return forward(x, weight, bias, residual, args)

    def recorded_by_autograd(self, x, weight, bias, residual, args: GluConvArgs, backend: str):
        """``(out, z)`` as :func:`forward` computes them (out contiguous, z ``[B, L_out, 2C]``
        transposed), by differentiable ops, where the forward and backward both convolve with
        oneDNN and the backward none of its gradients as GEMMs (see ``_on_gemms``); else None."""
        kernel_size = weight.shape[2]
        length_out = args.output_length(x.shape[2], kernel_size)
        # The cheap test first: where it holds, the Function's forward makes the choices anyway.
        if (_on_gemms(x, weight.shape[1] * kernel_size, length_out, _GEMM_GRADIENTS_MAX_POSITIONS)
                or algorithm(x, weight, length_out, "forward", args.timed_choices) != "onednn"
                or algorithm(x, weight, length_out, "backward", args.timed_choices) != "onednn"):
            return None
        conv_input, padding = _conv_input(x, args.pad_left, args.pad_right, args.pad_value)
        z = F.conv1d(conv_input, weight, bias, padding=padding)
        # In place on glu's fresh output, which its backward does not read (see _forward).
        out = F.glu(z, 1)
        if residual is not None:
            out.add_(residual)
        if args.residual_scale != 1.0:
            out.mul_(args.residual_scale)
        return out, z.transpose(1, 2)


_FORWARD_ON_TORCH_AUTOGRAD = _ForwardOnTorchAutograd()


def _forward(x, weight, bias, residual, args: GluConvArgs, chosen: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`forward` by the algorithm ``chosen``."""
    channels_z, _, kernel_size = weight.shape
    pad_left, pad_right, pad_value = args.pad_left, args.pad_right, args.pad_value
    length_out = args.output_length(x.shape[2], kernel_size)
    if chosen == "onednn":
        conv_input, padding = _conv_input(x, pad_left, pad_right, pad_value)
        z = F.conv1d(conv_input, weight, bias, padding=padding)
        z_dim = 1
    elif chosen == "winograd":
        z = winograd.convolve(x.transpose(1, 2), weight, bias, pad_left, pad_right, pad_value)
        if not _all_finite(z):
            z.copy_(_im2col_preactivation(x, weight, bias, args))
        z_dim = 2
    else:
        z = _im2col_preactivation(x, weight, bias, args)
        z_dim = 2
    if z_dim == 1:
        # After oneDNN, glu's own output has the output's layout: z's, contiguous (as empty_saved
        # states), so the residual and the scale go in place on it.  glu.out into an empty output,
        # then add(out=), took 10.1 against 7.1 us at B4 C8 L40, 39.6 against 34.7 at B16 C128 L40
        # and 1.34 against 1.25 ms at B128 C512 L40 (2 threads; the seed's glu, add and mul,
        # allocating each, 1.83 ms there).
        out = F.glu(z, 1)
        if residual is not None:
            out.add_(residual)
    else:
        out = empty_output(x, channels_z // 2, length_out, _channel_last_result(x, chosen))
        # glu's kernel is vectorized only when its output has z's layout: write it into
        # out when out has that layout, else compute it in z's (channel-last) layout and
        # let the residual add (or a copy) transpose it, which costs less.
        out_as_z = out.transpose(1, 2)
        if out_as_z.is_contiguous():
            torch.ops.aten.glu.out(z, 2, out=out_as_z)
            glu = out
        else:
            glu = F.glu(z, 2).transpose(1, 2)
        if residual is not None:
            torch.add(glu, residual, out=out)
        elif glu is not out:
            out.copy_(glu)
    if args.residual_scale != 1.0:
        out.mul_(args.residual_scale)
    return out, (z.transpose(1, 2) if z_dim == 1 else z)


def _im2col_preactivation(x, weight, bias, args: GluConvArgs) -> torch.Tensor:
    """The pre-activation ``z`` ``[B, L_out, 2C]`` (contiguous) as one GEMM on unfolded windows."""
    channels_z, channels_in, kernel_size = weight.shape
    cols = _windows(x, kernel_size, args.pad_left, args.pad_right, args.pad_value)
    weight_rows = weight.reshape(channels_z, channels_in * kernel_size)
    z = torch.mm(cols, weight_rows.t()) if bias is None else torch.addmm(bias, cols, weight_rows.t())
    return z.view(x.shape[0], args.output_length(x.shape[2], kernel_size), channels_z)


def _all_finite(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds no inf or NaN (a sum that overflows counts as one: a false alarm
    costs a recomputation, no result).  Winograd's transforms are sums of up to three inputs, or
    weights, and its outputs differences of products: an inf in ``x`` or ``weight`` became NaN
    (inf - inf) where the direct product gives inf, and values near the dtype's limit overflowed
    where the direct product does not.  Where they show in its result, the direct GEMMs compute it
    again, as torch's convolution would: one reduction of a result against its GEMMs."""
    return bool(torch.isfinite(tensor.sum()))


def _scaled(grad_out: torch.Tensor, scale: float, channel_last: bool) -> torch.Tensor:
    """``grad_out * scale`` ``[B, C, L]``, contiguous or channel-last as asked, in at most one pass."""
    in_layout = grad_out.transpose(1, 2).is_contiguous() if channel_last else grad_out.is_contiguous()
    if scale == 1.0 and in_layout:
        return grad_out
    batch, channels, length = grad_out.shape
    if channel_last:
        result = grad_out.new_empty(batch, length, channels).transpose(1, 2)
    else:
        result = grad_out.new_empty(batch, channels, length)
    return torch.mul(grad_out, scale, out=result)


def backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    z: torch.Tensor,
    args: GluConvArgs,
    needs_grad_x: bool,
    needs_grad_weight: bool,
    needs_grad_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_weight, grad_bias)``; an output not asked for is an empty tensor."""
    chosen = _call_algorithm(x, weight, args, "backward")
    return _backward(grad_out, x, weight, bias, z, args, chosen, needs_grad_x, needs_grad_weight, needs_grad_bias)


def _backward(grad_out, x, weight, bias, z, args: GluConvArgs, chosen: str, needs_grad_x: bool,
              needs_grad_weight: bool, needs_grad_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`backward` by the algorithm ``chosen``."""
    needs_grad_bias = needs_grad_bias and bias is not None
    # glu_backward is vectorized only when grad_out has z's layout (the layout
    # of the GEMM's rows): scaling grad_out writes it in that layout.
    grad_out = _scaled(grad_out, args.residual_scale, channel_last=not z.transpose(1, 2).is_contiguous())
    pad_left, pad_right, pad_value = args.pad_left, args.pad_right, args.pad_value
    if chosen == "onednn":
        grads = _backward_onednn(grad_out, x, weight, z, pad_left, pad_right, pad_value,
                                 needs_grad_x, needs_grad_weight, needs_grad_bias)
    elif chosen == "winograd":
        grads = _backward_winograd(grad_out, x, weight, z, pad_left, pad_right, pad_value,
                                   needs_grad_x, needs_grad_weight, needs_grad_bias)
        if not all(grad is None or _all_finite(grad) for grad in grads[:2]):  # see _all_finite
            grads = _backward_im2col(grad_out, x, weight, z, pad_left, pad_right, pad_value,
                                     needs_grad_x, needs_grad_weight, needs_grad_bias)
    else:
        grads = _backward_im2col(grad_out, x, weight, z, pad_left, pad_right, pad_value,
                                 needs_grad_x, needs_grad_weight, needs_grad_bias)
    return tuple(x.new_empty(0) if g is None else g for g in grads)


def _backward_onednn(grad_out, x, weight, z, pad_left, pad_right, pad_value, needs_grad_x, needs_grad_weight,
                     needs_grad_bias):
    if needs_grad_x and _on_gemms(x, weight.shape[1] * weight.shape[2], z.shape[1], _GEMM_INPUT_GRADIENT_MAX_POSITIONS):
        return _backward_onednn_gemms(grad_out, x, weight, z, pad_left, pad_right, pad_value, needs_grad_weight,
                                      needs_grad_bias)
    grad_z = torch.ops.aten.glu_backward(grad_out, z.transpose(1, 2), 1)  # [B, 2C, L_out]
    conv_input, padding = _conv_input(x, pad_left, pad_right, pad_value)
    on_gemm = needs_grad_weight and _on_gemms(
        x, weight.shape[1] * weight.shape[2], grad_z.shape[2], _GEMM_WEIGHT_GRADIENT_MAX_POSITIONS
    )
    # oneDNN computes the bias gradient with the weight's: the GEMM takes both, or neither.
    wanted = [needs_grad_x, needs_grad_weight and not on_gemm, needs_grad_bias and not on_gemm]
    grad_input = grad_weight = grad_bias = None
    if any(wanted):
        grad_input, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
            grad_z, conv_input, weight, [weight.shape[0]] if wanted[2] else None, [1], [padding], [1], False,
            [0], 1, wanted,
        )
    if on_gemm:
        cols = _windows(x, weight.shape[2], pad_left, pad_right, pad_value)
        grad_rows = grad_z.transpose(1, 2).reshape(cols.shape[0], weight.shape[0])
        grad_weight = onednn.linear(grad_rows.t(), cols.t()).view(weight.shape)
        grad_bias = grad_rows.sum(0) if needs_grad_bias else None
    grad_x = None
    if needs_grad_x:
        # grad_input is a [B, C_in, L] (contiguous, see _channel_last_result), or with explicit
        # padding a [B, C_in, Lp] whose padding positions take no gradient.
        grad_x = grad_input[:, :, pad_left - padding : pad_left - padding + x.shape[2]].contiguous()
    return grad_x, grad_weight, grad_bias


def _on_gemms(x: torch.Tensor, depth: int, length_out: int, max_positions: int) -> bool:
    """Whether the oneDNN backward computes a gradient (the weight's: ``grad_z.T @ cols``, a
    ``B * L_out`` long contraction; the input's: ``grad_z @ W``, then col2im) as the im2col GEMM on
    oneDNN's GEMM kernels, where oneDNN's convolution backward runs slower: a fast oneDNN (see
    ``_FAST_ONEDNN_SPEEDUP``), ``C_in * k`` of ``_GEMM_WEIGHT_GRADIENT_MIN_DEPTH`` or more, and at
    most ``max_positions`` output positions (the windows hold 3x the input)."""
    return (depth >= _GEMM_WEIGHT_GRADIENT_MIN_DEPTH
            and x.shape[0] * length_out <= max_positions
            and _onednn_outruns_blas())


def _backward_onednn_gemms(grad_out, x, weight, z, pad_left, pad_right, pad_value, needs_grad_weight,
                           needs_grad_bias):
    """The oneDNN forward's backward as im2col GEMMs on oneDNN's GEMM kernels (see
    ``_GEMM_INPUT_GRADIENT_MAX_POSITIONS``).  grad_z is written as ``[2C, B * L_out]`` (each
    channel's positions together), which both GEMMs read densely, and which lets the input
    gradient's contraction run in blocks (``_INPUT_GRADIENT_BLOCK``)."""
    batch, channels_in, length_in = x.shape
    channels_z, _, kernel_size = weight.shape
    length_out = z.shape[1]
    grad_z = x.new_empty(channels_z, batch, length_out)
    torch.ops.aten.glu_backward.grad_input(grad_out, z.transpose(1, 2), 1, grad_input=grad_z.transpose(0, 1))
    grad_z = grad_z.view(channels_z, batch * length_out)
    weight_rows = weight.reshape(channels_z, channels_in * kernel_size)
    grad_cols = onednn.linear(grad_z.t(), weight_rows.t(), max_depth=_INPUT_GRADIENT_BLOCK)
    grad_x = _fold_windows(grad_cols.view(batch, length_out, channels_in, kernel_size), pad_left,
                           x.new_empty(batch, channels_in, length_in))
    grad_weight = None
    if needs_grad_weight:
        cols = _windows(x, kernel_size, pad_left, pad_right, pad_value)
        grad_weight = onednn.linear(grad_z, cols.t()).view(weight.shape)
    grad_bias = grad_z.sum(1) if needs_grad_bias else None
    return grad_x, grad_weight, grad_bias


def _fold_windows(grad_cols: torch.Tensor, pad_left: int, grad_x: torch.Tensor) -> torch.Tensor:
    """col2im: ``grad_x`` ``[B, C_in, L]`` (any layout) filled from the windows' gradient
    ``grad_cols`` ``[B, L_out, C_in, k]``, each tap's added at its shift, the padding's dropped."""
    batch, length_out, channels_in, kernel_size = grad_cols.shape
    grad_padded = grad_cols.new_zeros(batch, length_out + kernel_size - 1, channels_in)
    for tap in range(kernel_size):
        grad_padded[:, tap : tap + length_out] += grad_cols[:, :, :, tap]
    grad_x.transpose(1, 2).copy_(grad_padded[:, pad_left : pad_left + grad_x.shape[2]])
    return grad_x


def _onednn_outruns_blas() -> bool:
    """Whether oneDNN's kernels outrun the BLAS by ``_FAST_ONEDNN_SPEEDUP`` on this CPU."""
    return onednn.speedup() >= _FAST_ONEDNN_SPEEDUP


def _backward_im2col(grad_out, x, weight, z, pad_left, pad_right, pad_value, needs_grad_x, needs_grad_weight,
                     needs_grad_bias):
    batch, channels_in, length_in = x.shape
    channels_z, _, kernel_size = weight.shape
    length_out = z.shape[1]
    grad_z = torch.ops.aten.glu_backward(grad_out.transpose(1, 2), z, 2).reshape(batch * length_out, channels_z)
    weight_rows = weight.reshape(channels_z, channels_in * kernel_size)

    grad_x = None
    if needs_grad_x:
        grad_cols = torch.mm(grad_z, weight_rows).view(batch, length_out, channels_in, kernel_size)
        grad_x = _fold_windows(grad_cols, pad_left, empty_output(x, channels_in, length_in))

    grad_weight = None
    if needs_grad_weight:
        cols = _windows(x, kernel_size, pad_left, pad_right, pad_value)
        grad_weight = torch.mm(grad_z.t(), cols).view(weight.shape)

    grad_bias = grad_z.sum(0) if needs_grad_bias else None
    return grad_x, grad_weight, grad_bias


def _backward_winograd(grad_out, x, weight, z, pad_left, pad_right, pad_value, needs_grad_x, needs_grad_weight,
                       needs_grad_bias):
    grad_z = torch.ops.aten.glu_backward(grad_out.transpose(1, 2), z, 2)  # [B, L_out, 2C]
    grad_x = None
    if needs_grad_x:
        grad_x = empty_output(x, x.shape[1], x.shape[2])
        winograd.input_gradient(grad_z, weight, pad_left, pad_right, grad_x.transpose(1, 2))
    grad_weight = None
    if needs_grad_weight:
        grad_weight = winograd.weight_gradient(grad_z, x.transpose(1, 2), pad_left, pad_right, pad_value)
    grad_bias = grad_z.sum((0, 1)) if needs_grad_bias else None
    return grad_x, grad_weight, grad_bias
