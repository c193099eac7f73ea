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
copies a call makes: on CPU tensors a copy moves its data on the host, where on a GPU it is a
kernel, of which only the launch is host time.  The GLU convolution's forward packs its weight
(128 x 64 x 3 here) on every call: ``glu weight pack`` times that copy alone, so that it can be
told apart (a decoding step's kernel reads the weight as it is, unpacked).  Gradients are taken with ``torch.autograd.grad``, so no leaf accumulates them.

Usage: ``python benchmarks/host_time.py [--rounds N]``; prints median and
p10-p90 microseconds per call.  Issue 9's target: at most 20 us per forward on
this class of CPU.  Forwards run with inputs that require gradients (autograd
records them, as in training) unless named "no grad" (inference).

It then times, in a second process that loads the kernels compiled rather than
interpreted, the part of Triton's own launch that happens before the driver
call, for each attention kernel and each GEMM kernel: ``kernel[grid](...)``
binding its arguments and building its cache key (``JITFunction.run``), against
``DirectLaunch``'s replay of a template's arguments and its key.  The driver
call itself needs a GPU.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys

_LAUNCH_PREPARATION = "--launch-preparation"
# Before triton is imported: the call timings interpret, the launch preparation compiles.
os.environ["TRITON_INTERPRET"] = "0" if _LAUNCH_PREPARATION in sys.argv else "1"

import torch  # noqa: E402
from transformer_kernels.bench.timing import Schedule, Summary, host_speed, measure  # noqa: E402

import transformer_kernels as tk  # noqa: E402
from transformer_kernels.backends.triton import _common  # noqa: E402
from transformer_kernels.backends.triton import glu_conv as triton_glu_conv  # noqa: E402

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

    # A decoding step of a causal layer: the new position and the last k - 1 inputs.
    step_x, step_state = torch.randn(BATCH, EMBED), torch.randn(BATCH, EMBED, conv_weight.shape[2] - 1)

    def glu_step():
        return tk.glu_conv1d_step(step_x, step_state, conv_weight, backend="triton")

    # The same step in place: a ring of k inputs and the position on the device.
    ring, position = torch.randn(BATCH, EMBED, conv_weight.shape[2]), torch.tensor(5)

    def glu_update():
        return tk.glu_conv1d_update(step_x, ring, conv_weight, position=position, backend="triton")

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
        "glu step, no grad": inference(glu_step),
        "glu update, no grad": inference(glu_update),
        "glu weight pack": functools.partial(triton_glu_conv._packed_weight, conv_weight.detach()),
    }


def _print_launch_preparation(rounds: int) -> None:
    """Microseconds per launch before the driver call: Triton's binding and cache key against
    ``DirectLaunch``'s, for the attention launches of the seeds' kind of call (bf16, head dim 64,
    causal with key padding, sm_90) and one launch of each GEMM kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import compute_cache_key, create_function_from_signature

    from transformer_kernels.backends.triton import _split_sum, attention, glu_conv, qkv

    backend = make_backend(GPUTarget("cuda", 90, 32))
    launches = {}
    for target in attention.compile_targets():
        if 90 in target.capabilities and (target.name.endswith("_bf16_d64_causal_padding") or "_delta_bf16" in target.name
                                          or target.name == "attention_key_bounds"):
            launches[target.name] = target.launch()
    # The GEMMs: the first sm_90 target of each kernel.
    for module in (qkv, glu_conv, _split_sum):
        for target in module.compile_targets():
            launch = target.launch()
            if 90 in target.capabilities and all(other.kernel is not launch.kernel for other in launches.values()):
                launches[target.name] = launch

    def triton_preparation(launch, binder, key_cache):
        def prepare():
            bound_args, specialization, options = binder(*launch.args, **launch.kwargs)
            return compute_cache_key(key_cache, specialization, options), list(bound_args.values())
        return prepare

    def direct_preparation(launch):
        compiled = {}

        def prepare():
            arguments = launch.direct.arguments(launch)
            return compiled.get(launch.direct.key(0, arguments)), arguments
        return prepare

    calls = {}
    for name, launch in launches.items():
        binder = create_function_from_signature(launch.kernel.signature, launch.kernel.params, backend)
        calls[f"{name} triton"] = triton_preparation(launch, binder, {})
        calls[f"{name} direct"] = direct_preparation(launch)
    result = measure(calls, torch.device("cpu"), Schedule(rounds, rounds, 0.0, 0.02))
    print(f"launch preparation before the driver call, per launch ({rounds} rounds; triton {triton.__version__})")
    for name, launch in launches.items():
        triton_us, direct_us = (Summary.of([t * 1e6 for t in result["times_s"][f"{name} {way}"]]).median
                                for way in ("triton", "direct"))
        print(f"  {name:54s} {len(launch.args) + len(launch.kwargs):3d} arguments: "
              f"kernel[grid] {triton_us:5.1f} us, direct {direct_us:4.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument(_LAUNCH_PREPARATION, action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    rounds = options.rounds
    torch.set_num_threads(1)
    if options.launch_preparation:
        _print_launch_preparation(rounds)
        return
    _common.KernelLaunch.__call__ = lambda self: None
    result = measure(_calls(), torch.device("cpu"), Schedule(rounds, rounds, 0.0, 0.02))
    print(host_speed())
    print(f"host time per call, kernel launches stubbed ({rounds} rounds; torch {torch.__version__}, 1 thread)")
    for name, times in result["times_s"].items():
        summary = Summary.of([t * 1e6 for t in times])
        print(f"  {name:28s} {summary.median:8.1f} us  (p10-p90 {summary.low:.1f}-{summary.high:.1f})")
    sys.stdout.flush()
    subprocess.run([sys.executable, __file__, _LAUNCH_PREPARATION, "--rounds", str(rounds)], check=True)


if __name__ == "__main__":
    main()
