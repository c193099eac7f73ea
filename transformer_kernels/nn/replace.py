"""``replace_modules``: existing models onto :class:`transformer_kernels.nn.MultiheadAttention`."""

from __future__ import annotations

from typing import Optional

import torch

from ._checks import check_backend
from .attention import MultiheadAttention

__all__ = ["replace_modules"]


def replace_modules(model: torch.nn.Module, *, backend: Optional[str] = None) -> int:
    r"""Turn every ``torch.nn.MultiheadAttention`` in ``model`` into a
    :class:`transformer_kernels.nn.MultiheadAttention`, in place; returns how many it turned.

    Every module whose type is exactly ``torch.nn.MultiheadAttention`` counts, ``model``
    itself included, and those inside ``nn.Transformer``, ``nn.TransformerEncoder(Layer)``
    and ``nn.TransformerDecoder(Layer)``; a module reachable along several paths counts
    once.  Subclasses (a user's own, a module with a parametrization, ours) are left as
    they are: their ``forward`` may differ from torch's.

    Each module changes class where it stands (as ``torch.nn.utils.parametrize`` does), so
    everything it holds stays: the same ``Parameter`` objects (an optimizer built before
    the call keeps updating them), device, dtype, ``training`` flag, hooks, and every
    reference to the module.  Its ``state_dict`` keys and values do not change.

    Outputs and gradients stay torch's (float32 to about 1e-5), in training and in
    evaluation, except where the class docstring of
    :class:`~transformer_kernels.nn.MultiheadAttention` says otherwise (rows with every
    key masked give 0 instead of NaN; dropout masks differ).  In ``eval()`` under
    ``torch.no_grad()``, ``nn.TransformerEncoder``/``nn.TransformerEncoderLayer`` may take
    torch's inference fast path (nested tensors, ``torch._transformer_encoder_layer_fwd``),
    which reads the attention weights directly and never calls the attention module's
    ``forward``: it keeps working unchanged and computes with torch's own kernel.

    Call it before ``torch.compile``-ing the model, or compile again afterwards.

    Args:
        model: the model, changed in place.
        backend: the ``backend`` attribute of every module turned (see
            :class:`~transformer_kernels.nn.MultiheadAttention`); ``None`` follows
            :func:`transformer_kernels.use_backend` and the environment variable.

    Example::

        >>> model = torch.nn.Transformer(d_model=512, nhead=8, batch_first=True)
        >>> transformer_kernels.nn.replace_modules(model)
        18
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    backend = check_backend(backend)
    replaced = 0
    for module in model.modules():
        if type(module) is torch.nn.MultiheadAttention:
            module.__class__ = MultiheadAttention
            module.backend = backend
            replaced += 1
    return replaced
