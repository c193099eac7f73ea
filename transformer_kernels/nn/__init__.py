"""Drop-in ``torch.nn`` modules on the fused ops.

- :class:`MultiheadAttention`: ``torch.nn.MultiheadAttention`` (a subclass: same
  constructor, parameters and ``state_dict``) on the fused QKV projection and
  masked attention.
- :func:`replace_modules`: turns the ``torch.nn.MultiheadAttention`` layers of an
  existing model (``nn.Transformer`` included) into :class:`MultiheadAttention`.
- :class:`GLUConv1d`: ``nn.Conv1d(in, 2 * out, k)`` + ``F.glu`` + residual of
  convolutional seq2seq models, with causal step-by-step decoding.

Import it as ``import transformer_kernels.nn`` (``import transformer_kernels``
alone does not load it).
"""

from .attention import MultiheadAttention
from .glu_conv import GLUConv1d
from .replace import replace_modules

__all__ = ["GLUConv1d", "MultiheadAttention", "replace_modules"]
