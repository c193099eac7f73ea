"""The registered ops under torch.func's transforms (``grad``, ``vjp``, ``jacrev``, ``vmap`` and their
compositions), as torch's own ops work there.

torch.library's autograd wrapper is an ``autograd.Function`` without ``setup_context``, which
functorch refuses (seen with torch 2.13), and an op returning ``Tensor[]`` gets no vmap fallback.
So, while a transform is active:

* an op with autograd runs through :func:`transform_function`'s ``autograd.Function``, which has
  ``setup_context`` and a ``vmap`` rule, over the same implementation, context and backward as
  the op's other routes;
* every op, the backward ops included (which run batched under ``vmap(grad(f))``), has a vmap rule
  (:func:`vmap_by_loop`): the op once per index of the vmapped dimension, the results stacked, as
  torch's fallback for ops without a batching rule does (correct for every op and argument; a rule
  folding the vmapped dimension into each op's batch would be faster, and is not written).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["under_transform", "vmap_by_loop", "TypedCall", "transform_function"]


def under_transform() -> bool:
    """Whether a call that did not run directly (``_library.plain_eager_call``) is inside a torch.func
    transform, outside compilation and dispatch modes.  (An op with autograd takes its transform
    function there whether or not a gradient is asked for: inside ``grad(vmap(f))`` the vmapped
    tensors do not say that the outer grad tracks them.)"""
    return (
        torch._C._functorch.peek_interpreter_stack() is not None
        and not torch.compiler.is_compiling()
        and torch._C._len_torch_dispatch_stack() == 0
    )


def _slice(value: Any, dim: Any, index: Optional[int]) -> Any:
    """``value`` at ``index`` of its vmapped dimension ``dim``; zeros of that shape for index None
    (a vmapped dimension of size 0 has no index)."""
    if dim is None:
        return value
    if isinstance(value, (list, tuple)):  # a Tensor[] argument: a dim per element
        return type(value)(_slice(item, item_dim, index) for item, item_dim in zip(value, dim))
    if index is None:
        return value.new_zeros(value.shape[:dim] + value.shape[dim + 1 :])
    return value.select(dim, index)


def _stacked(results: list) -> tuple[Any, Any]:
    """The per-index results (each a tensor, or a tuple or list of tensors) stacked along a new
    dimension 0, and their out_dims."""
    first = results[0]
    if isinstance(first, Tensor):
        return torch.stack(results), 0
    stacked = type(first)(torch.stack(parts) for parts in zip(*results))
    return stacked, type(first)(0 for _ in first)


def vmap_by_loop(call: Callable, batch_size: int, in_dims: Sequence[Any], args: Sequence[Any]) -> tuple[Any, Any]:
    """``call(*args)`` under vmap: once per index of the vmapped dimension (``in_dims`` as torch
    gives them, None for an argument that is not batched), the results stacked along dimension 0:
    ``(outputs, out_dims)``.  A dimension of size 0 gives results of size 0 along it, of the shapes
    that one call on zeros gives (as torch's ops give them)."""
    if batch_size == 0:
        outputs, out_dims = _stacked([call(*(_slice(arg, dim, None) for arg, dim in zip(args, in_dims)))])
        if isinstance(outputs, Tensor):
            return outputs[:0], out_dims
        return type(outputs)(output[:0] for output in outputs), out_dims
    results = [call(*(_slice(arg, dim, index) for arg, dim in zip(args, in_dims))) for index in range(batch_size)]
    return _stacked(results)


class TypedCall:
    """The typed call handed to :func:`transform_function`'s ``apply`` last, in a box: torch.func
    takes a tuple argument apart (a pytree), this stays one opaque value."""

    __slots__ = ("typed",)

    def __init__(self, typed: tuple) -> None:
        self.typed = typed


def transform_function(
    name: str,
    num_inputs: int,
    tensor_fields: tuple[str, ...],
    field_index: dict[str, int],
    implementation: Callable,
    typed_setup_context: Callable,
    function_backward: Callable,
    returns_list: bool,
) -> type:
    """The ``autograd.Function`` of an op under torch.func transforms.  ``apply`` takes the op's
    inputs, the tensors of its argument object's ``tensor_fields`` (what autograd tracks), then the
    typed call (a :class:`TypedCall`), of which only the values that are not those tensors are read:
    a transform hands ``forward``, ``setup_context`` and ``vmap`` its own (unwrapped) tensors in
    their places.  ``function_backward`` is the op's other autograd.Function's backward."""

    def typed_call(tensors_and_typed: Sequence[Any]) -> tuple:
        typed = tensors_and_typed[-1].typed
        num_tensors = num_inputs + len(tensor_fields)
        fields = dict(zip(tensor_fields, tensors_and_typed[num_inputs:num_tensors]))
        args = dataclasses.replace(typed[num_inputs], **fields)
        return (*tensors_and_typed[:num_inputs], args, *typed[num_inputs + 1 :])

    class TransformFunction(torch.autograd.Function):
        @staticmethod
        def forward(*tensors_and_typed):
            outputs = implementation(*typed_call(tensors_and_typed))
            return tuple(outputs) if returns_list else outputs

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.field_index = field_index
            typed_setup_context(ctx, typed_call(inputs), output)

        backward = staticmethod(function_backward)

        @staticmethod
        def vmap(info, in_dims: tuple[Optional[int], ...], *tensors_and_typed):
            # Each index through apply again, so that the transforms below this vmap (an inner
            # grad's) see the calls.
            return vmap_by_loop(TransformFunction.apply, info.batch_size, in_dims, tensors_and_typed)

    TransformFunction.__name__ = TransformFunction.__qualname__ = f"{name}_transform_function"
    return TransformFunction
