"""The seed notebooks' naive math, for tests and benchmarks only.

Nothing in the package dispatches here.  Each function is written the way the
seeds write it (materialized scores, ``masked_fill(-1e9)``, three separate
linears then view/transpose, conv then GLU), so it is both the correctness
oracle and the "before" column of every benchmark.
"""

from .attention import attention
from .glu_conv import glu_conv1d
from .qkv import qkv_projection

__all__ = ["attention", "qkv_projection", "glu_conv1d"]
