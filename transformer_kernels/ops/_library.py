"""Registering an op with ``torch.library`` from typed Python signatures.

Every registered op takes ``(*inputs, <the fields of its argument object>,
*flags, str backend)``: the tensors it differentiates, one frozen dataclass of
the op's other arguments (masks, scale, padding, ...), the op's flags (which
gradients to compute, ...) and the backend's name.  torch.library only knows
flat schemas, so :class:`RegisteredOp` builds the schema from the dataclass's
field types and converts between the flat form and the typed one in one
place: the op layer, the fakes and the backends see only the typed one.

Calls take one of three routes to the same implementation, fake and autograd
functions.  Under ``torch.compile``, a dispatch mode (fake tensors, op
counters) or tensor subclasses they go through the registered op, so torch
sees one op with its fake and autograd.  Plain eager calls on plain tensors
skip the dispatcher: they run the implementation directly (or the forward that a
call plan prepared for the call's layout, :meth:`RegisteredOp.call_plain`, whose
``backward``, where it has one, then runs the backward op:
:meth:`RegisteredOp.backward_runner`), inside an ``autograd.Function`` built
from the same ``setup_context``/``backward`` when a gradient is needed.  At the
seeds' short sequences the dispatcher and torch.library's autograd wrapper cost
more host time than the kernels take on a GPU.  Where the op's backward would
run the very kernels autograd's own would, a prepared forward may compute the
call with torch's differentiable ops instead (its ``recorded_by_autograd``),
which autograd records as C++ nodes, at a fraction of a Python Function's host
time (the eager GLU convolution on oneDNN, at a small ConvSeq2Seq's layers:
forward and backward 0.90x as fast as the seed's ops through the Function,
0.96-0.97x so).  Inside a torch.func transform
(``grad``, ``vmap``, ...), which torch.library's autograd wrapper does not
support, an op with autograd runs through an ``autograd.Function`` made for
transforms, and every op has a vmap rule (:mod:`._transforms`).

Under torch.compile, AOTAutograd functionalizes the graph; there an op whose
backend's kernel launches can be traced (``_backend.traces_into_kernels``:
Triton's, on CUDA tensors) decomposes into its implementation, so that Inductor
sees the ``wrap_triton`` launches and compiles them into its own graph, as
``torch.library.triton_op`` does for an op of its own (:meth:`RegisteredOp._functionalized`).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from torch._C._functorch import unwrap_if_dead
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch._subclasses.fake_tensor import FakeTensor

from .._backend import traces_into_kernels
from ._transforms import TypedCall, transform_function, under_transform, vmap_by_loop

__all__ = ["RegisteredOp", "plain_eager_call"]

NAMESPACE = "transformer_kernels"

_SCHEMA_TYPES = {Tensor: "Tensor", Optional[Tensor]: "Tensor?", bool: "bool", float: "float", str: "str", int: "int"}
_PLAIN_TENSOR_TYPES = (Tensor, torch.nn.Parameter)


def _schema_type(annotation: Any) -> str:
    if annotation in _SCHEMA_TYPES:
        return _SCHEMA_TYPES[annotation]
    if isinstance(annotation, type) and issubclass(annotation, int):  # an IntEnum travels as its int
        return "int"
    raise TypeError(f"no schema type for {annotation!r}")


def _flat(values: Sequence[Any]) -> list:
    """``values`` with its lists and tuples (one level) spliced in."""
    return [value for entry in values for value in (entry if isinstance(entry, (list, tuple)) else (entry,))]


class _SavedOnce:
    """An autograd ctx whose saved tensors are unpacked once, however often they are read: a
    non-reentrant checkpoint's unpack hook refuses a second unpack."""

    def __init__(self, ctx) -> None:
        self._ctx = ctx
        self.saved_tensors = ctx.saved_tensors

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


class _GradientsNotDifferentiable(torch.autograd.Function):
    """``apply(message, count, *gradients, *sources)``: copies of the ``count`` gradients, which
    autograd (or a torch.func transform) sees as computed from ``sources`` (the op's saved tensors
    and incoming gradients) and whose own gradient raises ``RuntimeError(message)``.  Copies, not
    the tensors themselves: a view returned by a Function may not be modified in place, and a
    caller may well clip or scale such a gradient."""

    generate_vmap_rule = True

    @staticmethod
    def forward(message: str, count: int, *tensors: Tensor) -> tuple[Tensor, ...]:
        return tuple(tensor.clone() for tensor in tensors[:count])

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.message = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(ctx.message)


def plain_eager_call(*tensors: Optional[Tensor]) -> bool:
    """Whether a call may skip the dispatcher (and use call plans, ``_call_plans.py``): eager, no
    dispatch mode, functorch transform or ``torch.jit.trace`` active (the tracer records the
    registered op, not a Function whose arguments it cannot hold), plain dense tensors (or None)
    only, so that what their metadata say is what the checks and the kernels see (a sparse tensor
    reports strides of 0, as an expanded dense one does; a nested tensor of layout torch.strided,
    of type Tensor, has no shape to read), none on the meta device (whose kernel is the op's fake:
    an implementation may read a value, such as a dropout seed's)."""
    if (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack() != 0
        or torch._C._functorch.peek_interpreter_stack() is not None
        or torch._C._get_tracing_state() is not None
    ):
        return False
    for tensor in tensors:
        if tensor is not None and (type(tensor) not in _PLAIN_TENSOR_TYPES or tensor.layout != torch.strided
                                   or tensor.is_nested or tensor.is_meta):
            return False
    return True


def _symbolic(tensor: Tensor) -> bool:
    return any(isinstance(size, torch.SymInt) for size in (*tensor.shape, *tensor.stride(), tensor.storage_offset()))


def _export_keeps_ops() -> bool:
    """Whether torch.export is tracing, which turns off the decomposition of ``triton_op``s: an
    exported program keeps the registered ops (no Triton source in a serialized program)."""
    return not getattr(torch._functorch.config, "decompose_custom_triton_ops", True)


class RegisteredOp:
    """``transformer_kernels::<name>`` with typed signature
    ``(*inputs, args: args_type, *flags, backend: str)``.

    ``inputs`` and ``flags`` are schema entries (``"Tensor query"``,
    ``"bool needs_grad_x"``); ``returns`` is the schema's return type.
    Decorate the implementation with :meth:`implement` and the fake with
    :meth:`fake`, then call :meth:`register_autograd`; call the op like its
    typed signature.
    """

    def __init__(
        self, name: str, inputs: tuple[str, ...], args_type: type, returns: str, flags: tuple[str, ...] = ()
    ) -> None:
        self.name, self.inputs, self.args_type, self.returns, self.flags = name, inputs, args_type, returns, flags
        self.qualname = f"{NAMESPACE}::{name}"
        self.field_names = tuple(field.name for field in dataclasses.fields(args_type))
        hints = typing.get_type_hints(args_type)
        # Which inputs are tensor lists and which fields hold tensors, worked out once: every call
        # collects its tensors (to choose its route) from these positions.
        self._has_list_input = any(entry.startswith("Tensor[]") for entry in inputs)
        # The inputs the op writes in place ("Tensor(a!) name"): (position, name).
        self._mutated_inputs = tuple(
            (i, entry.split()[-1]) for i, entry in enumerate(inputs) if "!" in entry.split()[0]
        )
        self._tensor_fields = tuple(field for field in self.field_names if hints[field] in (Tensor, Optional[Tensor]))
        # Where each tensor field's gradient flag sits in ctx.needs_input_grad, by route: the
        # registered op takes every field, the autograd.Function only the tensor fields.
        num_inputs = len(inputs)
        self._op_field_index = {field: num_inputs + i for i, field in enumerate(self.field_names)}
        self._function_field_index = {field: num_inputs + i for i, field in enumerate(self._tensor_fields)}
        fields = [f"{_schema_type(hints[field])} {field}" for field in self.field_names]
        torch.library.define(self.qualname, f"({', '.join((*inputs, *fields, *flags, 'str backend'))}) -> {returns}")
        self._implementation: Optional[Callable] = None
        self._function_apply: Optional[Callable] = None  # the autograd.Function's (register_autograd)
        self._transform_function: Optional[type] = None  # under torch.func transforms (_transforms.py)
        torch.library.register_vmap(self.qualname, self._vmap)
        torch.library.register_torch_dispatch(self.qualname, FunctionalTensorMode, self._functionalized)

    def _functionalized(self, mode, op, types, flat, kwargs):
        """The op under ``FunctionalTensorMode`` (torch.compile's AOTAutograd; ``make_fx`` of
        ``dispatch_functionalize``): where its backend's launches can be traced
        (``traces_into_kernels``), its implementation, traced under ``mode``; else, and as
        ``torch.library.triton_op`` does under torch.export and with tensor subclasses, the op
        whole.  Symbolic sizes keep it whole too: the backends work out their launches in
        Python integers (tile sizes, grids, layout-keyed templates)."""
        # The schema has no keyword-only arguments: all of them arrive in ``flat``.
        typed = self.unpack(flat)
        tensors = self._tensors(typed)
        if (
            not traces_into_kernels(typed[-1], tensors[0].device)
            or any(kind not in (Tensor, FunctionalTensor, FakeTensor) for kind in types)
            or any(_symbolic(tensor) for tensor in tensors)
            or _export_keeps_ops()
        ):
            return mode.__torch_dispatch__(op, types, flat, kwargs)
        with mode:
            return self._implementation(*typed)

    def _vmap(self, info, in_dims, *flat):
        """The op under ``torch.vmap``: once per index of the vmapped dimension (_transforms.py), each
        call routed again, so that a transform below this vmap that needs a gradient (an outer
        ``grad``) takes the op's transform function.  An input the op writes in place must be vmapped
        over wherever another input is (each index would overwrite the others' writes), as torch's
        in-place ops require."""
        for index, name in self._mutated_inputs:
            if in_dims[index] is None and any(dim is not None for dim in in_dims):
                raise RuntimeError(
                    f"vmap: {self.qualname} writes {name} in place, which is not vmapped over while another "
                    f"input is: every index of the vmapped dimension would write the same {name}; vmap over "
                    f"{name} too"
                )
        return vmap_by_loop(lambda *args: self(*self.unpack(args)), info.batch_size, in_dims, flat)

    def unpack(self, flat: Sequence[Any]) -> tuple:
        """The flat schema arguments as ``(*inputs, args, *flags, backend)``."""
        num_inputs = len(self.inputs)
        end = num_inputs + len(self.field_names)
        return (*flat[:num_inputs], self.args_type(*flat[num_inputs:end]), *flat[end:])

    def pack(self, typed: Sequence[Any]) -> tuple:
        """``(*inputs, args, *flags, backend)`` as the flat schema arguments."""
        num_inputs = len(self.inputs)
        args = typed[num_inputs]
        fields = tuple(getattr(args, name) for name in self.field_names)
        return (*typed[:num_inputs], *fields, *typed[num_inputs + 1 :])

    def _tensors(self, typed: Sequence[Any]) -> list[Tensor]:
        """The tensors among the typed arguments: the inputs' (tensor lists flattened) and ``args``'s."""
        num_inputs = len(self.inputs)
        if self._has_list_input:
            tensors = []
            for value in typed[:num_inputs]:
                if isinstance(value, (list, tuple)):
                    tensors.extend(value)
                elif value is not None:
                    tensors.append(value)
        else:
            tensors = [value for value in typed[:num_inputs] if value is not None]
        args = typed[num_inputs]
        for field in self._tensor_fields:
            value = getattr(args, field)
            if value is not None:
                tensors.append(value)
        return tensors

    def __call__(self, *typed: Any) -> Any:
        tensors = self._tensors(typed)
        if not plain_eager_call(*tensors):
            if self._transform_function is not None and under_transform():
                return self._apply(self._transform_function.apply, typed, TypedCall(typed))
            return getattr(torch.ops.transformer_kernels, self.name)(*self.pack(typed))
        return self.call_plain(self._implementation, typed, self.records_autograd(*tensors))

    def records_autograd(self, *tensors: Optional[Tensor]) -> bool:
        """Whether autograd records a plain eager call of this op whose inputs and tensor fields are
        ``tensors`` (None for an absent one): the op registered its autograd, grad mode is on, and
        one of them requires grad."""
        if self._function_apply is None or not torch.is_grad_enabled():
            return False
        for tensor in tensors:
            if tensor is not None and tensor.requires_grad:
                return True
        return False

    def call_planned(self, forward: Optional[Callable], *typed: Any) -> Any:
        """The typed call as a public function's call plan runs it (``_call_plans.py``): by
        ``forward``, what the plan keeps for the call's layout (only a plain eager call has a plan),
        or, without a plan (None), as :meth:`__call__` routes it."""
        if forward is None:
            return self(*typed)
        return self.call_plain(forward, typed, self.records_autograd(*self._tensors(typed)))

    def call_plain(self, runner: Callable, typed: tuple, needs_autograd: bool) -> Any:
        """The typed call run by ``runner`` (the implementation, or one that a call plan prepared for
        the call's layout and that computes the same, ``_call_plans.py``), for a caller that has
        established that the call is :func:`plain_eager_call` and whether autograd must record it
        (``needs_autograd``: :meth:`records_autograd` of its inputs and tensor fields).  Where it
        must, a runner's ``recorded_by_autograd(*typed)``, where it has one and that does not return
        None, computes the outputs with ops that autograd records itself; else the op's
        ``autograd.Function`` runs ``runner``."""
        if not needs_autograd:
            return runner(*typed)
        recorded = getattr(runner, "recorded_by_autograd", None)
        outputs = None if recorded is None else recorded(*typed)
        if outputs is not None:
            return outputs
        # The runner and the typed call travel last, so the function's forward does not rebuild it.
        return self._apply(self._function_apply, typed, (runner, typed))

    def _apply(self, apply: Callable, typed: tuple, call: Any) -> Any:
        """An autograd.Function's ``apply`` on what autograd tracks, the inputs and the tensor fields,
        then ``call``."""
        args = typed[len(self.inputs)]
        fields = [getattr(args, field) for field in self._tensor_fields]
        outputs = apply(*typed[: len(self.inputs)], *fields, call)
        return list(outputs) if self.returns == "Tensor[]" else outputs

    def implement(self, function: Callable) -> Callable:
        """Register ``function(*inputs, args, *flags, backend)`` for every device."""
        self._implementation = function
        torch.library.register_kernel(self.qualname, None, lambda *flat: function(*self.unpack(flat)))
        return function

    def fake(self, function: Callable) -> Callable:
        """Register the fake (meta) implementation, same signature as :meth:`implement`'s."""
        torch.library.register_fake(self.qualname, lambda *flat: function(*self.unpack(flat)))
        return function

    def register_autograd(self, backward: Callable, setup_context: Callable) -> None:
        """``setup_context(ctx, inputs: tuple, args, output)`` (``ctx.backend`` is set before it
        runs); ``backward(ctx, *grad_outputs)`` (a ``Tensor[]`` output's gradients as one list)
        returns ``(input_grads, args_grads)``: a gradient (or None) per input, and a dict of
        gradients for the tensors among ``args``'s fields that take one (absent means None)."""
        num_inputs = len(self.inputs)
        implementation = self._implementation

        def typed_setup_context(ctx, typed, output) -> None:
            ctx.backend = typed[-1]
            setup_context(ctx, typed[:num_inputs], typed[num_inputs], output)

        def flat_setup_context(ctx, inputs, output) -> None:
            ctx.field_index = self._op_field_index
            typed_setup_context(ctx, self.unpack(inputs), output)

        @self._once_differentiable
        def flat_backward(ctx, *grad_outputs):
            input_grads, args_grads = backward(ctx, *grad_outputs)
            rest = (None,) * (len(self.flags) + 1)
            return (*input_grads, *(args_grads.get(name) for name in self.field_names), *rest)

        tensor_fields = self._tensor_fields

        torch.library.register_autograd(self.qualname, flat_backward, setup_context=flat_setup_context)

        returns_list = self.returns == "Tensor[]"

        @self._once_differentiable
        def function_backward(ctx, *grad_outputs):
            """Both autograd.Functions' backward: a gradient per input and tensor field, none for the call."""
            input_grads, args_grads = backward(ctx, *((list(grad_outputs),) if returns_list else grad_outputs))
            return (*input_grads, *(args_grads.get(name) for name in tensor_fields), None)

        class Function(torch.autograd.Function):
            # forward(ctx, ...) rather than a separate setup_context: Function.apply binds the
            # arguments of that style with inspect.signature, tens of microseconds per call.
            # Its arguments are the inputs and the tensor fields (what autograd tracks), then the
            # runner and the same call typed, which it runs: those tensors are the typed call's.
            @staticmethod
            def forward(ctx, *tensors_and_call):
                runner, typed = tensors_and_call[-1]
                ctx.field_index = self._function_field_index
                ctx.runner = runner  # a prepared forward may prepare the backward too (backward_runner)
                outputs = runner(*typed)
                typed_setup_context(ctx, typed, outputs)
                return tuple(outputs) if returns_list else outputs

            backward = staticmethod(function_backward)

        Function.__name__ = Function.__qualname__ = f"{self.name}_function"
        base_apply = super(torch.autograd.Function, Function).apply

        def function_apply(*tensors_and_call):
            # torch's Function.apply, less what a plain eager call does not need (its binding of
            # arguments for a setup_context, which Function has none of, and its functorch
            # dispatch): 2 of the 9 us it takes per call.  It unwraps the tensors of a functorch
            # transform that has ended (dead wrappers) the same way.
            return base_apply(*[unwrap_if_dead(value) if isinstance(value, Tensor) else value
                                for value in tensors_and_call])

        self._function_apply = function_apply
        self._transform_function = transform_function(
            self.name, num_inputs, tensor_fields, self._function_field_index, implementation, typed_setup_context,
            function_backward, returns_list,
        )

    def _once_differentiable(self, backward: Callable) -> Callable:
        """``backward`` (returning the flat gradients, a ``Tensor[]`` input's as a list) as autograd
        may run it with grad mode on (``autograd.grad(create_graph=True)``, ``torch.func.grad``):
        computed unrecorded (the backends write into preallocated outputs, which autograd refuses
        to record), then tied by :class:`_GradientsNotDifferentiable` to the tensors they were
        computed from, so that differentiating them raises, as
        ``torch.autograd.function.once_differentiable`` does: these ops are not twice
        differentiable, and a second derivative must fail, not come out as zero."""
        message = f"transformer_kernels.{self.name} is not twice differentiable: its gradients cannot be differentiated"

        def recorded_backward(ctx, *grad_outputs):
            if not torch.is_grad_enabled():
                return backward(ctx, *grad_outputs)
            ctx = _SavedOnce(ctx)
            with torch.no_grad():
                grads = backward(ctx, *grad_outputs)
            tensors = [grad for grad in _flat(grads) if isinstance(grad, Tensor)]
            if not tensors:
                return grads
            # (A Tensor[] output's gradients arrive as one list on the dispatcher's route.)
            sources = [t for t in (*ctx.saved_tensors, *_flat(grad_outputs)) if isinstance(t, Tensor)]
            marked = iter(_GradientsNotDifferentiable.apply(message, len(tensors), *tensors, *sources))

            def mark(grad):
                return next(marked) if isinstance(grad, Tensor) else grad

            return tuple(
                type(entry)(mark(grad) for grad in entry) if isinstance(entry, (list, tuple)) else mark(entry)
                for entry in grads
            )

        return recorded_backward

    @staticmethod
    def backward_runner(ctx, *tensors: Optional[Tensor]) -> Optional[Callable]:
        """What runs the backward op for the forward that ``ctx`` recorded, for
        :meth:`call_planned`: the ``backward`` of a forward prepared for the call's layout, where
        it has one (it knows the layouts, and prepares the backward's launches once) and the
        backward call of ``tensors`` is :func:`plain_eager_call` (a dispatch mode or a transform
        active during the backward pass must see the op); else None (the op routed as usual)."""
        runner = getattr(getattr(ctx, "runner", None), "backward", None)
        return runner if runner is not None and plain_eager_call(*tensors) else None

    def count_flops(self, formula: Callable[..., int]) -> Callable[..., int]:
        """Register ``formula(*inputs, args, *flags, backend)`` (the typed call with each tensor
        given as its shape, and a ``Tensor[]`` as a list of shapes) as the op's count for
        ``torch.utils.flop_counter.FlopCounterMode``, in the convention torch counts its own ops by."""
        from torch.utils.flop_counter import register_flop_formula

        register_flop_formula(getattr(torch.ops.transformer_kernels, self.name))(
            lambda *flat, out_shape=None, **kwargs: formula(*self.unpack(flat))
        )
        return formula

    def needs_grad(self, ctx, field: str) -> bool:
        """Whether the ``args`` field ``field`` (a tensor) needs a gradient in this backward."""
        return ctx.needs_input_grad[ctx.field_index[field]]
