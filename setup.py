"""Build script.

torch is deliberately not a requirement: it is the user's to install (a CPU
or CUDA build of their choice), and listing it would let pip pull a multi-GB
CUDA wheel.  The CUDA C++ extension is optional and built only when
``torch.utils.cpp_extension`` finds a CUDA toolkit.
"""

from setuptools import find_packages, setup

setup(
    name="transformer_kernels",
    version="0.1.0",
    description="Fused Triton/CUDA kernels for masked attention, fused QKV projection and GLU conv1d",
    packages=find_packages(include=["transformer_kernels", "transformer_kernels.*"]),
    python_requires=">=3.9",
    extras_require={
        "triton": ["triton>=3.0"],
        "test": ["triton>=3.0", "pytest>=7", "hypothesis>=6", "numpy", "pytest-benchmark>=4"],
        "bench": ["triton>=3.0", "pytest>=7", "pytest-benchmark>=4", "numpy"],
    },
)
