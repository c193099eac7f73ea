"""Argument checks shared by the modules."""

from __future__ import annotations

from typing import Optional

from .._backend import backend_names


def check_backend(backend: Optional[str]) -> Optional[str]:
    """``backend`` if it is None or a backend name, else a ValueError naming the choices."""
    if backend is not None and backend not in backend_names():
        raise ValueError(f"backend must be None or one of {backend_names()}, got {backend!r}")
    return backend
