"""Fused GPU kernels (Triton, CUDA C++) for the hot paths of transformer and
convolutional seq2seq models, with eager CPU fallbacks.

Every public function takes ``backend=`` ("auto", "cuda", "triton", "eager");
see :func:`use_backend` and the ``TRANSFORMER_KERNELS_BACKEND`` environment
variable.
"""

from ._backend import BackendUnavailableError, check_torch_version, use_backend

check_torch_version()
from . import backends  # registers every backend
from .ops.attention import scaled_dot_product_attention
from .ops.glu_conv import glu_conv1d, glu_conv1d_step
from .ops.glu_conv_update import glu_conv1d_update
from .ops.qkv import qkv_projection

__all__ = [
    "BackendUnavailableError",
    "glu_conv1d",
    "glu_conv1d_step",
    "glu_conv1d_update",
    "qkv_projection",
    "scaled_dot_product_attention",
    "use_backend",
]

__version__ = "0.1.0"
