"""The gradient self-check (``python -m transformer_kernels.bench --check``): no timing.

For every op and every backend that can run on the device, over a small grid (padding, both causal
alignments, odd head dims and lengths, GQA, dropout off; odd projection and convolution shapes), the
outputs and every input gradient are compared with the seeds' reference math in float64:

- float64 (the eager backend): max abs error at most ``1e-9 * (1 + max |exact|)``;
- float32, float16, bfloat16: FlashAttention's rule, max abs error at most twice (+ 1e-5) that of
  PyTorch's own math run in the same dtype on the same inputs and output gradients.

:func:`outputs_and_grads` is also what the test suite compares with.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch

import transformer_kernels as tk
from transformer_kernels import reference

from .. import BackendUnavailableError
from .suites import backend_reasons

Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]
EXACT_TOL = 1e-9


class Results(NamedTuple):
    outputs: list  # fn's outputs (one tensor becomes a list of one)
    grads: list  # gradients of the floating-point inputs, in order
    grad_outputs: list  # the output gradients used

    @property
    def all(self) -> list:
        return [*self.outputs, *self.grads]


def as_list(tensors) -> list:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def outputs_and_grads(
    fn: Callable, inputs: Sequence, grad_outputs: Optional[Tensors] = None, *, dtype: Optional[torch.dtype] = None,
    backward: bool = True,
) -> Results:
    """``fn(*leaves)`` and the gradients of its floating-point leaves.

    The leaves are detached copies of the floating-point tensors in ``inputs`` (cast to ``dtype``
    when given), each differentiated; other entries (None, bool masks, numbers) are passed as they
    are (close over a floating-point tensor that must not be differentiated).  ``grad_outputs``: one
    per output (cast to its dtype), or None for ``torch.randn_like`` of each output, drawn after
    ``fn`` ran.  ``backward=False`` computes no gradients."""
    leaves = [
        t.detach().to(dtype or t.dtype).requires_grad_(backward)
        if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        for t in inputs
    ]
    outputs = as_list(fn(*leaves))
    if not backward:
        return Results(outputs, [], [])
    if grad_outputs is None:
        grad_outputs = [torch.randn_like(o) for o in outputs]
    grad_outputs = as_list(grad_outputs)
    assert len(grad_outputs) == len(outputs)
    tensor_leaves = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = torch.autograd.grad(outputs, tensor_leaves, [g.to(o.dtype) for g, o in zip(grad_outputs, outputs)])
    return Results(outputs, list(grads), grad_outputs)


# ----------------------------------------------------------------------------- the grid


@dataclasses.dataclass(frozen=True)
class CheckCase:
    """One point of an op's grid: ``inputs(device)`` gives float64 tensors (and masks), ``ours(backend)``
    and ``reference`` the functions compared on them; ``names`` name the outputs then the gradients
    (none where ``backward`` is False: an op without autograd)."""

    op: str
    name: str
    inputs: Callable[[torch.device], list]
    ours: Callable[[str], Callable]
    reference: Callable
    names: tuple[str, ...]
    backward: bool = True


def _randn(*shape: int) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda generator: torch.randn(*shape, generator=generator, dtype=torch.float64)


def _attention(name: str, batch: int, heads: int, kv_heads: int, lq: int, lk: int, head_dim: int, *,
               padded: bool = False, causal: Optional[str] = None) -> CheckCase:
    """``causal``: None, ``"top_left"`` (``is_causal``) or ``"bottom_right"`` (``causal_lower_right`` mask)."""
    from torch.nn.attention.bias import causal_lower_right

    def inputs(device: torch.device) -> list:
        generator = torch.Generator().manual_seed(0)
        q = torch.randn(batch, heads, lq, head_dim, generator=generator, dtype=torch.float64)
        k, v = (torch.randn(batch, kv_heads, lk, head_dim, generator=generator, dtype=torch.float64) for _ in range(2))
        padding = None
        if padded:  # lengths from 0 (a sequence with no key: its rows give 0) to lk
            lengths = torch.linspace(0, lk, batch).round().long()
            padding = torch.arange(lk)[None, :] >= lengths[:, None]
        return [t if t is None else t.to(device) for t in (q, k, v, padding)]

    gqa = kv_heads != heads
    mask = causal_lower_right(lq, lk) if causal == "bottom_right" else None

    def ours(backend: str) -> Callable:
        return lambda q, k, v, padding: tk.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal == "top_left", enable_gqa=gqa, key_padding_mask=padding,
            backend=backend)

    def exact(q, k, v, padding):
        return reference.attention(q, k, v, is_causal=causal is not None, causal_bottom_right=causal == "bottom_right",
                                   enable_gqa=gqa, key_padding_mask=padding, masked_value=float("-inf"))

    return CheckCase("attention", name, inputs, ours, exact, ("out", "grad query", "grad key", "grad value"))


def _qkv(name: str, batch: int, length: int, embed_dim: int, heads: int, bias: bool = True) -> CheckCase:
    def inputs(device: torch.device) -> list:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(batch, length, embed_dim, generator=generator, dtype=torch.float64)
        weight = torch.randn(3 * embed_dim, embed_dim, generator=generator, dtype=torch.float64) / embed_dim**0.5
        b = torch.randn(3 * embed_dim, generator=generator, dtype=torch.float64) if bias else None
        return [t if t is None else t.to(device) for t in (x, weight, b)]

    return CheckCase(
        "qkv", name, inputs, lambda backend: lambda x, w, b: tk.qkv_projection(x, w, b, num_heads=heads, backend=backend),
        lambda x, w, b: reference.qkv_projection(x, w, b, heads),
        ("out q", "out k", "out v", "grad x", "grad weight", *(("grad bias",) if bias else ())))


def _glu_inputs(batch: int, channels: int, out_channels: int, length: int, kernel_size: int) -> Callable:
    """``inputs(device)`` of a GLU convolution case: ``x``, a weight of unit-variance outputs, a bias."""
    def inputs(device: torch.device) -> list:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(batch, channels, length, generator=generator, dtype=torch.float64)
        weight = torch.randn(2 * out_channels, channels, kernel_size, generator=generator, dtype=torch.float64)
        bias = torch.randn(2 * out_channels, generator=generator, dtype=torch.float64)
        return [t.to(device) for t in (x, weight / (channels * kernel_size) ** 0.5, bias)]

    return inputs


def _glu(name: str, batch: int, channels: int, out_channels: int, length: int, kernel_size: int, *,
         padding: str = "same", pad_value: float = 0.0, residual: bool = False) -> CheckCase:
    scale = 0.5**0.5 if residual else 1.0
    inputs = _glu_inputs(batch, channels, out_channels, length, kernel_size)

    def call(fn, x, w, b, **kwargs):
        return fn(x, w, b, padding=padding, pad_value=pad_value, residual=x if residual else None,
                  residual_scale=scale, **kwargs)

    return CheckCase(
        "glu_conv", name, inputs, lambda backend: lambda x, w, b: call(tk.glu_conv1d, x, w, b, backend=backend),
        lambda x, w, b: call(reference.glu_conv1d, x, w, b), ("out", "grad x", "grad weight", "grad bias"))


def _glu_update(name: str, batch: int, channels: int, out_channels: int, length: int, kernel_size: int) -> CheckCase:
    """``glu_conv1d_update`` stepping through a sequence from a ring of ones, against the sequence's
    causal convolution with padding value 1."""
    inputs = _glu_inputs(batch, channels, out_channels, length, kernel_size)

    def ours(backend: str) -> Callable:
        def steps(x, w, b):
            ring = torch.ones(batch, channels, kernel_size, dtype=x.dtype, device=x.device)
            with torch.no_grad():
                return torch.stack([
                    tk.glu_conv1d_update(x[:, :, t], ring, w, b, position=torch.tensor(t, device=x.device),
                                         backend=backend)
                    for t in range(length)
                ], 2)
        return steps

    return CheckCase("glu_conv_update", name, inputs, ours,
                     lambda x, w, b: reference.glu_conv1d(x, w, b, padding="causal", pad_value=1.0), ("out",),
                     backward=False)


GRID = [
    _attention("padded_B3_H4_L13_D24", 3, 4, 4, 13, 13, 24, padded=True),
    _attention("causal_top_left_Lq7_Lk12_D40", 2, 2, 2, 7, 12, 40, causal="top_left"),
    _attention("causal_bottom_right_Lq9_Lk14_D32", 2, 2, 2, 9, 14, 32, causal="bottom_right"),
    _attention("padded_causal_B2_H2_L17_D33", 2, 2, 2, 17, 17, 33, padded=True, causal="top_left"),
    _attention("gqa_H6_KV2_Lq11_Lk19_D16", 2, 6, 2, 11, 19, 16, padded=True),
    _qkv("B2_L7_E48_H4", 2, 7, 48, 4),
    _qkv("B3_L5_E36_H4_no_bias", 3, 5, 36, 4, bias=False),
    _glu("same_residual_B2_C12_L9_k3", 2, 12, 12, 9, 3, residual=True),
    _glu("causal_pad1_B2_C10to6_L7_k4", 2, 10, 6, 7, 4, padding="causal", pad_value=1.0),
    _glu("same_B1_C8_L5_k5", 1, 8, 8, 5, 5),
    _glu_update("B3_C10to6_L6_k3", 3, 10, 6, 6, 3),
]


# ----------------------------------------------------------------------------- running it


@dataclasses.dataclass(frozen=True)
class CheckResult:
    op: str
    backend: str
    case: str
    dtype: str
    status: str  # "pass", "FAIL", "n/a"
    tensor: Optional[str] = None  # the worst tensor (largest error / bound)
    error: Optional[float] = None
    bound: Optional[float] = None
    rule: str = ""
    reason: Optional[str] = None


def check_dtypes(device: torch.device) -> tuple[torch.dtype, ...]:
    if device.type == "cuda":
        return (torch.float64, torch.float32, torch.float16, torch.bfloat16)
    return (torch.float64, torch.float32)


def _run_case(case: CheckCase, backend: str, dtype: torch.dtype, device: torch.device) -> CheckResult:
    label = dict(op=case.op, backend=backend, case=case.name, dtype=str(dtype).removeprefix("torch."))
    torch.manual_seed(0)
    exact_inputs = case.inputs(device)
    low_inputs = [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in exact_inputs]
    try:
        ours = outputs_and_grads(case.ours(backend), low_inputs, backward=case.backward)
    except BackendUnavailableError as error:
        return CheckResult(**label, status="n/a", reason=str(error))
    exact = outputs_and_grads(case.reference, exact_inputs, ours.grad_outputs, dtype=torch.float64,
                              backward=case.backward)
    if dtype == torch.float64:
        rule = f"≤ {EXACT_TOL:.0e}·(1 + max|exact|)"
        bounds = [EXACT_TOL * (1 + e.abs().max().item()) for e in exact.all]
    else:
        rule = f"≤ 2 × torch's own {label['dtype']} error + 1e-5"
        torch_low = outputs_and_grads(case.reference, low_inputs, ours.grad_outputs, backward=case.backward)
        bounds = [2 * (t.double() - e).abs().max().item() + 1e-5 for t, e in zip(torch_low.all, exact.all)]
    errors = [(o.double() - e).abs().max().item() if torch.isfinite(o).all() else float("inf")
              for o, e in zip(ours.all, exact.all)]
    worst = max(range(len(errors)), key=lambda i: errors[i] / bounds[i])
    dtypes_kept = all(o.dtype == dtype for o in ours.all)
    status = "pass" if all(e <= b for e, b in zip(errors, bounds)) and dtypes_kept else "FAIL"
    return CheckResult(**label, status=status, tensor=case.names[worst], error=errors[worst], bound=bounds[worst],
                       rule=rule, reason=None if dtypes_kept else "outputs or gradients changed dtype")


def run_check(device: torch.device, dtypes: Sequence[torch.dtype], ops: Optional[Sequence[str]] = None,
              grid: Optional[Sequence[CheckCase]] = None) -> list[CheckResult]:
    """Every case of ``grid`` (default :data:`GRID`) of the ``ops`` (default all) in every dtype, on every backend."""
    results = []
    for case in GRID if grid is None else grid:
        if ops is not None and case.op not in ops:
            continue
        for dtype in dtypes:
            for backend, reason in backend_reasons(case.op, device, dtype).items():
                label = dict(op=case.op, backend=backend, case=case.name, dtype=str(dtype).removeprefix("torch."))
                if reason is not None:
                    results.append(CheckResult(**label, status="n/a", reason=reason))
                    continue
                try:
                    results.append(_run_case(case, backend, dtype, device))
                except Exception as error:  # a crash is a failure, reported with the others
                    results.append(CheckResult(**label, status="FAIL", reason=f"{type(error).__name__}: {error}"))
    return results


def check_table(results: Sequence[CheckResult], show_unavailable: bool = False) -> str:
    header = ["op", "backend", "case", "dtype", "worst tensor", "max error", "bound", "rule", "result"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        if r.status == "n/a" and not show_unavailable:
            continue
        result = r.status if r.reason is None else f"{r.status}: {r.reason}"
        error = "—" if r.error is None else f"{r.error:.2e}"
        bound = "—" if r.bound is None else f"{r.bound:.2e}"
        rule = (r.rule or "—").replace("|", "\\|")  # a markdown cell: max|exact| would split it
        lines.append(f"| {r.op} | {r.backend} | {r.case} | {r.dtype} | {r.tensor or '—'} | {error} | {bound} "
                     f"| {rule} | {result} |")
    return "\n".join(lines)
