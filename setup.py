"""Build script.

Supported: torch >= 2.11 with the triton it ships with (torch 2.11 pairs with triton 3.6, torch 2.13 with
triton 3.9); ``transformer_kernels`` refuses an older torch on import and the triton backend an older triton.

torch is deliberately not a requirement: it is the user's to install (a CPU or CUDA build of their choice),
and listing it would let pip pull a multi-GB CUDA wheel.  CI installs the extras below with the pins in
``.ci/constraints/``.  The CUDA C++ extension (``csrc/``) is not built yet.
"""

from setuptools import find_packages, setup

TRITON = "triton>=3.6"

setup(
    name="transformer_kernels",
    version="0.1.0",
    description="Fused Triton/CUDA kernels for masked attention, fused QKV projection and GLU conv1d",
    packages=find_packages(include=["transformer_kernels", "transformer_kernels.*"]),
    python_requires=">=3.10",
    extras_require={
        "triton": [TRITON],
        # matplotlib: tests/test_bench.py checks that the report draws its plots.
        "test": [TRITON, "pytest>=8", "hypothesis>=6", "numpy", "matplotlib"],
        # The benchmark command's plots and progress bar; without them it skips the plots and prints plain lines.
        "bench": [TRITON, "pytest>=8", "numpy", "matplotlib", "tqdm"],
    },
    entry_points={"console_scripts": ["transformer-kernels-bench = transformer_kernels.bench.cli:main"]},
)
