"""oneDNN's float32 CPU kernels, where they outrun the BLAS on this CPU.

torch runs a float32 matmul on a CPU through its BLAS (MKL in the x86 wheels) and a convolution
through oneDNN.  Which engine is faster depends on the CPU: on AMD CPUs with AVX-512, MKL runs its
AVX2 kernels and oneDNN AVX-512 (on the 2-core AMD EPYC of this project's CI, oneDNN's GEMM,
``mkldnn::_linear_pointwise``, the one inductor's CPU backend calls, ran 230 against the BLAS's
105 GFLOP/s at one thread, from 16 to 2048 rows of the seeds' QKV projection); on Intel CPUs
both use AVX-512.  :func:`speedup` measures the ratio once per process, and the eager backends
choose by it: :func:`linear` for the QKV projection's GEMMs, and the GLU convolution's oneDNN
backward, for its gradients' GEMMs.

oneDNN's GEMM sums each output over the whole contraction in one pass, where MKL blocks it: its
float32 error is about 1.7x MKL's (RMS) at a depth of K = 512-1024, and past twice MKL's deeper
(2.1-2.3x at K = 1536-8192, the QKV projection's gradients at the seeds' sizes).  :func:`linear`
keeps it within 1.7x by cutting deeper contractions into blocks of ``_MAX_DEPTH``, each added to
the sum by the GEMM's own add post-op.  Winograd's transforms would amplify it past twice torch's
own convolution, so the GLU convolution keeps its GEMMs on the BLAS.  And oneDNN reads a matrix
densely or not at all (a slice of columns took 1000x longer), so :func:`linear` hands it only
contiguous or transposed-contiguous operands.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import _tuning

__all__ = ["enabled", "speedup", "serves", "linear"]

_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
# oneDNN's GEMM serves the QKV projection from this speed-up over the BLAS on: a near tie keeps
# torch's own matmul.
_LINEAR_MIN_SPEEDUP = 1.2
# ... and from this many multiply-adds on: below, its fixed cost per call (its primitive looked up
# or made, the weight reordered) outweighs its faster kernels.  At one thread on the CI's AMD EPYC,
# [16, 128] x [128, 384] took 21 us against the BLAS's 19, [64, 128] x [128, 384] 40 against 63;
# decoding steps of a small Transformer ran 0.87x as fast with every GEMM on oneDNN.
_LINEAR_MIN_MACS = 1 << 20
# oneDNN's GEMM speed over the BLAS's on this CPU (see speedup); None until measured.
_speedup: Optional[float] = None


def enabled() -> bool:
    """oneDNN is built into torch and the user has not turned it off (``torch.backends.mkldnn``,
    which torch's own convolutions follow too)."""
    return torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled


def speedup() -> float:
    """How many times faster oneDNN's float32 GEMM runs than the BLAS's on this CPU: measured once
    per process on one thread (the best of five interleaved runs of a [512, 512] x [512, 1024]
    product each, tens of milliseconds), outside any tracing or dispatch mode; 0 without oneDNN.

    One thread, whatever torch's thread count: the ratio is that of the engines' kernels on one
    core (AVX2 against AVX-512 on AMD CPUs), which another job on the machine leaves as it is,
    where threads that share their cores with that job are descheduled at random and the ratio
    with them.  On the CI's 2-core AMD EPYC with one core kept busy by another process, three
    measurements on two threads gave 1.54, 4.91 and
    4.97 (2.17-2.21 idle), on one thread 2.10-2.14 (2.18-2.23 idle); benchmark reports run beside
    another job had recorded 1.08 and 1.25, and their eager QKV projection ran on the BLAS at
    half the speed.

    A timing can still land on either side of a threshold from one process to the next (on the
    CI's AMD EPYC eight processes measured 1.21-1.34 around 1.3), and with it the algorithms the
    eager backend picks, so their rounding.  Under
    ``torch.use_deterministic_algorithms(True)`` nothing is timed and 0 is returned: the BLAS
    paths, the same in every run, as torch's reproducibility notes ask of cuDNN's benchmarking."""
    global _speedup
    if torch.are_deterministic_algorithms_enabled():
        return 0.0
    if _speedup is None:
        with _tuning.timing_lock:
            if _speedup is None:
                _speedup = _measure() if _LINEAR is not None else 0.0
    return _speedup


def _measure() -> float:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _tuning.real_tensors():
            generator = torch.Generator().manual_seed(0)
            a = torch.randn(512, 512, generator=generator)
            weight = torch.randn(1024, 512, generator=generator)
            best = _tuning.best_times(
                {"onednn": lambda: _LINEAR(a, weight, None, "none", [], ""), "blas": lambda: F.linear(a, weight)}
            )
    finally:
        torch.set_num_threads(threads)
    return best["blas"] / best["onednn"]


# The deepest contraction oneDNN's GEMM sums in one pass (see the module's docstring).  The QKV
# projection's weight gradient [512, T] x [T, 512] erred (RMS, against torch's BLAS) 1.64x at
# T = 1024, 2.05x at 1536, 2.25x at 2048 and 2.07x at 8192 whole; 1.59x, 1.60x and 1.48x in blocks
# of 1024, in the same time (0.99-1.03x, one thread, interleaved).  Blocks of 512 erred about as
# much but cost the GLU convolution's weight gradient (depth 640-1024) 5-9%.
_MAX_DEPTH = 1024


def _depth_major(tensor: torch.Tensor) -> bool:
    """A 2-D operand stored contraction-major (its transpose contiguous): its slices along the
    contraction are dense too."""
    return tensor.dim() == 2 and tensor.t().is_contiguous()


def _dense(tensor: torch.Tensor) -> bool:
    return tensor.is_contiguous() or _depth_major(tensor)


def serves(input: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` multiplies ``input`` by ``weight`` on oneDNN's GEMM."""
    return (
        input.dtype == torch.float32
        and input.device.type == "cpu"
        and input.numel() * weight.shape[0] >= _LINEAR_MIN_MACS
        and weight.shape[1] > 0  # oneDNN refuses an empty contraction
        and _dense(input)
        and _dense(weight)
        and _LINEAR is not None
        and enabled()
        and speedup() >= _LINEAR_MIN_SPEEDUP
    )


def linear(
    input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, max_depth: int = _MAX_DEPTH
) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` (``input [..., K]``, ``weight [N, K]``) on oneDNN's GEMM
    for float32 CPU operands it reads densely, of ``_LINEAR_MIN_MACS`` or more, where it outruns
    the BLAS and is :func:`enabled`; else ``F.linear``.  A contraction deeper than ``max_depth``
    of operands stored contraction-major (``input.t()`` and ``weight.t()`` contiguous) is summed in
    blocks of that depth; callers that want oneDNN's accuracy bounded hand it those or shallow
    ones.  Not differentiable: for the backends' kernels, below autograd."""
    if serves(input, weight):
        depth = weight.shape[1]
        if depth <= max_depth or not (_depth_major(input) and _depth_major(weight)):
            return _LINEAR(input, weight, bias, "none", [], "")
        out = _LINEAR(input[:, :max_depth], weight[:, :max_depth], bias, "none", [], "")
        for start in range(max_depth, depth, max_depth):
            block = slice(start, start + max_depth)
            out = _LINEAR.binary(input[:, block], out, weight[:, block], None, "add")
        return out
    return F.linear(input, weight, bias)
