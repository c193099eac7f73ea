"""GLU convolution of the convolutional seq2seq model: ours vs the seed's path vs per-tap GEMMs.

Implementations (activations enter and leave as ``[B, L, C]``, as the seed's
model holds them between layers):

* ``triton`` (CUDA) / ``eager`` (CPU): ``transformer_kernels.glu_conv1d`` on the
  channel-last view, no permute copies.
* ``cuda`` (CUDA): the same on the CUDA extension's kernels (unmeasured when it is not built).
* ``seed``: the notebook's layer: permute to ``[B, C, L]``, ``F.conv1d`` (cuDNN /
  oneDNN), ``F.glu``, ``+ residual``, ``* scale`` (a tensor, as in the seed),
  permute back; the decoder concatenates a pad-index filled prefix first.
* ``per_tap_gemm``: fairseq's ConvTBC (``torch.conv_tbc``: one GEMM per tap on
  ``[T, B, C]``), then GLU, residual and scale.

Cases: the seed's shapes (B=128, C=512, k=3, L 20-60, a 10-layer encoder stack
and the causal decoder layer) and long sequences (L 1k-8k, CUDA only).  On a
CPU the batch shrinks (the case name says so) to keep the suite short.
Directions: ``fwd``, ``bwd`` (gradients for x, weights and biases of one
stored forward) and ``fwd+bwd``.  Each (case, direction) is one group whose
implementations are timed interleaved (``benchmarks/interleaved.py``).

Decoding steps (CUDA): one ``glu_conv1d_step`` of the decoder layer (C=512, k=3) at batch x beam
1-64, Triton vs the CUDA extension vs the seed's step (the convolution of the cached window with
``F.conv1d``, then GLU): where a C++ launch's few microseconds should beat a Python-launched kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, timed_call

import transformer_kernels as tk

OP = "glu_conv1d"
OURS = "triton" if DEVICE.type == "cuda" else "eager"
DTYPE = torch.float16 if DEVICE.type == "cuda" else torch.float32
PAD_INDEX = 1.0  # the decoder's left padding holds the target pad index


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    length: int
    channels: int = 512
    kernel_size: int = 3
    layers: int = 1
    decoder: bool = False

    @property
    def name(self) -> str:
        kind = "dec" if self.decoder else (f"stack{self.layers}" if self.layers > 1 else "enc")
        return f"{kind}_B{self.batch}_C{self.channels}_L{self.length}_k{self.kernel_size}"


if DEVICE.type == "cuda":
    SEED_CASES = [Case(128, 20), Case(128, 60), Case(128, 40, decoder=True), Case(128, 40, layers=10)]
    LONG_CASES = [Case(16, 1024), Case(8, 4096), Case(4, 8192)]
else:
    SEED_CASES = [Case(16, 20), Case(16, 60), Case(16, 40, decoder=True), Case(4, 40, layers=10)]
    LONG_CASES = [Case(2, 1024)]
CASES = SEED_CASES + LONG_CASES
IMPLS = [OURS, "cuda", "seed", "per_tap_gemm"] if DEVICE.type == "cuda" else [OURS, "seed", "per_tap_gemm"]
DIRECTIONS = ["fwd", "bwd", "fwd+bwd"]

# Issue 4: GPU forward+backward >= 1.5x the seed path with peak memory <= 0.6x of it;
# CPU eager never slower than the seed path.
TARGETS = [
    {"op": OP, "case": case.name, "direction": "fwd+bwd", "impl": impl, "baseline": "seed", "min_speedup": 1.5,
     "max_memory_ratio": 0.6, "device": "cuda"}
    for impl in ("triton", "cuda")
    for case in [Case(128, 20), Case(128, 60), Case(128, 40, decoder=True), Case(128, 40, layers=10)]
] + [
    {"op": OP, "case": case.name, "direction": direction, "impl": "eager", "baseline": "seed", "min_speedup": 1.0,
     "device": "cpu"}
    for case in [Case(16, 20), Case(16, 60), Case(16, 40, decoder=True), Case(4, 40, layers=10), Case(2, 1024)]
    for direction in DIRECTIONS
]


def _layer_weights(case: Case, generator: torch.Generator):
    """Per layer: ``nn.Conv1d``-shaped weight and bias, plus the same weight in ConvTBC's ``[k, C_in, 2C]``."""
    weights = []
    for _ in range(case.layers):
        weight = torch.randn(2 * case.channels, case.channels, case.kernel_size, generator=generator)
        weight = (weight / math.sqrt(case.channels * case.kernel_size)).to(DEVICE, DTYPE)
        bias = torch.zeros(2 * case.channels, device=DEVICE, dtype=DTYPE)
        weights.append((weight, bias, weight.permute(2, 1, 0).contiguous()))
    return weights


def _ours(case: Case, backend: str):
    scale = math.sqrt(0.5)

    def run(x, weights):
        h = x.transpose(1, 2)  # [B, C, L] channel-last view
        for weight, bias, _ in weights:
            if case.decoder:
                h = tk.glu_conv1d(h, weight, bias, padding="causal", pad_value=PAD_INDEX, backend=backend)
            else:
                h = tk.glu_conv1d(h, weight, bias, residual=h, residual_scale=scale, backend=backend)
        return h.transpose(1, 2)

    return run


def _seed(case: Case):
    scale = torch.sqrt(torch.tensor([0.5], device=DEVICE, dtype=DTYPE))

    def run(x, weights):
        h = x.permute(0, 2, 1)
        for weight, bias, _ in weights:
            if case.decoder:
                padding = torch.zeros(h.shape[0], h.shape[1], case.kernel_size - 1, device=DEVICE, dtype=DTYPE)
                h = F.glu(F.conv1d(torch.cat((padding.fill_(PAD_INDEX), h), dim=2), weight, bias), dim=1)
            else:
                h = (F.glu(F.conv1d(h, weight, bias, padding=(case.kernel_size - 1) // 2), dim=1) + h) * scale
        return h.permute(0, 2, 1)

    return run


def _per_tap_gemm(case: Case):
    scale = math.sqrt(0.5)

    def run(x, weights):
        h = x.transpose(0, 1)  # [T, B, C]
        for _, bias, weight_tbc in weights:
            if case.decoder:
                padded = F.pad(h, (0, 0, 0, 0, case.kernel_size - 1, 0), value=PAD_INDEX)
                h = F.glu(torch.conv_tbc(padded.contiguous(), weight_tbc, bias, 0), dim=2)
            else:
                z = torch.conv_tbc(h.contiguous(), weight_tbc, bias, (case.kernel_size - 1) // 2)
                h = (F.glu(z, dim=2) + h) * scale
        return h.transpose(0, 1)

    return run


_IMPLEMENTATIONS = {
    OURS: functools.partial(_ours, backend=OURS), "cuda": functools.partial(_ours, backend="cuda"), "seed": _seed,
    "per_tap_gemm": _per_tap_gemm,
}


def _setup(case: Case, impl: str, direction: str):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(case.batch, case.length, case.channels, generator=generator).to(DEVICE, DTYPE)
    weights = _layer_weights(case, generator)
    layer = _IMPLEMENTATIONS[impl](case)
    leaves = [x.requires_grad_()]
    for weight, bias, weight_tbc in weights:
        # ConvTBC's weight is its own parameter; the other two paths train the nn.Conv1d weight.
        leaves += [weight_tbc if impl == "per_tap_gemm" else weight, bias]
    for leaf in leaves:
        leaf.requires_grad_()
    return timed_call(lambda: functools.partial(layer, x, weights), direction, leaves)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_glu_conv1d(compare, case: Case, direction: str):
    factories = {impl: functools.partial(_setup, case, impl, direction) for impl in IMPLS}
    compare(factories, op=OP, case=case.name, direction=direction, ours=OURS)


# Decoding steps: batch x beam sizes, and a ~1 ms budget per group is plenty for µs-scale calls.
STEP_BATCHES = [1, 8, 64] if DEVICE.type == "cuda" else []
STEP_IMPLS = ["triton", "cuda", "seed"]
TARGETS += [
    {"op": "glu_conv1d_step", "case": f"dec_step_B{batch}_C512_k3", "direction": "fwd", "impl": "cuda",
     "baseline": "triton", "min_speedup": 2.0, "device": "cuda"}
    for batch in STEP_BATCHES
]


def _setup_step(batch: int, impl: str):
    case = Case(batch, 1, decoder=True)
    generator = torch.Generator().manual_seed(0)
    ((weight, bias, _),) = _layer_weights(case, generator)
    x_t = torch.randn(batch, case.channels, generator=generator).to(DEVICE, DTYPE)
    state = torch.full((batch, case.channels, case.kernel_size - 1), PAD_INDEX, device=DEVICE, dtype=DTYPE)
    if impl == "seed":
        def step():
            window = torch.cat((state, x_t.unsqueeze(2)), dim=2)
            return F.glu(F.conv1d(window, weight, bias), dim=1).squeeze(2), window[:, :, 1:]
    else:
        def step():
            return tk.glu_conv1d_step(x_t, state, weight, bias, pad_value=PAD_INDEX, backend=impl)
    return timed_call(lambda: step, "fwd", [])


@pytest.mark.parametrize("batch", STEP_BATCHES)
def test_glu_conv1d_step(compare, batch: int):
    factories = {impl: functools.partial(_setup_step, batch, impl) for impl in STEP_IMPLS}
    compare(factories, op="glu_conv1d_step", case=f"dec_step_B{batch}_C512_k3", direction="fwd", ours="cuda")
