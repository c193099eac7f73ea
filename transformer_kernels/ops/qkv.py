"""Fused QKV projection: one GEMM with a packed weight whose epilogue writes
head-split queries, keys and values.

Registered as ``torch.ops.transformer_kernels.qkv_projection_forward`` (with a
fake kernel and autograd through ``qkv_projection_backward``) so it works
under ``torch.compile``.  The op's contract (:class:`QkvProjectionArgs`, the
output shape) comes first, then the public function, its checks and the
registered ops.

Output layout.  Every output is its own contiguous ``[*batch, H, L, Dh]``
tensor on every backend.  That is the layout the attention kernels read with
unit-stride rows, and a registered op may not return tensors that share
storage; separate outputs also let backward receive the n head-split
gradients separately and read them in place (views of one packed buffer
would make autograd re-pack their gradients into that buffer first).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from .._backend import backend_module, select_backend
from .._checks import check_same_dtype_device, check_tensor
from ._autocast import autocast
from ._call_plans import CallPlans, layout_key, prepared_forward
from ._library import RegisteredOp

__all__ = ["qkv_projection", "QkvProjectionArgs"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# --------------------------------------------------------------------------- the op's contract


@dataclasses.dataclass(frozen=True)
class QkvProjectionArgs:
    """The projection's arguments besides ``x``, ``weight`` and ``bias``."""

    num_heads: int

    def output_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        """``[*batch, H, L, Dh]`` of each output: every backend returns them as separate
        contiguous tensors."""
        *batch, seq_len, embed_dim = x.shape
        return (*batch, self.num_heads, seq_len, embed_dim // self.num_heads)


# --------------------------------------------------------------------------- public function


def qkv_projection(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    num_heads: int,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, ...]:
    r"""Project ``x`` to head-split queries, keys and values with one fused GEMM.

    With ``E = x.shape[-1]``, ``n = weight.shape[0] // E`` and ``Dh = E // num_heads``,
    output ``i`` (``0 <= i < n``) is::

        y_i   = x @ weight[i*E:(i+1)*E].T + bias[i*E:(i+1)*E]              # [*batch, L, E]
        out_i = y_i.view(*batch, L, num_heads, Dh).transpose(-3, -2)       # [*batch, H, L, Dh]

    i.e. the three ``nn.Linear`` + ``view`` + ``transpose`` of a multi-head
    attention layer, or ``nn.MultiheadAttention``'s packed
    ``F.linear(x, in_proj_weight, in_proj_bias).chunk(3, -1)`` followed by the
    head split.  The Triton backend runs one tiled GEMM over all ``n`` row
    blocks whose epilogue adds the bias and stores each tile straight into
    its head-split output; no transpose, chunk or contiguous pass follows.

    ``n = 3`` gives ``(q, k, v)`` (self-attention), ``n = 2`` gives ``(k, v)``
    (keys and values of a cross-attention memory), ``n = 1`` gives ``(q,)``.

    Args:
        x: ``[*batch, L, E]``, at least 2-D (``[L, E]`` is one unbatched
            sequence), any strides, ``E >= 1``.  For self-attention pass the
            layer input; for cross-attention call once with the decoder state
            and the ``E``-row query weight (``n = 1``) and once with the memory
            and the ``2*E``-row key/value weight (``n = 2``).
        weight: ``[n*E, E]`` with ``n`` in ``(1, 2, 3)``: the row blocks of the
            projections stacked in the order q | k | v, exactly as
            ``nn.MultiheadAttention.in_proj_weight`` holds them (or
            ``torch.cat([W_Q.weight, W_K.weight, W_V.weight])`` of three
            ``nn.Linear(E, E)``).  Any strides.
        bias: ``[n*E]`` (like ``in_proj_bias``) or ``None``.
        num_heads: ``H``, a positive int dividing ``E``.  ``Dh = E // H`` may be
            any size, including ones that are not multiples of 16 (e.g. ``E = 4``
            with two heads).
        backend: ``"auto"``, ``"triton"``, ``"cuda"`` or ``"eager"``; ``None``
            follows :func:`transformer_kernels.use_backend` and the
            ``TRANSFORMER_KERNELS_BACKEND`` environment variable.  ``"auto"``
            runs CPU tensors on eager (one ``F.linear`` with the packed weight,
            then the head split), and CUDA tensors on the CUDA extension where
            it is built and preferred on the GPU's architecture (README,
            "Backends"), else on Triton, else on eager.

    Returns:
        A tuple of ``n`` tensors, each ``[*batch, H, L, Dh]`` with the dtype
        of the computation (see Dtypes).  Each is a separate, contiguous
        tensor (they share no storage), so it can be passed to
        :func:`transformer_kernels.scaled_dot_product_attention` (or
        ``torch.nn.functional.scaled_dot_product_attention``) as is, and
        ``.view``/``.contiguous()`` on it cost nothing.

    Dtypes: float16, bfloat16, float32 (and float64 on the eager backend);
    ``weight`` and ``bias`` must have ``x``'s dtype and device.  Under
    ``torch.autocast`` the op runs in the autocast dtype the way ``nn.Linear``
    does: float16/bfloat16/float32 inputs are cast to
    ``torch.get_autocast_dtype(device_type)`` (bfloat16 on CPU and float16 on
    CUDA by default), float64 inputs are not cast.  The Triton kernels
    accumulate in float32 and round once, at the output.  float32 inputs use
    TF32 tensor cores exactly when torch allows TF32 for float32 matmuls,
    through either API (``torch.backends.cuda.matmul.fp32_precision = "tf32"``,
    ``allow_tf32 = True`` or ``torch.set_float32_matmul_precision("high")``);
    otherwise they run torch's own IEEE float32 matmuls, like ``nn.Linear``.

    Autograd: gradients for ``x``, ``weight`` and ``bias``; not twice
    differentiable.  Saved for backward: ``x`` and ``weight`` themselves (no
    copies).  The Triton backward reads the ``n`` head-split gradients in
    place (any strides shared by the ``n`` of them, unit stride along ``Dh``;
    others are copied first): ``grad_x = sum_i grad_i @ weight_i`` is one GEMM
    kernel, ``grad_weight = grad^T @ x`` another whose first column of tiles
    also sums ``grad_bias``, so the gradients are read once for both.
    Gradients that are only needed in part (a frozen weight, ``x`` without
    ``requires_grad``) are not computed.

    Raises:
        ValueError: ``E`` not divisible by ``num_heads``; ``weight`` not
            ``[n*E, E]`` with ``n`` in ``(1, 2, 3)``; ``bias`` not ``[n*E]``;
            tensors on different devices.
        TypeError: non-tensor arguments, non-floating or mismatched dtypes.
        transformer_kernels.BackendUnavailableError: an explicitly requested
            backend cannot serve the call (e.g. ``backend="triton"`` with
            CPU tensors and no ``TRITON_INTERPRET=1``, or float64).

    Example::

        mha = torch.nn.MultiheadAttention(512, 8, batch_first=True, device="cuda", dtype=torch.float16)
        q, k, v = transformer_kernels.qkv_projection(
            x, mha.in_proj_weight, mha.in_proj_bias, num_heads=8)       # each [B, 8, L, 64]
        out = transformer_kernels.scaled_dot_product_attention(q, k, v, is_causal=True)
    """
    check_tensor("x", x, min_ndim=2)
    x, weight, bias = autocast(x, x, weight, bias)

    def checked() -> tuple[QkvProjectionArgs, str]:
        check_tensor("x", x, dtypes=_DTYPES)
        _check_arguments(x, weight, bias, num_heads)
        args = QkvProjectionArgs(num_heads)
        chosen = select_backend("qkv", "qkv_projection", backend, x, x, weight, bias, args)  # raises as for any call
        # No tokens: nothing for a kernel to do; eager's GEMMs give the empty results and zero gradients.
        return args, "eager" if x.numel() == 0 else chosen

    tensors = layout_key(backend, x, weight, bias) if type(num_heads) is int else None
    (args, name), forward = _PLANS.decide(
        None if tensors is None else (*tensors, num_heads), checked,
        lambda decision: prepared_forward("qkv", decision[1], _qkv_projection_forward, x, weight, bias, decision[0]),
    )
    return tuple(qkv_projection_forward.call_planned(forward, x, weight, bias, args, name))


# qkv_projection's checked decisions (its QkvProjectionArgs and backend), and the forward prepared for
# them, per call layout (_call_plans.py).
_PLANS = CallPlans()


# --------------------------------------------------------------------------- argument checks


def _check_arguments(x: torch.Tensor, weight: object, bias: object, num_heads: object) -> None:
    embed_dim = x.shape[-1]
    if embed_dim < 1:
        raise ValueError(f"x must have a non-empty last dimension (the embedding dim E), got shape {tuple(x.shape)}")
    if isinstance(num_heads, bool) or not isinstance(num_heads, int):
        raise TypeError(f"num_heads must be an int, got {type(num_heads).__name__}")
    if num_heads < 1:
        raise ValueError(f"num_heads must be positive, got {num_heads}")
    if embed_dim % num_heads != 0:
        raise ValueError(
            f"embed dim E = x.shape[-1] = {embed_dim} must be divisible by num_heads = {num_heads}"
        )
    check_tensor("weight", weight, ndim=2)
    rows, cols = weight.shape
    if cols != embed_dim or rows % embed_dim != 0 or rows // embed_dim not in (1, 2, 3):
        raise ValueError(
            f"weight must have shape [n*E, E] with E = x.shape[-1] = {embed_dim} and n in (1, 2, 3) "
            f"(packed q | k | v rows, like nn.MultiheadAttention.in_proj_weight), "
            f"got weight of shape {tuple(weight.shape)}"
        )
    if bias is not None:
        check_tensor("bias", bias, ndim=1)
        if bias.shape[0] != rows:
            raise ValueError(
                f"bias must have shape [n*E] = [{rows}] to match weight.shape[0], got bias of shape {tuple(bias.shape)}"
            )
    check_same_dtype_device("x", x, weight=weight, bias=bias)


# --------------------------------------------------------------------------- registered ops

qkv_projection_forward = RegisteredOp(
    "qkv_projection_forward", ("Tensor x", "Tensor weight", "Tensor? bias"), QkvProjectionArgs, "Tensor[]"
)
qkv_projection_backward = RegisteredOp(
    "qkv_projection_backward", ("Tensor[] grads", "Tensor x", "Tensor weight"), QkvProjectionArgs,
    "(Tensor, Tensor, Tensor)",
    flags=("bool has_bias", "bool needs_grad_x", "bool needs_grad_weight", "bool needs_grad_bias"),
)


@qkv_projection_forward.implement
def _qkv_projection_forward(x, weight, bias, args: QkvProjectionArgs, backend: str) -> list[torch.Tensor]:
    return backend_module("qkv", backend).forward(x, weight, bias, args)


@qkv_projection_forward.fake
def _qkv_projection_forward_fake(x, weight, bias, args: QkvProjectionArgs, backend: str):
    num_proj = weight.shape[0] // x.shape[-1]
    return [x.new_empty(args.output_shape(x)) for _ in range(num_proj)]


@qkv_projection_backward.implement
def _qkv_projection_backward(
    grads, x, weight, args: QkvProjectionArgs, has_bias, needs_grad_x, needs_grad_weight, needs_grad_bias, backend
):
    """``(grad_x, grad_weight, grad_bias)``; a gradient not asked for is an empty tensor."""
    return backend_module("qkv", backend).backward(
        grads, x, weight, args, has_bias, needs_grad_x, needs_grad_weight, needs_grad_bias
    )


@qkv_projection_backward.fake
def _qkv_projection_backward_fake(
    grads, x, weight, args, has_bias, needs_grad_x, needs_grad_weight, needs_grad_bias, backend
):
    grad_x = x.new_empty(x.shape) if needs_grad_x else x.new_empty(0)
    grad_weight = weight.new_empty(weight.shape) if needs_grad_weight else weight.new_empty(0)
    grad_bias = weight.new_empty(weight.shape[0]) if has_bias and needs_grad_bias else weight.new_empty(0)
    return grad_x, grad_weight, grad_bias


def _setup_context(ctx, tensors, args: QkvProjectionArgs, output) -> None:
    x, weight, bias = tensors
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None
    ctx.args = args
    ctx.output_shape = args.output_shape(x)


def _backward(ctx, grads):
    x, weight = ctx.saved_tensors
    needs_x, needs_weight, needs_bias = ctx.needs_input_grad[:3]
    if not (needs_x or needs_weight or needs_bias):
        return (None, None, None), {}
    # An output that took no part in the loss has no gradient.
    grads = [x.new_zeros(ctx.output_shape) if g is None else g for g in grads]
    runner = qkv_projection_forward.backward_runner(ctx, *grads, x, weight)
    grad_x, grad_weight, grad_bias = qkv_projection_backward.call_planned(
        runner, grads, x, weight, ctx.args, ctx.has_bias, needs_x, needs_weight, needs_bias and ctx.has_bias,
        ctx.backend,
    )
    return (
        grad_x if needs_x else None,
        grad_weight if needs_weight else None,
        grad_bias if needs_bias and ctx.has_bias else None,
    ), {}


qkv_projection_forward.register_autograd(_backward, _setup_context)


def _projection_flops(x, weight) -> int:
    """torch's count for ``F.linear(x, weight)``: ``2 * tokens * E * n*E``."""
    return 2 * math.prod(x[:-1]) * x[-1] * weight[0]


@qkv_projection_forward.count_flops
def _forward_flops(x, weight, bias, args, backend) -> int:
    return _projection_flops(x, weight)


@qkv_projection_backward.count_flops
def _backward_flops(grads, x, weight, args, has_bias, needs_grad_x, needs_grad_weight, needs_grad_bias, backend) -> int:
    """As torch counts ``F.linear``'s backward: a GEMM per gradient of ``x`` and ``weight`` asked for."""
    return (int(needs_grad_x) + int(needs_grad_weight)) * _projection_flops(x, weight)
