"""GLU convolution of the convolutional seq2seq model: ours vs the seed's path vs per-tap GEMMs.

Implementations (activations enter and leave as ``[B, L, C]``, as the seed's model holds them
between layers):

* ``eager`` / ``triton`` / ``cuda``: ``transformer_kernels.glu_conv1d`` on the channel-last view,
  no permute copies.
* ``seed``: the notebook's layer, ``nn.Conv1d`` + ``F.glu``: permute to ``[B, C, L]``,
  ``F.conv1d`` (cuDNN / oneDNN), ``F.glu``, ``+ residual``, ``* scale`` (a tensor, as in the seed),
  permute back; the decoder concatenates a pad-index filled prefix first.
* ``per_tap_gemm``: fairseq's ConvTBC (``torch.conv_tbc``: one GEMM per tap on ``[T, B, C]``),
  then GLU, residual and scale.

Cases: the seed's shapes (B=128, C=512, k=3, L 20-60, a 10-layer encoder stack and the causal
decoder layer) and long sequences (L 1k-8k, CUDA only).  On a CPU the batch shrinks (the case name
says so).  Errors are measured against ``transformer_kernels.reference.glu_conv1d`` in float64
(CPU) or float32 (CUDA).

Decoding steps (op ``glu_conv1d_step``, CUDA): one step of the decoder layer (C=512, k=3) at
batch x beam 1-64, ours vs the seed's step (the cached window convolved with ``F.conv1d``, then
GLU): microsecond calls, where a C++ launch should beat a Python-launched kernel.  The same steps
in place (op ``glu_conv1d_update``: a ring read and written by one kernel) against what a decoder
keeping its state in one buffer pays otherwise: ``step_copy``, ``glu_conv1d_step`` (Triton on a
GPU, eager on a CPU) and the new state copied back, and the seed's step with its copy back.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F

import transformer_kernels as tk
from transformer_kernels.reference import glu_conv1d as reference_glu_conv1d

from . import DIRECTIONS, GEMM_DIRECTION_COST, Group, Impl, Setting, Target, backends_for, max_abs_error

OP = "glu_conv1d"
PEERS = ("seed", "per_tap_gemm")
PAD_INDEX = 1.0  # the decoder's left padding holds the target pad index
SCALE = math.sqrt(0.5)


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    length: int
    channels: int = 512
    kernel_size: int = 3
    layers: int = 1
    decoder: bool = False

    @property
    def kind(self) -> str:
        return "dec" if self.decoder else (f"stack{self.layers}" if self.layers > 1 else "enc")

    @property
    def name(self) -> str:
        return f"{self.kind}_B{self.batch}_C{self.channels}_L{self.length}_k{self.kernel_size}"

    @property
    def family(self) -> str:
        return f"{self.kind}_B{self.batch}_C{self.channels}_k{self.kernel_size}"


GPU_SEED_CASES = [Case(128, 20), Case(128, 60), Case(128, 40, decoder=True), Case(128, 40, layers=10)]
GPU_LONG_CASES = [Case(16, 1024), Case(8, 4096), Case(4, 8192)]
CPU_CASES = [Case(16, 20), Case(16, 60), Case(16, 40, decoder=True), Case(4, 40, layers=10), Case(2, 1024)]

# Issue 4: GPU forward+backward >= 1.5x the seed path with peak memory <= 0.6x of it;
# CPU eager never slower than the seed path.
STEP_OP = "glu_conv1d_step"
UPDATE_OP = "glu_conv1d_update"
STEP_BATCHES = (1, 8, 64)


def _step_case(batch: int, channels: int = 512) -> str:
    return f"dec_step_B{batch}_C{channels}_k3"


TARGETS = (
    [Target(OP, case.name, "fwd+bwd", impl, "seed", 1.5, "cuda", max_memory_ratio=0.6)
     for impl in ("triton", "cuda") for case in GPU_SEED_CASES]
    + [Target(OP, case.name, direction, "eager", "seed", 1.0, "cpu") for case in CPU_CASES for direction in DIRECTIONS]
    # The CUDA extension's decoding step 2x Triton's at batch x beam <= 64.
    + [Target(STEP_OP, _step_case(batch), "fwd", "cuda", "triton", 2.0, "cuda") for batch in STEP_BATCHES]
)


def cases(setting: Setting) -> list[Case]:
    if setting.size == "tiny":
        return [Case(2, 8, channels=16), Case(2, 16, channels=16), Case(2, 8, channels=16, decoder=True)]
    if setting.cuda:
        return GPU_SEED_CASES + GPU_LONG_CASES
    return CPU_CASES


def directions(case: Case, setting: Setting) -> tuple[str, ...]:
    if setting.size == "quick" and case.layers > 1:
        return ("fwd",)
    return setting.directions


@dataclasses.dataclass
class Inputs:
    """``x`` ``[B, L, C]`` and per layer an ``nn.Conv1d``-shaped weight and bias, plus the same
    weight as ConvTBC's ``[k, C_in, 2C]`` (its own leaf: the path that trains it)."""

    x: torch.Tensor
    layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

    @classmethod
    def make(cls, case: Case, setting: Setting) -> "Inputs":
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(case.batch, case.length, case.channels, generator=generator)
        layers = []
        for _ in range(case.layers):
            weight = torch.randn(2 * case.channels, case.channels, case.kernel_size, generator=generator)
            weight = weight / math.sqrt(case.channels * case.kernel_size)
            bias = torch.randn(2 * case.channels, generator=generator) * 0.1
            layers.append((weight, bias, weight.permute(2, 1, 0).contiguous()))
        to = functools.partial(torch.Tensor.to, device=setting.device, dtype=setting.dtype)
        return cls(to(x).requires_grad_(), [tuple(to(t).requires_grad_() for t in layer) for layer in layers])


def _ours(case: Case, backend: str, inputs: Inputs) -> torch.Tensor:
    h = inputs.x.transpose(1, 2)  # [B, C, L] channel-last view
    for weight, bias, _ in inputs.layers:
        if case.decoder:
            h = tk.glu_conv1d(h, weight, bias, padding="causal", pad_value=PAD_INDEX, backend=backend)
        else:
            h = tk.glu_conv1d(h, weight, bias, residual=h, residual_scale=SCALE, backend=backend)
    return h.transpose(1, 2)


def _seed(case: Case, inputs: Inputs, scale: torch.Tensor) -> torch.Tensor:
    h = inputs.x.permute(0, 2, 1)
    for weight, bias, _ in inputs.layers:
        if case.decoder:
            padding = torch.zeros(h.shape[0], h.shape[1], case.kernel_size - 1, device=h.device, dtype=h.dtype)
            h = F.glu(F.conv1d(torch.cat((padding.fill_(PAD_INDEX), h), dim=2), weight, bias), dim=1)
        else:
            h = (F.glu(F.conv1d(h, weight, bias, padding=(case.kernel_size - 1) // 2), dim=1) + h) * scale
    return h.permute(0, 2, 1)


def _per_tap_gemm(case: Case, inputs: Inputs) -> torch.Tensor:
    h = inputs.x.transpose(0, 1)  # [T, B, C]
    for _, bias, weight_tbc in inputs.layers:
        if case.decoder:
            padded = F.pad(h, (0, 0, 0, 0, case.kernel_size - 1, 0), value=PAD_INDEX)
            h = F.glu(torch.conv_tbc(padded.contiguous(), weight_tbc, bias, 0), dim=2)
        else:
            z = torch.conv_tbc(h.contiguous(), weight_tbc, bias, (case.kernel_size - 1) // 2)
            h = (F.glu(z, dim=2) + h) * SCALE
    return h.transpose(0, 1)


def _exact(case: Case, inputs: Inputs, dtype: torch.dtype) -> torch.Tensor:
    h = inputs.x.detach().to(dtype).transpose(1, 2)
    for weight, bias, _ in inputs.layers:
        weight, bias = weight.detach().to(dtype), bias.detach().to(dtype)
        if case.decoder:
            h = reference_glu_conv1d(h, weight, bias, padding="causal", pad_value=PAD_INDEX)
        else:
            h = reference_glu_conv1d(h, weight, bias, residual=h, residual_scale=SCALE)
    return h.transpose(1, 2)


def _impl(case: Case, impl: str, inputs: Inputs) -> Impl:
    # ConvTBC's weight is its own parameter; the other paths train the nn.Conv1d weight.
    trained = [t for weight, bias, weight_tbc in inputs.layers
               for t in ((weight_tbc if impl == "per_tap_gemm" else weight), bias)]
    if impl == "seed":
        scale = torch.sqrt(torch.tensor([0.5], device=inputs.x.device, dtype=inputs.x.dtype))
        forward = functools.partial(_seed, case, inputs, scale)
    elif impl == "per_tap_gemm":
        forward = functools.partial(_per_tap_gemm, case, inputs)
    else:
        forward = functools.partial(_ours, case, impl, inputs)
    return Impl(forward, [inputs.x, *trained])


def _case_groups(case: Case, setting: Setting) -> list[Group]:
    """The case's group per direction."""
    backends = backends_for("glu_conv", setting)

    @functools.cache  # made when the case's first group is measured, shared by its directions and implementations
    def inputs() -> Inputs:
        return Inputs.make(case, setting)

    @functools.cache
    def exact() -> torch.Tensor:
        with torch.no_grad():
            return _exact(case, inputs(), setting.exact_dtype)

    def setup(impl: str) -> Impl:
        return _impl(case, impl, inputs())

    forward = 2 * case.batch * case.length * case.channels * 2 * case.channels * case.kernel_size * case.layers
    return [Group(
        op=OP, case=case.name, direction=direction,
        setups={impl: functools.partial(setup, impl) for impl in [*backends.ours, *PEERS]},
        unavailable=backends.unavailable, error=lambda outputs: max_abs_error(outputs, exact()),
        flops=forward * GEMM_DIRECTION_COST[direction], ours=backends.ours,
        params={"length": case.length, "family": case.family}, reference="seed",
    ) for direction in directions(case, setting)]


def _step_inputs(batch: int, channels: int, setting: Setting) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decoding step's ``x_t`` ``[B, C]`` and the decoder layer's weight and bias (C_in = C, k = 3)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(2 * channels, channels, 3, generator=generator) / math.sqrt(3 * channels)
    bias = torch.randn(2 * channels, generator=generator) * 0.1
    x_t = torch.randn(batch, channels, generator=generator)
    return tuple(t.to(setting.device, setting.dtype) for t in (x_t, weight, bias))


def _pad_state(batch: int, channels: int, positions: int, setting: Setting) -> torch.Tensor:
    """A decoding state of ``positions`` inputs, all the causal padding (``pad_index``)."""
    return torch.full((batch, channels, positions), PAD_INDEX, device=setting.device, dtype=setting.dtype)


def _step_group(batch: int, channels: int, setting: Setting) -> Group:
    """One decoding step of the causal decoder layer, ``state`` a window of ``pad_index``."""
    backends = backends_for("glu_conv", setting)

    @functools.cache
    def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        x_t, weight, bias = _step_inputs(batch, channels, setting)
        return x_t, _pad_state(batch, channels, 2, setting), weight, bias

    def setup(impl: str) -> Impl:
        x_t, state, weight, bias = inputs()
        if impl == "seed":
            def step():
                window = torch.cat((state, x_t.unsqueeze(2)), dim=2)
                return F.glu(F.conv1d(window, weight, bias), dim=1).squeeze(2)
        else:
            def step():
                return tk.glu_conv1d_step(x_t, state, weight, bias, pad_value=PAD_INDEX, backend=impl)[0]
        return Impl(step, [])

    def error(y_t: torch.Tensor) -> float:
        x_t, state, weight, bias = (t.to(setting.exact_dtype) for t in inputs())
        window = torch.cat((state, x_t.unsqueeze(2)), dim=2)
        # The causal convolution's last position sees exactly the window.
        return max_abs_error(y_t, reference_glu_conv1d(window, weight, bias, padding="causal")[:, :, -1])

    return Group(
        op=STEP_OP, case=_step_case(batch, channels), direction="fwd",
        setups={impl: functools.partial(setup, impl) for impl in [*backends.ours, "seed"]},
        unavailable=backends.unavailable, error=error, flops=2.0 * batch * channels * 2 * channels * 3,
        ours=backends.ours, params={"family": None}, reference="seed",
    )


def _update_group(batch: int, channels: int, setting: Setting) -> Group:
    """The decoding step of :func:`_step_group` in place: at position 2 of a ring of ``pad_index``,
    which each call writes ``x_t`` into (the same slot every time), against the functional step and
    the seed's, each with the copy of the new state into the decoder's buffer (another one than it
    reads, so that every call computes the same)."""
    backends = backends_for("glu_conv_update", setting)
    step_group = _step_group(batch, channels, setting)

    inputs = functools.cache(functools.partial(_step_inputs, batch, channels, setting))

    def setup(impl: str) -> Impl:
        x_t, weight, bias = inputs()
        if impl in ("seed", "step_copy"):
            state = _pad_state(batch, channels, 2, setting)
            next_state = torch.empty_like(state)
            step_backend = "triton" if setting.cuda else "eager"

            def step():
                if impl == "seed":
                    window = torch.cat((state, x_t.unsqueeze(2)), dim=2)
                    y_t = F.glu(F.conv1d(window, weight, bias), dim=1).squeeze(2)
                    new_state = window[:, :, 1:]
                else:
                    y_t, new_state = tk.glu_conv1d_step(x_t, state, weight, bias, backend=step_backend)
                next_state.copy_(new_state)
                return y_t
        else:
            ring = _pad_state(batch, channels, 3, setting)
            position = torch.tensor(2, device=setting.device)

            def step():
                return tk.glu_conv1d_update(x_t, ring, weight, bias, position=position, backend=impl)
        return Impl(step, [])

    return dataclasses.replace(
        step_group, op=UPDATE_OP, setups={impl: functools.partial(setup, impl)
                                          for impl in [*backends.ours, "step_copy", "seed"]},
        unavailable=backends.unavailable, ours=backends.ours,
    )


def groups(setting: Setting) -> list[Group]:
    step_groups = []
    if setting.cuda:
        step_groups = [make(batch, 512, setting) for make in (_step_group, _update_group) for batch in STEP_BATCHES]
    elif setting.size == "tiny":
        step_groups = [_step_group(2, 16, setting), _update_group(2, 16, setting)]
    return [group for case in cases(setting) for group in _case_groups(case, setting)] + step_groups
