"""Helpers shared by the Triton kernels of every op.

* ``KernelLaunch``: one ``kernel[grid](*args, **kwargs)`` call.  Each launcher
  builds its launches through one function per kernel, and ``compile_targets()``
  calls the same functions with representative tensors, so
  ``tests/test_triton_compile.py`` compiles exactly the variant a launch of
  that shape runs (``compile_source`` specializes it the way Triton's
  launcher does).
* ``LaunchTemplates``: a call's launches worked out once per layout, so later
  calls of that layout only fill in their tensors, and ``DirectLaunch``, which
  runs them on their compiled kernel without Triton's per-call binding;
  ``TensorLayout``, ``TensorLayouts``: what a prepared call allocates, kept once
  (``strided_layout``: what it compares a call's other tensors by);
  ``WantedGradients``: which gradients a backward call computes.
* ``KernelConfig``: the tile sizes and launch options of one kernel, and
  ``run_launches``, which runs a call's launches on its tensors' device, or,
  traced by torch.compile, records them with ``wrap_triton`` (``traced``,
  ``address_aligned``).
* ``fp32_conv_allows_tf32``: torch's float32 convolution precision setting,
  whichever API set it.
* ``input_precision``, ``num_sms``, ``cdiv``, ``next_power_of_2``.
* ``multiple_of_16``: the in-kernel alignment hint; ``row_sum_operand``: the
  dot operand that sums a tile's rows on the tensor cores (bias gradients).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Hashable, Iterable, NamedTuple, Optional

import torch
import triton
# Unused by name, but Triton's interpreter runs a @triton.jit function (here
# multiple_of_16) only if its module's globals hold triton.language.
import triton.language as tl  # noqa: F401

from ..._backend import cuda_capability

TORCH_TO_TRITON_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
INT32_MAX = 2**31 - 1


class KernelLaunch(NamedTuple):
    """``kernel[grid](*args, **kwargs)``; ``kwargs`` holds the constexprs and
    the launch options (``num_warps``, ``num_stages``).  ``direct``: how a
    launch of a template runs its compiled kernel without Triton's binding
    (:class:`DirectLaunch`), or None.  A named tuple: a prepared call builds
    its launches anew each time, and a frozen dataclass took 0.7 us to make
    against 0.3 us."""

    kernel: Any
    grid: tuple
    args: tuple
    kwargs: dict
    direct: Optional["DirectLaunch"] = None

    def __call__(self) -> None:
        if self.direct is None:
            self.kernel[self.grid](*self.args, **self.kwargs)
        else:
            self.direct.run(self)


def current_device_and_stream() -> tuple[int, int]:
    """The current device and its current stream, as Triton's launcher takes them."""
    driver = triton.runtime.driver.active
    device = driver.get_current_device()
    return device, driver.get_current_stream(device)


class DirectLaunch:
    """One launch of a :class:`LaunchTemplates` entry, run on its compiled kernel directly.

    ``kernel[grid](*args, **kwargs)`` binds every argument, works out each one's specialization
    and builds a cache key from them on every call before it finds the compiled kernel: 10-13 us
    for an attention kernel's 60-74 arguments, 4-6 us for a GEMM's 25-40
    (``benchmarks/host_time.py``), as long as the kernels run at the seeds' sizes.  A template
    fixes every argument but its leading tensors and its per-call keyword arguments, so after
    the first launch of a variant, which goes through Triton (and compiles), the compiled kernel
    is kept and later launches hand it the arguments as Triton's launcher does: every
    parameter's value in signature order (constexprs included), the template's worked out once.

    A template fixes the integers Triton specializes on (equal to 1, divisible by 16), so the
    variant depends only on the tensors: their dtypes, which are None, and, for a parameter not
    exempt from it, whether the address is 16-byte aligned.  These key the compiled kernels,
    with the device.  The attention kernels (``_kernel``) are exempt on every tensor, so their
    key holds no address.
    """

    __slots__ = ("grid", "num_pointers", "tail", "call_slots", "aligned_slots", "compiled")

    def __init__(
        self, grid: tuple, num_pointers: int, tail: list, call_slots: tuple, aligned_slots: tuple[int, ...]
    ) -> None:
        # A compiled kernel's launcher takes all three grid dimensions (``kernel[grid]`` fills in 1s).
        self.grid = (*grid, *(1,) * (3 - len(grid)))
        self.num_pointers, self.tail = num_pointers, tail
        self.call_slots, self.aligned_slots = call_slots, aligned_slots
        self.compiled: dict[tuple, Any] = {}

    @classmethod
    def of(cls, launch: "KernelLaunch", num_pointers: int, call_kwargs: Iterable[str]) -> Optional["DirectLaunch"]:
        """For ``launch`` (a template's, with its pointers and call keyword arguments in place); None
        for a kernel Triton interprets."""
        kernel = launch.kernel
        if not isinstance(kernel, triton.runtime.JITFunction):
            return None
        parameters = kernel.signature.parameters
        bound = kernel.signature.bind(
            *launch.args, **{name: value for name, value in launch.kwargs.items() if name in parameters}
        )
        bound.apply_defaults()
        names = list(bound.arguments)
        call_slots = tuple((names.index(name), name) for name in call_kwargs)
        varying = [*range(num_pointers), *(index for index, _ in call_slots)]
        aligned_slots = tuple(index for index in varying if not kernel.params[index].do_not_specialize_on_alignment)
        return cls(launch.grid, num_pointers, list(bound.arguments.values())[num_pointers:], call_slots, aligned_slots)

    def arguments(self, launch: "KernelLaunch") -> list:
        """Every parameter's value for ``launch``, in signature order: what Triton's binder gives."""
        arguments = [*launch.args[: self.num_pointers], *self.tail]
        for index, name in self.call_slots:
            arguments[index] = launch.kwargs[name]
        return arguments

    def key(self, device: int, arguments: list) -> tuple:
        """What the compiled kernel for ``arguments`` depends on beyond the template."""
        key = [device]
        key += [None if tensor is None else tensor.dtype for tensor in arguments[: self.num_pointers]]
        if self.call_slots:
            key += [arguments[index].dtype for index, _ in self.call_slots]
        if self.aligned_slots:
            key += [arguments[i] is not None and arguments[i].data_ptr() % 16 == 0 for i in self.aligned_slots]
        return tuple(key)

    def run(self, launch: "KernelLaunch") -> None:
        arguments = self.arguments(launch)
        device, stream = current_device_and_stream()
        key = self.key(device, arguments)
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = launch.kernel[launch.grid](*launch.args, **launch.kwargs)
            if compiled is not None:
                self.compiled[key] = compiled
            return
        compiled[self.grid](*arguments, stream=stream)


class LaunchTemplates:
    """A call's launches by layout, worked out once per layout.

    At the seeds' short sequences a GPU runs a kernel in a few microseconds, about as long as
    the host takes to work out its launch: the tile configuration, the grid, the strides and
    sizes, the switches.  All of that follows from the call's layout (shapes, strides, dtypes,
    scalars, the GPU), so the first call of a layout builds its launches and keeps them as a
    template: the launches without their leading pointer arguments and without the keyword
    arguments that vary from call to call (a device tensor holding a seed).  Later calls of
    that layout only put their tensors in, and where the kernel allows it they skip Triton's
    argument binding too (:class:`DirectLaunch`).

    ``layout`` must determine every argument besides those, including what the build reads from
    state that can change at run time (a tile table a sweep swaps).  The template is checked, when
    it is made, to hold no tensor, so a tensor left out of ``pointers`` fails there rather than
    running on a stale address.  With ``verify`` set (the test suite sets it), every later call
    builds its launches anew too and fails unless they equal the template's: a layout that misses
    something its build reads shows in any test whose calls differ in it.  Bounded: decoding meets
    a new length on every step.
    """

    verify = False

    def __init__(self, max_layouts: int = 4096) -> None:
        self._templates: dict[Hashable, tuple[KernelLaunch, ...]] = {}
        self._max_layouts = max_layouts

    def template(
        self, layout: Hashable, pointers: tuple, build: Callable[[], list[KernelLaunch]], call_kwargs: dict
    ) -> tuple[KernelLaunch, ...]:
        """The template of the launches of a call whose launches all begin with the arguments
        ``pointers`` and take ``call_kwargs``; ``build()`` makes them, for this call, the first time
        ``layout`` is met.  :func:`filled` gives a call's launches from it."""
        template = self._templates.get(layout)
        if template is None:
            template = _template(build(), pointers, call_kwargs)
            if len(self._templates) >= self._max_layouts:
                self._templates.clear()
            self._templates[layout] = template
        elif self.verify:
            _check_template(template, build(), pointers, call_kwargs, layout)
        return template

    def launches(
        self, layout: Hashable, pointers: tuple, build: Callable[[], list[KernelLaunch]], **call_kwargs: Any
    ) -> list[KernelLaunch]:
        """The launches of a call (see :meth:`template`)."""
        return filled(self.template(layout, pointers, build, call_kwargs), pointers, call_kwargs)

    def launch(
        self, layout: Hashable, pointers: tuple, build: Callable[[], KernelLaunch], **call_kwargs: Any
    ) -> KernelLaunch:
        """:meth:`launches` for a call of one launch, which ``build()`` makes."""
        (launch,) = self.launches(layout, pointers, lambda: [build()], **call_kwargs)
        return launch


def filled(template: tuple[KernelLaunch, ...], pointers: tuple, call_kwargs: dict) -> list[KernelLaunch]:
    """The launches of ``template`` (:meth:`LaunchTemplates.template`) for a call's ``pointers`` and
    ``call_kwargs``."""
    return [
        KernelLaunch(launch.kernel, launch.grid, (*pointers, *launch.args),
                     {**launch.kwargs, **call_kwargs} if call_kwargs else launch.kwargs, launch.direct)
        for launch in template
    ]


def strided_layout(tensor: torch.Tensor) -> tuple:
    """``tensor``'s shape, strides and dtype: what a prepared call compares an argument it was not
    built from against (its device is the call plan's)."""
    return tensor.shape, tensor.stride(), tensor.dtype


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """What ``torch.empty_strided`` makes a tensor of one layout from: a prepared call keeps those of
    the tensors it allocates, worked out once (``empty_like`` and its kin work a layout out again on
    every call)."""

    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorLayout":
        return cls(tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)

    def empty(self) -> torch.Tensor:
        return torch.empty_strided(self.sizes, self.strides, dtype=self.dtype, device=self.device)


class TensorLayouts:
    """The layouts of what a call allocates, a sequence of tensors of which some may be None or the
    same tensor as an earlier one (standing in for a buffer a kernel does not write): :meth:`empty`
    makes such a sequence again, with the same gaps and the same sharing."""

    __slots__ = ("slots",)

    def __init__(self, tensors: Iterable[Optional[torch.Tensor]]) -> None:
        tensors = list(tensors)
        # Per position: None, the index of the earlier position holding the same tensor, or its layout.
        self.slots: list = []
        for index, tensor in enumerate(tensors):
            same = next((earlier for earlier in range(index) if tensors[earlier] is tensor), None)
            self.slots.append(None if tensor is None else same if same is not None else TensorLayout.of(tensor))

    def empty(self) -> list[Optional[torch.Tensor]]:
        made: list[Optional[torch.Tensor]] = []
        for slot in self.slots:
            made.append(slot.empty() if isinstance(slot, TensorLayout) else None if slot is None else made[slot])
        return made


@dataclasses.dataclass(frozen=True)
class WantedGradients:
    """Which gradients a layer's backward call computes: its input's, its weight's and its bias's
    (the bias's only where there is a bias)."""

    x: bool
    weight: bool
    bias: bool

    @property
    def weight_or_bias(self) -> bool:
        return self.weight or self.bias


def filled_all(templates: Iterable[tuple[KernelLaunch, ...]], pointers: Iterable[tuple]) -> list[KernelLaunch]:
    """The launches of a call of several templates, each with its pointers (:func:`filled`)."""
    return [launch for template, call in zip(templates, pointers) for launch in filled(template, call, {})]


def check_prepared_launches(launches: list[KernelLaunch], expected: list[KernelLaunch], name: str) -> None:
    """Fails unless ``launches`` (those of a prepared ``name``, as ``"QKV forward"``) run what
    ``expected`` (the same call's, built as its backend's unprepared function builds them) run,
    their direct launchers aside, which a template made again replaces."""
    def runs(launch: KernelLaunch) -> tuple:
        return launch.kernel, launch.grid, launch.args, launch.kwargs

    if [runs(launch) for launch in launches] != [runs(launch) for launch in expected]:
        raise AssertionError(f"the prepared {name}'s launches differ from the unprepared call's")


def _check_template(template: tuple, launches: list, pointers: tuple, call_kwargs: dict, layout: Hashable) -> None:
    """Fails unless ``launches``, built for this call, are ``template``'s for it."""
    if len(launches) != len(template) or any(
        (kept.kernel, kept.grid, (kept.args, kept.kwargs))
        != (new.kernel, new.grid, _stripped(new, pointers, call_kwargs))
        for kept, new in zip(template, launches)
    ):
        raise AssertionError(f"the launches kept for layout {layout!r} differ from this call's: the layout "
                             f"misses something the launches depend on")


def _stripped(launch: KernelLaunch, pointers: tuple, call_kwargs: dict) -> tuple[tuple, dict]:
    """``launch``'s arguments without ``pointers`` (its leading ones) and its keyword arguments without
    ``call_kwargs``: what a template keeps."""
    leading = launch.args[: len(pointers)]
    if len(leading) != len(pointers) or any(arg is not pointer for arg, pointer in zip(leading, pointers)):
        raise RuntimeError(f"a launch of {launch.kernel} does not begin with the call's pointer arguments")
    args = launch.args[len(pointers) :]
    kwargs = {name: value for name, value in launch.kwargs.items() if name not in call_kwargs}
    if any(isinstance(value, torch.Tensor) for value in (*args, *kwargs.values())):
        raise RuntimeError(f"a launch of {launch.kernel} takes a tensor its template would keep")
    return args, kwargs


def _template(launches: list[KernelLaunch], pointers: tuple, call_kwargs: dict) -> tuple[KernelLaunch, ...]:
    """``launches`` as a template (see :func:`_stripped`), each with its :class:`DirectLaunch`."""
    return tuple(
        KernelLaunch(launch.kernel, launch.grid, *_stripped(launch, pointers, call_kwargs),
                     DirectLaunch.of(launch, len(pointers), call_kwargs))
        for launch in launches
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelConfig:
    """Tile sizes and launch options of one kernel.

    ``block_m``, ``block_n`` and ``block_k`` are the kernel's ``BLOCK_M``,
    ``BLOCK_N`` and ``BLOCK_K``: GEMM-like kernels compute ``BLOCK_M x
    BLOCK_N`` output tiles, reducing ``BLOCK_K`` at a time (each kernel's
    comment says what M, N and K are); the attention kernels tile queries by
    ``BLOCK_M`` and keys by ``BLOCK_N``.  ``group_m`` is the grouped tile
    ordering's ``GROUP_M``.  A kernel without one of these takes None.
    """

    block_m: Optional[int] = None
    block_n: Optional[int] = None
    block_k: Optional[int] = None
    group_m: Optional[int] = None
    num_warps: int
    num_stages: int

    def launch_kwargs(self) -> dict:
        """The ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K`` and ``GROUP_M`` constexprs
        that are set, with ``num_warps`` and ``num_stages``: the keyword
        arguments a launch of the kernel takes from its configuration.  One
        dict per configuration, built on first use: spread it, never change it."""
        return self._launch_kwargs

    # functools.cached_property writes the instance's __dict__ directly, which a frozen dataclass allows.
    @functools.cached_property
    def _launch_kwargs(self) -> dict:
        constexprs = dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k, GROUP_M=self.group_m)
        return dict(
            {name: value for name, value in constexprs.items() if value is not None},
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )


def traced(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is being traced under functionalization (torch.compile's AOTAutograd, where
    a registered op decomposes into its backend's launches, see ``ops/_library.py``): it has no
    data, and the launches that take it go into the graph.  (A plain tensor is never traced: the
    eager call pays one type test.)"""
    return (type(tensor) is not torch.Tensor
            and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FUNCTIONAL) is not None)


def address_aligned(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s address is a multiple of 16 bytes.  :func:`traced`, its storage offset
    decides: Inductor's buffers are aligned, and it copies a graph input that was aligned when
    traced but is not when run (``copy_misaligned_inputs``)."""
    if traced(tensor):
        return tensor.storage_offset() * tensor.element_size() % 16 == 0
    return tensor.data_ptr() % 16 == 0


def run_launches(launches: Iterable[KernelLaunch], tensor: torch.Tensor) -> None:
    """Runs ``launches`` in order with ``tensor``'s CUDA device current (the
    current device may be another one); where ``tensor`` is :func:`traced`, records
    each as a ``torch.library.wrap_triton`` call, which Inductor compiles and launches."""
    if traced(tensor):
        for launch in launches:
            torch.library.wrap_triton(launch.kernel)[launch.grid](*launch.args, **launch.kwargs)
        return
    # The usual call needs no device switch, whose guard costs microseconds (a null context
    # manager in its place half of one).
    if not tensor.is_cuda or tensor.get_device() == torch.cuda.current_device():
        for launch in launches:
            launch()
        return
    with torch.cuda.device_of(tensor):
        for launch in launches:
            launch()


# The architectures every configuration is compiled for: sm_80 (A100) and sm_90 (H100).
COMPILE_CAPABILITIES = (80, 90)


@dataclasses.dataclass(frozen=True)
class CompileTarget:
    """One configuration a dispatcher can choose: ``launch()`` builds the
    launch of a representative shape (tensors are made only when called, so
    listing the targets is cheap) for GPUs of compute ``capabilities``;
    ``name`` is a readable test id (one name may serve several targets, each
    for its own architectures)."""

    name: str
    launch: Callable[[], KernelLaunch]
    capabilities: tuple[int, ...] = COMPILE_CAPABILITIES


def compile_source(launch: KernelLaunch, capability: int) -> tuple[Any, dict]:
    """``(ASTSource, options)`` that ``triton.compile`` takes to build what
    ``launch()`` would compile on a GPU of compute ``capability``.

    Runs Triton's own launch-time specialization (the binder ``JITFunction.run``
    uses, then ``_pack_args``), so the rules are the installed Triton's:
    an integer argument equal to 1 becomes the constant 1 unless the kernel
    lists it in ``do_not_specialize``; an integer's type is i32, or i64 when
    its value needs it (a ``tl.int64`` annotation fixes it); integers and
    tensor addresses divisible by 16 get ``tt.divisibility = 16`` unless the
    kernel lists them in ``do_not_specialize_on_alignment``; ``None`` becomes
    a constexpr; floats are never specialized.  Needs ``TRITON_INTERPRET=0``.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    backend = make_backend(GPUTarget("cuda", capability, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, launch.kwargs, bound_args, specialization, options
    )
    return ASTSource(kernel, signature, constexprs, attrs), options.__dict__


# Host-side integer helpers in plain Python: triton.cdiv and triton.next_power_of_2 are
# JIT functions, and calling one on the host costs microseconds through Triton's launcher.


def cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def next_power_of_2(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << max(n - 1, 0).bit_length())


@functools.lru_cache(maxsize=None)
def compute_capability(device: torch.device) -> Optional[int]:
    """``major * 10 + minor`` of a CUDA ``device`` (90 on an H100); None elsewhere (the
    interpreter)."""
    if device.type != "cuda":
        return None
    major, minor = cuda_capability(device)
    return 10 * major + minor


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """SMs of a CUDA ``device``; 4 elsewhere (the interpreter: a small "GPU",
    so modest test shapes reach the split and small-tile paths)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def fp32_conv_allows_tf32() -> bool:
    """Whether torch lets float32 convolutions use TF32 (cuDNN's setting), set
    through either API.

    ``torch.backends.cudnn.conv.fp32_precision`` is "tf32" by default, inherits
    ``torch.backends.cudnn.fp32_precision`` and ``torch.backends.fp32_precision``
    when those are set, and reads "none" after the legacy
    ``torch.backends.cudnn.allow_tf32 = False``; reading ``allow_tf32`` raises
    once the new API set "ieee".  So "tf32"/"ieee" decide, anything else
    defers to the legacy flag.  (Measured with torch 2.13.)
    """
    cudnn = torch.backends.cudnn
    precision = getattr(getattr(cudnn, "conv", None), "fp32_precision", "none")
    if precision in ("tf32", "ieee"):
        return precision == "tf32"
    return cudnn.allow_tf32


def input_precision(dtype: torch.dtype, allow_tf32: bool) -> str:
    """``input_precision`` for ``tl.dot`` on operands of ``dtype``.

    16-bit operands ignore it ("tf32").  float32 operands use "tf32x3" (three
    TF32 tensor-core products, near float32 accuracy) when ``allow_tf32``, else
    "ieee" (FMA, exact float32 products).  Never a single "tf32" product: it
    truncates the operands, and on an H100 its error measured more than twice
    that of cuBLAS's TF32 on the same inputs.
    """
    if dtype != torch.float32:
        return "tf32"
    return "tf32x3" if allow_tf32 else "ieee"


# The narrowest N of a tensor-core dot.
ROW_SUM_WIDTH = tl.constexpr(16)


@triton.jit
def row_sum_operand(BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """``[BLOCK_K, ROW_SUM_WIDTH]`` of ``dtype``, ones in column 0 and zeros elsewhere: ``tile @`` it
    holds ``tile``'s row sums in column 0, summed on the tensor cores from the tile the main dot
    already loaded (products by 1 are exact, the sums float32); ``tl.sum`` over its columns
    gives them."""
    columns = tl.arange(0, ROW_SUM_WIDTH)[None, :]
    return tl.where(columns == 0, 1.0, 0.0).broadcast_to((BLOCK_K, ROW_SUM_WIDTH)).to(dtype)


@triton.jit
def as_float32(value):
    """A float argument as float32.  Triton types a Python float argument float32, but Inductor,
    which launches these kernels from a compiled graph's own code, types it float64: every product
    with it would then be float64, and a loop-carried accumulator that changes type fails to
    compile."""
    return tl.cast(value, tl.float32)


@triton.jit
def multiple_of_16(value):
    """``value`` rounded down to a multiple of 16: the launchers pass head dims
    and row strides that are multiples of 16 elements, and since no argument
    is specialized on alignment (see ``attention._kernel``) the kernels state
    it this way, so the compiler can prove their loads aligned and vectorize
    them."""
    return value // 16 * 16
