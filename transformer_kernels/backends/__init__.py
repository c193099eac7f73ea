"""Backends: the plain functions behind the registered ops.

Every package here registers itself with :func:`transformer_kernels._backend.register_backend`
when imported, and this module imports them all: a new backend is a new package, with no edit
elsewhere.  The packages import nothing heavy (triton, the CUDA extension) until one of their
op modules is loaded.
"""

import importlib
import pkgutil

for _package in pkgutil.iter_modules(__path__):
    if _package.ispkg:
        importlib.import_module(f"{__name__}.{_package.name}")
