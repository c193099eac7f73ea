"""Registering an op with ``torch.library`` from typed Python signatures.

Every registered op takes ``(*inputs, <the fields of its argument object>,
*flags, str backend)``: the tensors it differentiates, one frozen dataclass of
the op's other arguments (masks, scale, padding, ...), the op's flags (which
gradients to compute, ...) and the backend's name.  torch.library only knows
flat schemas, so :class:`RegisteredOp` builds the schema from the dataclass's
field types and converts between the flat form and the typed one in one
place: the op layer, the fakes and the backends see only the typed one.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["RegisteredOp"]

NAMESPACE = "transformer_kernels"

_SCHEMA_TYPES = {Tensor: "Tensor", Optional[Tensor]: "Tensor?", bool: "bool", float: "float", str: "str", int: "int"}


def _schema_type(annotation: Any) -> str:
    if annotation in _SCHEMA_TYPES:
        return _SCHEMA_TYPES[annotation]
    if isinstance(annotation, type) and issubclass(annotation, int):  # an IntEnum travels as its int
        return "int"
    raise TypeError(f"no schema type for {annotation!r}")


@dataclasses.dataclass(frozen=True)
class RegisteredOp:
    """``transformer_kernels::<name>`` with typed signature
    ``(*inputs, args: args_type, *flags, backend: str)``.

    ``inputs`` and ``flags`` are schema entries (``"Tensor query"``,
    ``"bool needs_grad_x"``); ``returns`` is the schema's return type.
    Decorate the implementation with :meth:`implement` and the fake with
    :meth:`fake`, then call :meth:`register_autograd`; call the op like its
    typed signature.
    """

    name: str
    inputs: tuple[str, ...]
    args_type: type
    returns: str
    flags: tuple[str, ...] = ()
    field_names: tuple[str, ...] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(self.args_type)
        object.__setattr__(self, "field_names", tuple(field.name for field in dataclasses.fields(self.args_type)))
        fields = [f"{_schema_type(hints[name])} {name}" for name in self.field_names]
        schema = f"({', '.join((*self.inputs, *fields, *self.flags, 'str backend'))}) -> {self.returns}"
        torch.library.define(self.qualname, schema)

    @property
    def qualname(self) -> str:
        return f"{NAMESPACE}::{self.name}"

    def unpack(self, flat: Sequence[Any]) -> tuple:
        """The flat schema arguments as ``(*inputs, args, *flags, backend)``."""
        num_inputs = len(self.inputs)
        end = num_inputs + len(self.field_names)
        return (*flat[:num_inputs], self.args_type(*flat[num_inputs:end]), *flat[end:])

    def __call__(self, *typed: Any) -> Any:
        num_inputs = len(self.inputs)
        args = typed[num_inputs]
        fields = (getattr(args, name) for name in self.field_names)
        return getattr(torch.ops.transformer_kernels, self.name)(*typed[:num_inputs], *fields, *typed[num_inputs + 1 :])

    def implement(self, function: Callable) -> Callable:
        """Register ``function(*inputs, args, *flags, backend)`` for every device."""
        torch.library.register_kernel(self.qualname, None, lambda *flat: function(*self.unpack(flat)))
        return function

    def fake(self, function: Callable) -> Callable:
        """Register the fake (meta) implementation, same signature as :meth:`implement`'s."""
        torch.library.register_fake(self.qualname, lambda *flat: function(*self.unpack(flat)))
        return function

    def register_autograd(self, backward: Callable, setup_context: Callable) -> None:
        """``setup_context(ctx, inputs: tuple, args, output)`` (``ctx.backend`` is set before it
        runs); ``backward(ctx, *grad_outputs)``
        returns ``(input_grads, args_grads)``: a gradient (or None) per input, and a dict of
        gradients for the tensors among ``args``'s fields that take one (absent means None)."""
        num_inputs = len(self.inputs)

        def flat_setup_context(ctx, inputs, output) -> None:
            typed = self.unpack(inputs)
            ctx.backend = typed[-1]
            setup_context(ctx, typed[:num_inputs], typed[num_inputs], output)

        def flat_backward(ctx, *grad_outputs):
            input_grads, args_grads = backward(ctx, *grad_outputs)
            rest = (None,) * (len(self.flags) + 1)
            return (*input_grads, *(args_grads.get(name) for name in self.field_names), *rest)

        torch.library.register_autograd(self.qualname, flat_backward, setup_context=flat_setup_context)

    def needs_grad(self, ctx, field: str) -> bool:
        """Whether the ``args`` field ``field`` (a tensor) needs a gradient in this backward."""
        index = len(self.inputs) + self.field_names.index(field)
        return ctx.needs_input_grad[index]
