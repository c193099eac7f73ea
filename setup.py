"""Build script.

Supported: torch >= 2.11 with the triton it ships with (torch 2.11 pairs with triton 3.6, torch 2.13 with
triton 3.9); ``transformer_kernels`` refuses an older torch on import and the triton backend an older triton.

torch is deliberately not a requirement: it is the user's to install (a CPU or CUDA build of their choice),
and listing it would let pip pull a multi-GB CUDA wheel.  CI installs the extras below with the pins in
``.ci/constraints/``.

The CUDA C++ extension ``transformer_kernels._C`` (``csrc/``) is built when torch has CUDA and nvcc is
found, or when ``TRANSFORMER_KERNELS_BUILD_CUDA=1`` forces it (then anything missing is an error); ``=0``
skips it (a quick pure-Python install on a CUDA machine).  It
needs the CUTLASS/CuTe headers: from the ``nvidia-cutlass`` wheel (``import cutlass_library``) or from
a CUTLASS checkout named by ``CUTLASS_PATH``.  ``TORCH_CUDA_ARCH_LIST`` picks the architectures (default
``8.0;9.0a``) and ``MAX_JOBS`` the parallel compile jobs.  Build it with::

    pip install nvidia-cutlass && pip install --no-build-isolation -e .

(``--no-build-isolation`` lets the build see the installed torch and CUTLASS).  Otherwise the
pure-Python package is installed and one line says why the extension was skipped; the package then
imports and runs without it.
"""

import os
import runpy
import shutil
import sys
from typing import Optional

from setuptools import find_packages, setup

TRITON = "triton>=3.6"
# CUTLASS/CuTe headers for the CUDA extension (a header-only, pure-Python wheel).  CI installs it with
# --no-deps for the compile tests: the headers need none of its Python generator's dependencies.
CUTLASS = "nvidia-cutlass>=4.2"
FORCE_ENV = "TRANSFORMER_KERNELS_BUILD_CUDA"
ROOT = os.path.dirname(os.path.abspath(__file__))
BUILD_CONFIG = runpy.run_path(os.path.join(ROOT, "csrc", "build_config.py"))


def _skip_reason() -> Optional[str]:
    """Why the extension cannot be built here, or None."""
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError:
        return "torch is not importable in the build environment (install with --no-build-isolation)"
    if os.environ.get(FORCE_ENV) == "0":
        return f"{FORCE_ENV}=0"
    if os.environ.get(FORCE_ENV) != "1":
        if torch.version.cuda is None:
            return f"torch {torch.__version__} has no CUDA (set {FORCE_ENV}=1 to build anyway)"
        if CUDA_HOME is None and shutil.which("nvcc") is None:
            return "nvcc was not found (set CUDA_HOME)"
    if BUILD_CONFIG["cutlass_include"]() is None:
        return BUILD_CONFIG["cutlass_missing_message"]()
    return None


def cuda_extension() -> dict:
    """``setup()``'s ``ext_modules`` and ``cmdclass`` for the extension, or nothing (after one line saying why)."""
    reason = _skip_reason()
    if reason is not None:
        if os.environ.get(FORCE_ENV) == "1":
            sys.exit(f"transformer_kernels: cannot build the CUDA extension ({FORCE_ENV}=1): {reason}")
        print(f"transformer_kernels: CUDA extension skipped: {reason}", file=sys.stderr)
        return {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", BUILD_CONFIG["DEFAULT_ARCH_LIST"])
    extension = CUDAExtension(
        "transformer_kernels._C",
        ["csrc/bindings.cpp", *BUILD_CONFIG["KERNEL_SOURCES"], *BUILD_CONFIG["HOST_SOURCES"]],
        include_dirs=[os.path.join(ROOT, "csrc"), BUILD_CONFIG["cutlass_include"]()],
        # --threads: each source compiles its architectures in parallel, besides MAX_JOBS sources at once.
        extra_compile_args={"cxx": ["-O3"], "nvcc": [*BUILD_CONFIG["NVCC_FLAGS"], "--threads=2"]},
    )
    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildExtension}}


setup(
    name="transformer_kernels",
    version="0.1.0",
    description="Fused Triton/CUDA kernels for masked attention, fused QKV projection and GLU conv1d",
    packages=find_packages(include=["transformer_kernels", "transformer_kernels.*"]),
    python_requires=">=3.10",
    extras_require={
        "triton": [TRITON],
        "cuda": [CUTLASS],
        # matplotlib: tests/test_bench.py checks that the report draws its plots.
        "test": [TRITON, "pytest>=8", "hypothesis>=6", "numpy", "matplotlib"],
        # The benchmark command's plots and progress bar; without them it skips the plots and prints plain lines.
        "bench": [TRITON, "pytest>=8", "numpy", "matplotlib", "tqdm"],
    },
    entry_points={"console_scripts": ["transformer-kernels-bench = transformer_kernels.bench.cli:main"]},
    **cuda_extension(),
)
