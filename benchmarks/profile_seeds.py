"""Where a training step's share of each op goes at the seeds' sizes on the present GPU.

    python benchmarks/profile_seeds.py [--out FILE]

The H200 report of 2026-11-27 (benchmarks/results/nvidia-h200-2026-11-27-c3c60f6) timed the Triton
attention's forward+backward at the seeds' padded batches at about twice torch SDPA's, and about
as long at 16 tokens as at 64: a cost that does not grow with the work, which on the CPU (launches
stubbed, benchmarks/host_time.py) the host path does not account for.  For attention, the QKV
projection and the GLU convolution at the seeds' sizes (bfloat16), ours on the Triton backend and
torch's counterpart each run a few forward+backward steps under ``torch.profiler``: the wall time
per step, the same step replayed from a CUDA graph (its kernels without the host path between
them), the same two for the forward alone without autograd (inference), then the ops by their own
CPU time and by their GPU time, so a step's time can be split into host work, kernels and waits.
The GLU convolution also runs ours on the two inputs its kernels treat apart: the decoder's causal
padding holding a value, and channel-first x; and one decoding step of a decoder layer's
convolution (``glu_conv1d_step``) against the seed's conv1d over the window.  One long case follows, dense attention over 16k
tokens of 1024, whose GPU-time table splits ours (Triton, and the CUDA extension where it is built)
and SDPA's forward+backward by kernel.

Then the seed models' training steps (forward, loss and every parameter's gradient), exactly as the
report's ``models`` groups time them (:mod:`transformer_kernels.bench.suites.models`): the fused
model on the Triton backend against the reference model (and, for the Transformer, torch's
``nn.Transformer`` stack).  The H200 report of 2026-11-27 (03ce1d0) timed the ConvSeq2Seq step at
0.91x the reference's, while each of its layers' GLU convolution alone ran faster than torch's: the
model's own profile says which kernels and which host work make up the difference.

Its first line is the host's speed at a call's kinds of work (``bench.timing.host_speed``), which
``benchmarks/host_time.py`` prints on the CPU it times too.  For ours on the ops (the ``triton``
rows, and the attention's ``cuda`` rows where the extension is built), two more lines say where
the host path goes: the host-device synchronizations one step makes
(``torch.cuda.set_sync_debug_mode``: none is expected), and the Python functions that take the
most of a step's host time, by their own time under ``cProfile`` (its overhead inflates each
call about alike, so read the ranking, not the sums): on the H200 (profile_seeds-6f5b769.txt) a
16-token attention step took many times its kernels' time replayed, far more host time than the
same step's host path takes on a CPU with launches stubbed (benchmarks/host_time.py).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import math
import pstats
import time
import warnings

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import transformer_kernels as tk
from transformer_kernels.bench.graphs import captured
from transformer_kernels.bench.timing import host_speed
from transformer_kernels.bench.suites import Setting, backends_for
from transformer_kernels.bench.suites import models as model_suite

STEPS = 10
# Rows of each profile table: an op's few kernels, or a model step's many.
OP_ROWS, MODEL_ROWS = 12, 25
ACTIVITIES = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
DEVICE, DTYPE = torch.device("cuda"), torch.bfloat16
BATCH, HEADS, HEAD_DIM, EMBED, CHANNELS = 128, 8, 64, 512, 512


def _gpu_attention_backends(device: torch.device, dtype: torch.dtype) -> list[str]:
    """Our attention backends with GPU kernels that can run here: Triton's, and the CUDA extension's
    where it is built (the eager one, which runs anywhere, is not profiled)."""
    ours = backends_for("attention", Setting(device, dtype, "quick")).ours
    return [name for name in ("triton", "cuda") if name in ours]


def _op_cases(device: torch.device, dtype: torch.dtype) -> dict:
    """name -> {implementation: (forward, leaves)}: the ops at the seeds' sizes."""
    generator = torch.Generator().manual_seed(0)

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device, dtype).requires_grad_()

    cases = {}
    # The CUDA extension's attention too, where it is built: at these lengths it takes no key bounds.
    ours = _gpu_attention_backends(device, dtype)
    for length in (16, 64):
        # The leaves themselves: a view taken outside the step would put its backward node on the
        # stream it ran on, which a captured backward then waits on (and the capture fails).
        q, k, v = (leaf(BATCH, length, HEADS, HEAD_DIM) for _ in range(3))
        lengths = torch.randint(length // 4, length + 1, (BATCH,), generator=generator)
        padding = (torch.arange(length) >= lengths[:, None]).to(device)
        attention = {
            name: lambda q=q, k=k, v=v, p=padding, name=name: tk.scaled_dot_product_attention(
                *(t.transpose(1, 2) for t in (q, k, v)), key_padding_mask=p, backend=name)
            for name in ours
        }
        attention["torch_sdpa"] = lambda q=q, k=k, v=v, p=padding: F.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (q, k, v)), attn_mask=~p[:, None, None, :])
        cases[f"attention_B{BATCH}_L{length}_padded"] = ([q, k, v], attention)
    x, weight = leaf(BATCH, 16, EMBED), leaf(3 * EMBED, EMBED, scale=EMBED**-0.5)
    cases[f"qkv_B{BATCH}_L16_E{EMBED}"] = ([x, weight], {
        "triton": lambda: tk.qkv_projection(x, weight, num_heads=HEADS, backend="triton"),
        "torch_linear": lambda: F.linear(x, weight).view(BATCH, 16, 3, HEADS, -1).permute(2, 0, 3, 1, 4).unbind(0),
    })
    h, conv_weight = leaf(BATCH, 40, CHANNELS), leaf(2 * CHANNELS, CHANNELS, 3, scale=0.03)
    cases[f"glu_B{BATCH}_C{CHANNELS}_L40"] = ([h, conv_weight], {
        "triton": lambda: tk.glu_conv1d(h.transpose(1, 2), conv_weight, residual=h.transpose(1, 2),
                                        residual_scale=math.sqrt(0.5), backend="triton"),
        "torch_conv1d": lambda: (F.glu(F.conv1d(h.transpose(1, 2), conv_weight, padding=1), dim=1)
                                 + h.transpose(1, 2)) * math.sqrt(0.5),
        # Ours on the variants the kernels treat apart: the decoder's causal padding holding the pad
        # index (selected into each x tile in registers; zeros are the copies' own fill), and
        # channel-first x [B, C, L], as a nn.Conv1d user holds it (its tiles loaded 2 bytes at a time).
        "triton_causal_pad1": lambda: tk.glu_conv1d(h.transpose(1, 2), conv_weight, padding="causal", pad_value=1.0,
                                                    residual=h.transpose(1, 2), residual_scale=math.sqrt(0.5),
                                                    backend="triton"),
    })
    h_first = leaf(BATCH, CHANNELS, 40)
    cases[f"glu_B{BATCH}_C{CHANNELS}_L40_channel_first"] = ([h_first, conv_weight], {
        "triton": lambda: tk.glu_conv1d(h_first, conv_weight, residual=h_first, residual_scale=math.sqrt(0.5),
                                        backend="triton"),
    })
    # One decoding step of a decoder layer's convolution, batch x beam 1 and 8: the H200 report of
    # 2026-11-28 (7c14f3d) timed Triton's at 89 and 124 us a call, the seed's (conv1d over the window,
    # then glu) at 73 and 87; its "forward alone" line splits that into host work and kernels.
    glu_steps = ["triton"] + [name for name in ("cuda",) if name in backends_for("glu_conv", Setting(
        device, dtype, "quick")).ours]
    for batch in (1, 8):
        x_t, state = leaf(batch, CHANNELS), leaf(batch, CHANNELS, 2)
        step = {name: lambda x_t=x_t, state=state, name=name: tk.glu_conv1d_step(x_t, state, conv_weight,
                                                                                backend=name)[0]
                for name in glu_steps}
        step["seed"] = lambda x_t=x_t, state=state: F.glu(F.conv1d(torch.cat([state, x_t[:, :, None]], 2),
                                                                   conv_weight), dim=1)[:, :, 0]
        cases[f"glu_step_B{batch}_C{CHANNELS}"] = ([x_t, state], step)
    return {name: {implementation: (forward, leaves) for implementation, forward in implementations.items()}
            for name, (leaves, implementations) in cases.items()}


def _long_attention_cases(device: torch.device, dtype: torch.dtype) -> dict:
    """name -> {implementation: (forward, leaves)}: dense attention over 16k tokens of 1024 (the
    report's ``dense_B16_L1024_D64``), ours against torch SDPA's own choice, whose profile tables
    give each kernel's GPU time: forward and backward apart (the H200 report of 2026-11-27, 03ce1d0,
    timed only their sum, the CUDA extension's at about twice the Triton kernels')."""
    generator = torch.Generator().manual_seed(0)
    batch, length, heads = 16, 1024, 2048 // HEAD_DIM
    q, k, v = (torch.randn(batch, heads, length, HEAD_DIM, generator=generator).to(device, dtype).requires_grad_()
               for _ in range(3))
    attention = {name: lambda name=name: tk.scaled_dot_product_attention(q, k, v, backend=name)
                 for name in _gpu_attention_backends(device, dtype)}
    attention["torch_sdpa"] = lambda: F.scaled_dot_product_attention(q, k, v)
    return {f"attention_B{batch}_L{length}_D{HEAD_DIM}_dense": {
        implementation: (forward, [q, k, v]) for implementation, forward in attention.items()}}


def _model_cases(device: torch.device, dtype: torch.dtype) -> dict:
    """name -> {implementation: (forward, leaves)}: the report's seed-model training steps
    (``forward`` returns the loss, ``leaves`` are the model's parameters)."""
    cases = {}
    setting = Setting(device, dtype, "quick")
    for group in model_suite.groups(setting):
        if group.direction != "fwd+bwd":
            continue
        implementations = {}
        for implementation in (setting.ours, "reference", "nn_transformer"):
            if implementation in group.setups:
                made = group.setups[implementation]()
                implementations[implementation] = (made.forward, made.leaves)
        cases[group.case] = implementations
    return cases


def _step(forward, leaves) -> tuple[torch.Tensor, ...]:
    outputs = forward()
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    return torch.autograd.grad(outputs, leaves, [torch.ones_like(out) for out in outputs])


def _wall_us(run) -> float:
    """Microseconds per call of ``run``, over ``STEPS`` calls back to back."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(STEPS):
        run()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / STEPS * 1e6


def _replayed_us(run) -> str:
    """``run``'s time replayed from a CUDA graph: its kernels alone."""
    try:
        graph, _ = captured(run)
    except RuntimeError as error:  # a step that syncs cannot be captured: say so, time the rest
        return f"not capturable ({str(error).splitlines()[0]})"
    return f"{_wall_us(graph.replay):.0f} us replayed from a CUDA graph"


def _inference(forward) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        outputs = forward()
    return outputs if isinstance(outputs, (tuple, list)) else (outputs,)


def _host_syncs(run) -> str:
    """The host-device synchronizations one call of ``run`` makes, as torch's sync debug mode warns of them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    return f"host-device syncs per step: {len(syncs)}" + (f" (first: {syncs[0]})" if syncs else "")


def _python_hotspots(run, rows: int) -> list[str]:
    """The Python functions of ``STEPS`` calls of ``run``, by their own time under cProfile, per call."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(STEPS):
        run()
    torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, function) -> (primitive calls, calls, own s, total s, callers)
    hottest = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:rows]
    lines = [f"{'own us':>8} {'total us':>9} {'calls':>6}  function"]
    for (file, line, function), (_, calls, own, total, _) in hottest:
        where = function if file == "~" else f"{'/'.join(file.split('/')[-2:])}:{line}({function})"
        lines.append(f"{own / STEPS * 1e6:8.1f} {total / STEPS * 1e6:9.1f} {calls / STEPS:6.1f}  {where}")
    return lines


def _profiled(forward, leaves, rows: int, host_path: bool) -> list[str]:
    """The timings of one implementation's step, then its ops by own CPU time and by GPU time, and
    with ``host_path`` its host-device syncs and Python functions by own time."""
    for _ in range(5):
        _step(forward, leaves)
    step = functools.partial(_step, forward, leaves)
    inference = functools.partial(_inference, forward)
    timings = (f"{_wall_us(step):.0f} us per forward+backward (unprofiled), {_replayed_us(step)}; "
               f"forward alone without autograd: {_wall_us(inference):.0f} us, {_replayed_us(inference)}")
    with profile(activities=ACTIVITIES) as prof:
        for _ in range(STEPS):
            _step(forward, leaves)
        torch.cuda.synchronize()
    events = prof.key_averages()
    lines = [timings] + [events.table(sort_by=sort, row_limit=rows, max_name_column_width=60)
                         for sort in ("self_cpu_time_total", "self_device_time_total")]
    if host_path:
        lines += [_host_syncs(step), "Python functions of a step, by own time (cProfile, per step):",
                  *_python_hotspots(step, rows)]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args()
    with open(args.out, "w") if args.out else contextlib.nullcontext() as out:

        def emit(*lines: str) -> None:
            # Case by case, so that a run its time limit cuts off keeps what it measured.
            for line in lines:
                print(line, flush=True)
                if out is not None:
                    out.write(line + "\n")
                    out.flush()

        emit(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {DTYPE}, {STEPS} steps each", host_speed())
        # Ours on the ops (the "triton" and "cuda" rows) also get their host path's syncs and Python functions.
        for cases, rows, host_path in ((_op_cases, OP_ROWS, True), (_long_attention_cases, OP_ROWS, False),
                                       (_model_cases, MODEL_ROWS, False)):
            for name, implementations in cases(DEVICE, DTYPE).items():
                for implementation, (forward, leaves) in implementations.items():
                    timings, *rest = _profiled(forward, leaves, rows,
                                                  host_path and implementation.startswith(("triton", "cuda")))
                    emit(f"\n=== {name} {implementation}: {timings}", *rest)


if __name__ == "__main__":
    main()
