"""``GLUConv1d``: the convolution + GLU (+ residual, scale) block of convolutional
seq2seq models as one module on :func:`transformer_kernels.glu_conv1d`."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .._checks import is_int
from ..ops.glu_conv import _check_number, _check_pad_value, glu_conv1d, glu_conv1d_step
from ..ops.glu_conv_update import glu_conv1d_update
from ._checks import check_backend

__all__ = ["GLUConv1d"]

_PADDINGS = ("same", "causal")


class GLUConv1d(torch.nn.Module):
    r"""``F.glu(conv1d(pad(x)), dim=1)``, then ``(… + residual) * residual_scale``, fused.

    Holds the parameters of ``nn.Conv1d(in_channels, 2 * out_channels, kernel_size)``
    under the same names, shapes and initialization: ``weight``
    ``[2 * out_channels, in_channels, kernel_size]`` (the GLU's value half first, its gate
    half second) and ``bias`` ``[2 * out_channels]``, so a ``state_dict`` of that
    ``nn.Conv1d`` loads into this module with ``strict=True`` (and back).

    Args:
        in_channels: ``C_in``, channels of the input.
        out_channels: ``C``, channels of the output (the convolution computes ``2 * C``).
        kernel_size: ``k >= 1``.
        padding: ``"same"``: ``(k - 1) // 2`` positions before the sequence and ``k // 2``
            after it (``nn.Conv1d(..., padding=(k - 1) // 2)`` for odd ``k``), the encoder's.
            ``"causal"``: ``k - 1`` positions before it, none after, so output ``t`` sees
            inputs ``t - k + 1 .. t`` (the decoder's); only a causal module can :meth:`step` and
            :meth:`update`.
        pad_value: the value of the padding positions (``0.0`` is ``nn.Conv1d``'s zero
            padding; the conv seq2seq decoder pads with its target pad index).
        bias: whether the convolution has a bias.
        device, dtype: of the parameters.
        backend: ``None`` (follow :func:`transformer_kernels.use_backend` and the
            ``TRANSFORMER_KERNELS_BACKEND`` environment variable), ``"auto"``, ``"triton"``,
            ``"cuda"`` or ``"eager"``.  A plain attribute, not part of the ``state_dict``.

    Shapes: ``x`` ``[B, C_in, L]`` (contiguous, or channel-last: a ``[B, L, C_in]`` tensor
    ``.transpose(1, 2)``-ed, which is read in place and gives a channel-last output);
    output ``[B, C, L]``.  See :func:`transformer_kernels.glu_conv1d` for dtypes, autograd
    and what backward saves.

    Example (the conv seq2seq encoder's block, and one decoding step of a decoder's)::

        >>> conv = GLUConv1d(512, 512, 3)
        >>> h = torch.randn(8, 512, 20)
        >>> h = conv(h, residual=h, residual_scale=0.5**0.5)             # [8, 512, 20]
        >>> dec = GLUConv1d(512, 512, 3, padding="causal", pad_value=1.0)
        >>> state = dec.initial_state(8)                                  # [8, 512, 2]
        >>> y_t, state = dec.step(torch.randn(8, 512), state)            # y_t [8, 512]
        >>> ring = dec.initial_conv_state(8)                              # [8, 512, 3], in place:
        >>> with torch.no_grad():
        ...     y_t = dec.update(torch.randn(8, 512), ring, torch.tensor(0))  # position 0
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        *,
        padding: str = "same",
        pad_value: float = 0.0,
        bias: bool = True,
        device=None,
        dtype=None,
        backend: Optional[str] = None,
    ) -> None:
        super().__init__()
        for name, value in (("in_channels", in_channels), ("out_channels", out_channels),
                            ("kernel_size", kernel_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if padding not in _PADDINGS:
            raise ValueError(f"padding must be one of {_PADDINGS}, got {padding!r}")
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = kernel_size
        self.padding = padding
        self.pad_value = _check_number("pad_value", pad_value)
        self.backend = check_backend(backend)
        factory = {"device": device, "dtype": dtype}
        self.weight = torch.nn.Parameter(torch.empty(2 * out_channels, in_channels, kernel_size, **factory))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(2 * out_channels, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Conv1d``'s initialization: Kaiming-uniform weight (``a = sqrt(5)``) and a bias
        uniform in ``±1 / sqrt(in_channels * kernel_size)``."""
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_channels * self.kernel_size)
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def extra_repr(self) -> str:
        text = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, padding={self.padding!r}"
        if self.pad_value != 0.0:
            text += f", pad_value={self.pad_value}"
        if self.bias is None:
            text += ", bias=False"
        if self.backend is not None:
            text += f", backend={self.backend!r}"
        return text

    def forward(self, x: Tensor, residual: Optional[Tensor] = None, residual_scale: float = 1.0) -> Tensor:
        """``(F.glu(conv1d(pad(x)), dim=1) + residual) * residual_scale``: ``x`` ``[B, C_in, L]``,
        ``residual`` ``[B, C, L]`` or None (adds nothing; the scale still applies);
        returns ``[B, C, L]``."""
        return glu_conv1d(
            x, self.weight, self.bias, padding=self.padding, pad_value=self.pad_value, residual=residual,
            residual_scale=residual_scale, backend=self.backend,
        )

    def initial_state(self, batch_size: int) -> Tensor:
        """The decoding state before the first step: ``[batch_size, C_in, k - 1]`` of
        ``pad_value`` (the causal padding), with the parameters' dtype and device."""
        return self._padding_state("initial_state", batch_size, self.kernel_size - 1)

    def initial_conv_state(self, batch_size: int) -> Tensor:
        """The ring of :meth:`update` before position 0: ``[batch_size, C_in, k]`` of ``pad_value``
        (the causal padding), with the parameters' dtype and device."""
        return self._padding_state("initial_conv_state", batch_size, self.kernel_size)

    def _padding_state(self, method: str, batch_size: int, positions: int) -> Tensor:
        self._check_causal(method)
        if not is_int(batch_size):
            raise TypeError(f"batch_size must be an int, got {type(batch_size).__name__}")
        if batch_size < 0:
            raise ValueError(f"batch_size must be non-negative, got {batch_size}")
        return self.weight.new_full((batch_size, self.in_channels, positions),
                                    _check_pad_value(self.pad_value, self.weight.dtype))

    def step(
        self, x_t: Tensor, state: Optional[Tensor], residual: Optional[Tensor] = None, residual_scale: float = 1.0
    ) -> tuple[Tensor, Tensor]:
        """One decoding step: ``x_t`` ``[B, C_in]`` is the input at the next position, ``state``
        ``[B, C_in, k - 1]`` the previous inputs (from :meth:`initial_state` or the last step,
        or None for the first step; reorder it for beam search with
        ``state.index_select(0, beams)``), ``residual``
        ``[B, C]`` or None.  Returns ``(y_t [B, C], new_state)``; feeding positions
        ``0 .. L-1`` gives the columns of ``forward(x)``."""
        self._check_causal("step")
        return glu_conv1d_step(
            x_t, state, self.weight, self.bias, pad_value=self.pad_value, residual=residual,
            residual_scale=residual_scale, backend=self.backend,
        )

    def update(
        self, x_t: Tensor, conv_state: Tensor, position: Tensor, residual: Optional[Tensor] = None,
        residual_scale: float = 1.0,
    ) -> Tensor:
        """One decoding step that updates its state in place (inference only): ``x_t`` ``[B, C_in]``
        is the input at ``position`` (an integer tensor, 0-dim or ``[B]``, on ``x_t``'s device),
        ``conv_state`` the ring ``[B, C_in, k]`` of :meth:`initial_conv_state` (position ``p`` in
        slot ``p % k``), ``residual`` ``[B, C]`` or None.  Returns ``y_t`` ``[B, C]`` and writes
        ``x_t`` into the ring; see :func:`transformer_kernels.glu_conv1d_update`."""
        self._check_causal("update")
        return glu_conv1d_update(
            x_t, conv_state, self.weight, self.bias, position=position, residual=residual,
            residual_scale=residual_scale, backend=self.backend,
        )

    def _check_causal(self, method: str) -> None:
        if self.padding != "causal":
            raise RuntimeError(
                f"GLUConv1d.{method}() needs padding='causal' (a 'same' convolution reads later positions), "
                f"got padding={self.padding!r}"
            )
