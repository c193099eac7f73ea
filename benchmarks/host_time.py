"""Host time per call of the Triton backend, with every kernel launch stubbed out.

At the seeds' short sequences the kernels take a few microseconds on a GPU, so
what a call does on the host before its kernels start sets the wall-clock.  This
measures exactly that part on any machine: the Triton backend runs on CPU tensors
(``TRITON_INTERPRET=1``) and ``KernelLaunch.__call__`` does nothing, so what is
timed is argument checks, backend choice, the registered op, autograd and the
building of each launch, but not Triton's own launcher (binding the arguments
and the driver call: some more microseconds per launch on a GPU).
``tests/test_host_cost.py`` counts the torch ops of the same calls.

The shapes are small, since the host path does not depend on them, except for the
copies a call makes (on a GPU those are kernels too, which this does not time);
gradients are taken with ``torch.autograd.grad``, so no leaf accumulates them.

Usage: ``python benchmarks/host_time.py [--rounds N]``; prints median and
p10-p90 microseconds per call.  Issue 9's target: at most 20 us per forward on
this class of CPU.  Forwards run with inputs that require gradients (autograd
records them, as in training) unless named "no grad" (inference).
"""

from __future__ import annotations

import argparse
import functools
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
from transformer_kernels.bench.timing import Schedule, Summary, measure  # noqa: E402

import transformer_kernels as tk  # noqa: E402
from transformer_kernels.backends.triton import _common  # noqa: E402

# Small shapes of the seeds' kind: the host path does not depend on the sizes.
BATCH, LENGTH, EMBED, HEADS = 2, 16, 64, 2


def _calls() -> dict[str, callable]:
    """name -> zero-argument call, forward alone and forward + backward."""
    head_dim = EMBED // HEADS
    query, key, value = (torch.randn(BATCH, HEADS, LENGTH, head_dim, requires_grad=True) for _ in range(3))
    padding = torch.arange(LENGTH)[None, :] >= torch.randint(LENGTH // 2, LENGTH + 1, (BATCH, 1))
    x = torch.randn(BATCH, LENGTH, EMBED, dtype=torch.float16, requires_grad=True)
    weight = torch.randn(3 * EMBED, EMBED, dtype=torch.float16, requires_grad=True)
    conv_x = torch.randn(BATCH, EMBED, LENGTH, requires_grad=True)
    conv_weight = torch.randn(2 * EMBED, EMBED, 3, requires_grad=True)

    def attention(**masks):
        return tk.scaled_dot_product_attention(query, key, value, backend="triton", **masks)

    def qkv():
        return tk.qkv_projection(x, weight, num_heads=HEADS, backend="triton")

    def glu():
        return tk.glu_conv1d(conv_x, conv_weight, backend="triton")

    def with_backward(call, inputs):
        def run():
            outputs = call()
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            torch.autograd.grad(outputs, inputs, [torch.ones_like(o) for o in outputs])
        return run

    def inference(call):
        def run():
            with torch.no_grad():
                return call()
        return run

    padded = functools.partial(attention, key_padding_mask=padding, is_causal=True)
    return {
        "attention fwd": attention,
        "attention fwd, no grad": inference(attention),
        "attention+padding fwd": padded,
        "attention+padding fwd+bwd": with_backward(padded, (query, key, value)),
        "qkv fwd": qkv,
        "qkv fwd+bwd": with_backward(qkv, (x, weight)),
        "glu fwd": glu,
        "glu fwd+bwd": with_backward(glu, (conv_x, conv_weight)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    rounds = parser.parse_args().rounds
    _common.KernelLaunch.__call__ = lambda self: None
    torch.set_num_threads(1)
    result = measure(_calls(), torch.device("cpu"), Schedule(rounds, rounds, 0.0, 0.02))
    print(f"host time per call, kernel launches stubbed ({rounds} rounds; torch {torch.__version__}, 1 thread)")
    for name, times in result["times_s"].items():
        summary = Summary.of([t * 1e6 for t in times])
        print(f"  {name:28s} {summary.median:8.1f} us  (p10-p90 {summary.low:.1f}-{summary.high:.1f})")


if __name__ == "__main__":
    main()
