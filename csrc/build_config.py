"""Build settings shared by ``setup.py`` and the compile tests (loaded by path: no package import).

Kept free of imports beyond the standard library (and ``cutlass_library``, looked up lazily) so that
``setup.py`` can use it before anything is installed.
"""

import os
from typing import Optional

# Architectures built when TORCH_CUDA_ARCH_LIST is unset: A100 and H100 (9.0a: Hopper's arch-specific
# instructions available).
DEFAULT_ARCH_LIST = "8.0;9.0a"
# nvcc flags of every kernel source, in the extension build and in the compile tests.
NVCC_FLAGS = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]
# The kernel sources, relative to the repository root.  Attention's take one per direction and dtype:
# the longest to compile, they build in parallel.
KERNEL_SOURCES = [
    "csrc/qkv/qkv.cu", "csrc/glu_conv/glu_conv.cu", "csrc/glu_conv/glu_step.cu",
    "csrc/attention/attention_fwd_fp16.cu", "csrc/attention/attention_fwd_bf16.cu",
    "csrc/attention/attention_bwd_fp16.cu", "csrc/attention/attention_bwd_bf16.cu", "csrc/attention/key_bounds.cu",
]
# Sources without kernels, built by nvcc too: the attention launchers' dispatch.
HOST_SOURCES = ["csrc/attention/attention.cu"]


def cutlass_include() -> Optional[str]:
    """The CUTLASS include directory (holding ``cute/tensor.hpp``): ``$CUTLASS_PATH/include`` if
    ``CUTLASS_PATH`` is set, else the ``nvidia-cutlass`` wheel's copy, else None."""
    if os.environ.get("CUTLASS_PATH"):
        path = os.path.join(os.environ["CUTLASS_PATH"], "include")
    else:
        try:
            import cutlass_library
        except ImportError:
            return None
        path = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
    return path if os.path.isfile(os.path.join(path, "cute", "tensor.hpp")) else None


def cutlass_missing_message() -> str:
    if os.environ.get("CUTLASS_PATH"):
        return f"CUTLASS_PATH={os.environ['CUTLASS_PATH']} holds no include/cute/tensor.hpp"
    return "the CUTLASS headers were not found: pip install nvidia-cutlass (or set CUTLASS_PATH)"
