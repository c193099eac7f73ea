"""A public function's checked decisions, kept per call layout.

At the seeds' short sequences a GPU runs each kernel in a few microseconds, and what a call does on
the host before it sets the wall-clock (issue 9's target: 20 us per forward).  Most of that is
argument checking, normalization and the backend choice, all of which follow from the call's
layout: its tensors' shapes, strides, dtypes and devices, its scalar arguments, the backend asked
for.  The first call of a layout takes the checked route and, where the result can be replayed
with the call's own tensors, keeps a plan; later calls of that layout use the plan.

A plan's key must hold everything the checked route reads.  With ``verify`` set (the test suite
sets it), every call that finds a plan also takes the checked route and fails unless it decides
the same, so a key that misses something shows in any test whose calls differ in it.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Optional, TypeVar

import torch

from .. import _backend
from ._library import plain_eager_call

__all__ = ["CallPlans", "layout_key", "prepared_forward"]

Decision = TypeVar("Decision")


def layout_key(backend: Optional[str], *tensors: Optional[torch.Tensor]) -> Optional[tuple]:
    """The backend asked for and each tensor's shape, strides, dtype and device (None for None): the
    part of a plan's key that every op shares.  None where the call may have no plan: not
    :func:`plain_eager_call`, or ``backend`` not a valid name (the checked route words that, after
    the checks that come first)."""
    if not plain_eager_call(*tensors):
        return None
    try:
        requested = _backend.requested_backend(backend)
    except ValueError:
        return None
    key = [requested]  # a loop: a generator costs a tenth of the key's host time
    for t in tensors:
        key.append(None if t is None else (t.shape, t.stride(), t.dtype, t.device))
    return tuple(key)


def prepared_forward(op: str, backend: str, implementation: Callable, *arguments: Any) -> Callable:
    """What a plan runs for the registered forward of ``op``: the backend's forward prepared for the
    layout of the call of ``arguments`` (``forward``'s), where its module has a ``prepare_forward``
    that takes it, else ``implementation``, the registered op's."""
    prepare = getattr(_backend.backend_module(op, backend), "prepare_forward", None)
    prepared = None if prepare is None else prepare(*arguments)
    return implementation if prepared is None else prepared


class CallPlans:
    """Plans by layout key, at most ``max_plans`` (decoding meets a new length on every step).  A
    plan holds the backend registry it was chosen from: registering a backend starts afresh."""

    verify = False

    def __init__(self, max_plans: int = 4096) -> None:
        self._plans: dict[Hashable, tuple[Any, Any]] = {}
        self._max_plans = max_plans

    def get(self, key: Hashable, check: Callable[[Any], None]) -> Optional[Any]:
        """The plan kept for ``key``, or None.  Under ``verify``, ``check(plan)`` runs first: it
        takes the checked route and raises unless that decides what the plan holds."""
        entry = self._plans.get(key)
        if entry is None or entry[0] is not _backend.registry_version():
            return None
        if self.verify:
            check(entry[1])
        return entry[1]

    def put(self, key: Hashable, plan: Any) -> None:
        if len(self._plans) >= self._max_plans:
            self._plans.clear()
        self._plans[key] = (_backend.registry_version(), plan)

    def decide(
        self, key: Optional[Hashable], checked: Callable[[], Decision], prepare: Callable[[Decision], Any]
    ) -> tuple[Decision, Any]:
        """``checked()`` (the checked route's decision, compared with ``==``) and ``prepare(decision)``
        (the forward the plan runs, which the checks do not compare: a prepared backend forward
        verifies its own), made once per ``key``; ``(checked(), None)`` every time where ``key`` is
        None (a call that may have no plan)."""
        if key is None:
            return checked(), None

        def check(kept: tuple[Decision, Any]) -> None:
            decided = checked()
            if decided != kept[0]:
                raise AssertionError(f"the plan kept for this call's layout decides {kept[0]}, the checks {decided}")

        plan = self.get(key, check)
        if plan is None:
            decision = checked()
            plan = decision, prepare(decision)
            self.put(key, plan)
        return plan
