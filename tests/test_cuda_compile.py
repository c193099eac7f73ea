"""The CUDA extension's sources compile on this CPU machine (no GPU needed).

* Every kernel source (``csrc/build_config.py``'s ``KERNEL_SOURCES``) compiles with nvcc for sm_80
  and sm_90a in its representative instantiation (float16 only, ``TK_COMPILE_CHECK_ONE_DTYPE``, and
  the bfloat16-only sources skipped), or with both dtypes when ``TRANSFORMER_KERNELS_NVCC_ALL_DTYPES=1``
  (``benchmarks/gpu_check.sh``); so do the sources without kernels (``HOST_SOURCES``).
  ptxas ``-v`` reports each
  kernel's registers, spills and shared memory: a spill or a stack frame fails the test, and the
  report is kept under ``build/ptxas/``.  The PTX of the same compilation shows what the GEMM
  kernels are made of: mma.sync m16n8k16, ldmatrix and cp.async; and their SASS that no integer
  division is left in a GEMM's main loop (``GEMM_KERNEL_SOURCES``).
* ``csrc/bindings.cpp`` compiles against torch's headers.  A CPU wheel ships ``c10/cuda`` without the
  generated ``c10/cuda/impl/cuda_cmake_macros.h``; a one-line stand-in takes its place.

Skipped without nvcc or the CUTLASS headers (``pip install nvidia-cutlass``), and when
``TRANSFORMER_KERNELS_SKIP_NVCC_TESTS=1`` (CI's second pass: these do not depend on triton).
"""

import os
import pathlib
import re
import runpy
import shutil
import subprocess
import sysconfig

import _sass
import pytest
from _helpers import cuda_include_dir

ROOT = pathlib.Path(__file__).resolve().parents[1]
BUILD_CONFIG = runpy.run_path(str(ROOT / "csrc" / "build_config.py"))
NVCC = shutil.which("nvcc")
CUTLASS_INCLUDE = BUILD_CONFIG["cutlass_include"]()
ARCHS = ("80", "90a")
REPORT_DIR = ROOT / "build" / "ptxas"
ALL_DTYPES = os.environ.get("TRANSFORMER_KERNELS_NVCC_ALL_DTYPES") == "1"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("TRANSFORMER_KERNELS_SKIP_NVCC_TESTS") == "1",
                       reason="TRANSFORMER_KERNELS_SKIP_NVCC_TESTS=1"),
    pytest.mark.skipif(NVCC is None, reason="nvcc not found"),
    pytest.mark.skipif(CUTLASS_INCLUDE is None, reason=BUILD_CONFIG["cutlass_missing_message"]()),
]

# What the PTX of each GEMM source must contain: the sm_80 tensor-core pipeline.
GEMM_INSTRUCTIONS = ("mma.sync.aligned.m16n8k16", "ldmatrix.sync.aligned", "cp.async.cg.shared.global")
GEMM_SOURCES = (
    "csrc/qkv/qkv.cu", "csrc/glu_conv/glu_conv.cu", "csrc/attention/attention_fwd_fp16.cu",
    "csrc/attention/attention_bwd_fp16.cu",
)
# The sources of gemm_sm80.cuh's GEMM kernels, whose main loops (the loops holding their HMMAs) address
# their chunks from lines made before the loop (index.h) and divide by FastDivisor: no integer
# division (I2F, MUFU.RCP and corrections, about 20 instructions) is left in them.  Before, the QKV
# GEMMs' loops held 2 to 8 a K slice, the GLU's 4.
GEMM_KERNEL_SOURCES = ("csrc/qkv/qkv.cu", "csrc/glu_conv/glu_conv.cu")
SOURCES = [source for source in BUILD_CONFIG["KERNEL_SOURCES"] if ALL_DTYPES or not source.endswith("_bf16.cu")]


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    """Per kernel (mangled name): registers, spill stores/loads, stack frame and static shared memory
    bytes, from ``ptxas -v`` output."""
    kernels: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        match = re.search(r"Function properties for (\S+)", line)
        if match:
            current = kernels.setdefault(match.group(1), {"registers": 0, "smem": 0})
            continue
        match = re.search(r"Compiling entry function '(\S+)'", line)
        if match:
            current = kernels.setdefault(match.group(1), {"registers": 0, "smem": 0})
            continue
        if current is None:
            continue
        match = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if match:
            current.update(stack=int(match.group(1)), spill_stores=int(match.group(2)),
                           spill_loads=int(match.group(3)))
        match = re.search(r"Used (\d+) registers", line)
        if match:
            current["registers"] = int(match.group(1))
            smem = re.search(r"(\d+) bytes smem", line)
            current["smem"] = int(smem.group(1)) if smem else 0
    return kernels


@pytest.mark.parametrize("arch", ARCHS, ids=[f"sm_{a}" for a in ARCHS])
@pytest.mark.parametrize("source", SOURCES + BUILD_CONFIG["HOST_SOURCES"])
def test_kernel_source_compiles_without_spills(source, arch, tmp_path):
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS  # what the extension build passes too

    host_only = source in BUILD_CONFIG["HOST_SOURCES"]
    command = [
        NVCC, "-std=c++20", *COMMON_NVCC_FLAGS, *BUILD_CONFIG["NVCC_FLAGS"], f"-I{CUTLASS_INCLUDE}",
        f"-I{ROOT / 'csrc'}", *([] if ALL_DTYPES else ["-DTK_COMPILE_CHECK_ONE_DTYPE"]),
        f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas", "-v",
        # An object file for the host sources: -cubin compiles device code alone.
        *(["-c"] if host_only else ["-cubin"]), "-keep", f"-keep-dir={tmp_path}", "-o", str(tmp_path / "out"),
        str(ROOT / source),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, f"nvcc failed:\n{result.stderr[-6000:]}"
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    (REPORT_DIR / f"{pathlib.Path(source).stem}.sm_{arch}.txt").write_text(result.stderr)
    kernels = parse_ptxas(result.stderr)
    assert kernels or host_only, f"no kernel in the ptxas report:\n{result.stderr}"
    for name, info in kernels.items():
        print(f"{source} sm_{arch} {name}: {info}")
        assert info.get("spill_stores", 0) == 0 and info.get("spill_loads", 0) == 0, f"{name} spills: {info}"
        assert info.get("stack", 0) == 0, f"{name} uses a stack frame (local memory): {info}"
    if source in GEMM_SOURCES:
        ptx = "\n".join(path.read_text() for path in tmp_path.glob("*.ptx"))
        for instruction in GEMM_INSTRUCTIONS:
            assert instruction in ptx, f"{source} sm_{arch}: no {instruction} in the PTX"
    if source in GEMM_KERNEL_SOURCES and os.path.exists(_sass.CUOBJDUMP):
        for name, function in _sass.functions(_sass.cuobjdump(str(tmp_path / "out"))).items():
            main_loops = [loop for loop in _sass.loops(function) if loop.opcodes["HMMA"]]
            assert main_loops, f"{name}: no loop holds an HMMA"
            for loop in main_loops:
                divisions = loop.opcodes["I2F"] + loop.opcodes["MUFU"]
                assert divisions == 0, f"{name} sm_{arch}: an integer division in its main loop: {loop.opcodes}"


def test_bindings_compile_against_torch_headers(tmp_path):
    from torch.utils.cpp_extension import include_paths

    stand_in = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    stand_in.parent.mkdir(parents=True)
    stand_in.write_text("#define C10_CUDA_BUILD_SHARED_LIBS\n")
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    command = [
        compiler, "-std=c++20", "-fsyntax-only", "-Wall", "-Werror", "-Wno-c++20-extensions",
        f"-I{tmp_path}", *(f"-I{path}" for path in include_paths()), f"-I{cuda_include_dir()}",
        f"-I{sysconfig.get_paths()['include']}", f"-I{ROOT / 'csrc'}",
        str(ROOT / "csrc" / "bindings.cpp"),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, f"bindings.cpp failed to compile:\n{result.stderr[-6000:]}"
