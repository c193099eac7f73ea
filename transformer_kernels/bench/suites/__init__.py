"""The benchmark suites: one module per op, registered by name in :data:`SUITES`.

The benchmark command (``python -m transformer_kernels.bench``) and the pytest suites in
``benchmarks/`` both take their cases and targets from here; nothing else lists them.

A suite module provides:

* ``OP``: the op's name in results and reports;
* ``TARGETS``: a list of :class:`Target`;
* ``groups(setting) -> list[Group]``: what to time on ``setting`` (device, dtype, size), one
  :class:`Group` per (case, direction).  Building a group allocates nothing: its setups run
  when the group is measured.

Adding a suite is adding a module here and a line to :data:`SUITES`, and for pytest a
``benchmarks/bench_<name>.py`` naming it.  A suite that cannot load (a peer library it imports is
missing) is reported as one "n/a" row with the reason.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Optional, Sequence, Union

import torch

__all__ = ["SUITES", "Backends", "Group", "Impl", "Setting", "SuiteUnavailable", "Target", "attended_pairs", "load",
           "max_abs_error"]

# Suite name (what --only takes) -> module.
SUITES = {
    "attention": "transformer_kernels.bench.suites.attention",
    "qkv": "transformer_kernels.bench.suites.qkv",
    "glu": "transformer_kernels.bench.suites.glu",
    "nn": "transformer_kernels.bench.suites.nn",
    "models": "transformer_kernels.bench.suites.models",
}

Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]
DIRECTIONS = ("fwd", "bwd", "fwd+bwd")
# FLOPs of a direction in forwards, for GEMM-shaped ops: a backward is two GEMMs (input and weight).
GEMM_DIRECTION_COST = {"fwd": 1.0, "bwd": 2.0, "fwd+bwd": 3.0}
SIZES = ("tiny", "quick", "full")


class SuiteUnavailable(Exception):
    """A registered suite that cannot run in this installation; the message says why."""


def load(name: str):
    """The suite module registered as ``name``; raises :class:`SuiteUnavailable` with the reason."""
    if name not in SUITES:
        raise ValueError(f"suite must be one of {tuple(SUITES)}, got {name!r}")
    try:
        return importlib.import_module(SUITES[name])
    except ImportError as error:  # a dependency of the suite this installation lacks
        raise SuiteUnavailable(f"{SUITES[name]} cannot be imported: {error}") from error


@dataclasses.dataclass(frozen=True)
class Setting:
    """Where and how big: ``size`` is ``"full"``, ``"quick"`` (the CPU default: a subset that
    runs in minutes) or ``"tiny"`` (toy shapes, for the command's own tests)."""

    device: torch.device
    dtype: torch.dtype
    size: str

    def __post_init__(self):
        if self.size not in SIZES:
            raise ValueError(f"size must be one of {SIZES}, got {self.size!r}")

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def ours(self) -> str:
        """The backend the targets hold to account here."""
        return "triton" if self.cuda else "eager"

    @property
    def directions(self) -> tuple[str, ...]:
        """The directions timed: a quick run leaves out ``bwd`` (``fwd+bwd`` minus ``fwd``, roughly)."""
        return ("fwd", "fwd+bwd") if self.size == "quick" else DIRECTIONS

    @property
    def exact_dtype(self) -> torch.dtype:
        """The dtype errors are measured against: float64 on CPU, float32 on GPUs (fast there)."""
        return torch.float32 if self.cuda else torch.float64


@dataclasses.dataclass(frozen=True)
class Target:
    """``impl`` at least ``min_speedup`` times as fast as ``baseline`` on (op, case, direction) on
    ``device`` (a device type), and when given, peak memory at most ``max_memory_ratio`` of it."""

    op: str
    case: str
    direction: str
    impl: str
    baseline: str
    min_speedup: float
    device: str
    max_memory_ratio: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class Impl:
    """A set-up implementation: ``forward()`` computes its outputs from ``leaves`` (what the
    backward direction differentiates).  ``comparable``: its outputs are the op's (False for a
    speed-of-light row computing something else: no error is measured)."""

    forward: Callable[[], Tensors]
    leaves: Sequence[torch.Tensor]
    comparable: bool = True


@dataclasses.dataclass
class Group:
    """One (op, case, direction): the implementations timed interleaved against each other.

    ``setups``: implementation name -> zero-argument function that allocates its inputs and
    returns an :class:`Impl` (raising ``BackendUnavailableError``, or any error for a peer, when
    it cannot run: it is then reported "n/a" with the message).  ``unavailable``: implementations
    not even set up, with the reason.  ``error``: outputs -> max abs error against the exact
    reference (float64 on CPU, float32 on GPUs).  ``flops``: floating-point operations of one call
    in this direction, useful work only (real query rows against the keys each sees, weights against
    the real tokens they read), or None where the group counts none.  ``params``: what the plots
    draw on: ``length``, ``padding`` (fraction of padded keys), ``family`` (cases that differ only
    in ``length`` or ``padding``).  ``ours``: the package's implementations among ``setups``."""

    op: str
    case: str
    direction: str
    setups: dict[str, Callable[[], Impl]]
    unavailable: dict[str, str]
    error: Callable[[Tensors], float]
    flops: Optional[float]
    ours: tuple[str, ...]
    params: dict = dataclasses.field(default_factory=dict)
    reference: str = "reference"


def attended_pairs(lengths: Sequence[float], causal: bool) -> float:
    """The (query, key) pairs self-attention over sequences of ``lengths`` real tokens computes:
    n² for n tokens, n(n + 1) / 2 causal; padding rows and keys none."""
    return sum(n * (n + 1) / 2 if causal else n * n for n in lengths)


def max_abs_error(outputs: Tensors, exact: Tensors, rows: Optional[torch.Tensor] = None) -> float:
    """Max abs difference over every output (``rows``: a bool mask of the positions that count,
    broadcastable to each output)."""
    outputs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    exact = [exact] if isinstance(exact, torch.Tensor) else list(exact)
    error = 0.0
    for out, ref in zip(outputs, exact, strict=True):
        difference = (out.detach().to(ref.dtype) - ref).abs()
        if rows is not None:
            difference = difference.masked_fill(~rows, 0.0)
        error = max(error, difference.max().item())
    return error


def backend_reasons(op: str, device: torch.device, dtype: torch.dtype) -> dict[str, Optional[str]]:
    """Every registered backend -> None if it can run ``op`` on ``device`` in ``dtype``, else why not."""
    from ... import _backend

    reasons = {}
    for name, backend in _backend._registry.items():
        reason = backend.device_reason(device, dtype)
        reasons[name] = reason if reason is not None or op in backend.ops else f"the {name} backend has no {op} kernel"
    return reasons


@dataclasses.dataclass(frozen=True)
class Backends:
    """The registered backends for an op on a setting: ``names`` in auto's order, ``unavailable``
    the ones that cannot be timed here with the reason, and :attr:`ours` the others."""

    names: tuple[str, ...]
    unavailable: dict[str, str]

    @property
    def ours(self) -> tuple[str, ...]:
        return tuple(name for name in self.names if name not in self.unavailable)


def backends_for(op: str, setting: Setting) -> Backends:
    """:func:`backend_reasons` for timing on ``setting``: Triton's interpreter is not timed."""
    reasons = backend_reasons(op, setting.device, setting.dtype)
    if reasons.get("triton") is None and not setting.cuda:
        reasons["triton"] = "Triton's interpreter (TRITON_INTERPRET=1) is for tests, not timing"
    return Backends(tuple(reasons), {name: reason for name, reason in reasons.items() if reason is not None})
