"""The compiled CUDA C++ extension, when it was built.

The extension is optional at build time; until it exists every call reports
why it cannot be used, and ``backend="auto"`` moves on to Triton.
"""

from __future__ import annotations

import functools
import importlib
from typing import Optional


@functools.lru_cache(maxsize=None)
def _load():
    # Probed once: backend="auto" asks on every CUDA call, and a failed import
    # searches the file system each time it is retried.
    try:
        return importlib.import_module("transformer_kernels._C")
    except ImportError:
        return None


def unavailable_reason() -> Optional[str]:
    if _load() is None:
        return "the CUDA extension transformer_kernels._C is not built"
    return None
