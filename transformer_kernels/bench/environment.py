"""What a results file records about the machine and the code: device, versions, commit, date,
threads, and the device's peak compute and memory bandwidth."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Optional

import torch

# Dense bf16 tensor-core TFLOP/s and HBM GB/s of known GPUs (datasheets, without sparsity),
# matched against torch.cuda.get_device_name() in this order.
KNOWN_PEAKS = (
    ("H200", 989.0, 4800.0),
    ("H100 PCIe", 756.0, 2000.0),
    ("H100 NVL", 835.0, 3900.0),
    ("H100", 989.0, 3350.0),
    ("A100-SXM4-80GB", 312.0, 2039.0),
    ("A100-PCIE-80GB", 312.0, 1935.0),
    ("A100", 312.0, 1555.0),
    ("L40S", 362.0, 864.0),
    ("L4", 121.0, 300.0),
    ("A10", 125.0, 600.0),
    ("RTX 4090", 165.0, 1008.0),
)
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:  # Linux names the CPU model; platform only its architecture
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _git(*args: str) -> Optional[str]:
    try:
        result = subprocess.run(["git", *args], cwd=PACKAGE_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def git_state() -> dict:
    """The commit of the package's checkout and whether its tree had changes (None outside git)."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def measured_peaks(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(TFLOP/s of a large matmul in ``dtype``, GB/s of a large copy) on a GPU, each the best of a few runs."""
    size = 8192
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    source = torch.empty(2**30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)

    def best_seconds(fn, repeats: int = 5) -> float:
        fn()
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        return best

    tflops = 2 * size**3 / best_seconds(lambda: torch.matmul(a, b)) / 1e12
    gbps = 2 * source.numel() / best_seconds(lambda: target.copy_(source)) / 1e9  # read + write
    return tflops, gbps


def peaks(device: torch.device, dtype: torch.dtype) -> Optional[dict]:
    """A GPU's peak: from :data:`KNOWN_PEAKS` for a known one (bf16 tensor cores), else measured.
    None on CPUs: a shared CPU's measured peak moves with the load more than the kernels do."""
    if device.type != "cuda":
        return None
    name = device_name(device)
    for known, tflops, gbps in KNOWN_PEAKS:
        if known in name:
            return {"tflops": tflops, "gbps": gbps, "source": f"datasheet ({known}, dense bf16)"}
    tflops, gbps = measured_peaks(device, dtype)
    return {"tflops": tflops, "gbps": gbps, "source": f"measured (matmul and copy, {str(dtype).removeprefix('torch.')})"}


def environment(device: torch.device, dtype: torch.dtype, size: str) -> dict:
    env = {
        "device": device_name(device),
        "device_type": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "size": size,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        # Other processes on the machine skew every timing; the report keeps how busy it was.
        "load_average_1min_at_start": os.getloadavg()[0],
        **git_state(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    env["peak"] = peaks(device, dtype)
    if device.type == "cpu":
        from ..backends.eager import onednn

        # Which kernels torch's CPU engines run here decides the eager backend's choices
        # (backends/eager/onednn.py): reports of different CPUs compare only with these in view.
        env["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        env["onednn_gemm_speedup"] = onednn.speedup()
    return env
