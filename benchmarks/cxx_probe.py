"""Does an extension built by a given C++ compiler raise its errors, or kill the process?

On the H100 (2026-11-26) every refusal of the CUDA extension's raw ops killed the process with a
segmentation fault instead of raising a RuntimeError.  The extension's host code had been built by
``$CXX`` (``/opt/gcc/bin/g++`` there); the same sources built by Debian's g++ 12 against the same
torch (2.11.0+cu130) raise as they should.  This builds the smallest extension that refuses its
input the way the raw ops do (``TORCH_CHECK`` with a message formatted from an integer, a shape and
a dtype) once per compiler, and calls it in a child process, so that a crash is reported, not
suffered:

    python benchmarks/cxx_probe.py [--pick] [COMPILER ...]   # default: $CXX, c++ and g++, those that exist

Each line: the compiler, its version, and ``raised: <message>`` or ``died: signal N``.  With
``--pick`` those lines go to stderr, and stdout gets the first compiler whose extension raised
(nothing, and exit status 1, if none did): benchmarks/gpu_check.sh builds the extension with it.
The H200 of 2026-11-27 confirmed the cause: there the probe built by ``/opt/gcc/bin/g++`` (13.3.0,
the ``$CXX`` set) died of signal 11, the one built by ``/usr/bin/g++`` (the same version,
Ubuntu's package) raised.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import sys
import tempfile

SOURCE = r"""
#include <ATen/ATen.h>
#include <torch/library.h>

at::Tensor refuse(const at::Tensor& x, int64_t n) {
  TORCH_CHECK(x.dim() == 99, "refuse: x must be 99-d, got n = ", n, ", shape ", x.sizes(), ", dtype ",
              x.scalar_type());
  return x;
}

TORCH_LIBRARY(NAME, m) { m.def("refuse(Tensor x, int n) -> Tensor"); }
TORCH_LIBRARY_IMPL(NAME, CPU, m) { m.impl("refuse", &refuse); }
"""

CALL = """
import sys, torch
torch.ops.load_library(sys.argv[1])
try:
    getattr(torch.ops, sys.argv[2]).refuse(torch.zeros(2, 3), 4)
except RuntimeError as error:
    print("raised:", str(error).splitlines()[0])
"""


def probe(compiler: str, index: int, directory: str) -> str:
    name = f"cxx_probe_{index}"
    build = os.path.join(directory, name)
    os.makedirs(build)
    environment = dict(os.environ, CXX=compiler)
    try:
        # In a child: load_inline reads CXX from the environment, and a build failure stays a line.
        subprocess.run(
            [sys.executable, "-c",
             f"from torch.utils.cpp_extension import load_inline; load_inline({name!r}, "
             f"cpp_sources=[{SOURCE.replace('NAME', name)!r}], is_python_module=False, "
             f"build_directory={build!r}, extra_cflags=['-O3'])"],
            env=environment, check=True, capture_output=True, text=True, timeout=240,
        )
    except subprocess.CalledProcessError as error:
        return "build failed: " + (error.stderr.strip().splitlines() or ["?"])[-1]
    library = os.path.join(build, f"{name}.so")
    result = subprocess.run([sys.executable, "-c", CALL, library, name], capture_output=True, text=True)
    if result.returncode < 0:
        return f"died: signal {-result.returncode}"
    return result.stdout.strip() or f"exit {result.returncode}: {result.stderr.strip()[-300:]}"


def main() -> None:
    arguments = sys.argv[1:]
    pick = "--pick" in arguments
    candidates = [a for a in arguments if a != "--pick"] or [os.environ.get("CXX", ""), "c++", "g++"]
    compilers = []
    for candidate in candidates:
        path = shutil.which(candidate) if candidate else None
        if path and os.path.realpath(path) not in {os.path.realpath(c) for c in compilers}:
            compilers.append(path)
    with tempfile.TemporaryDirectory() as directory, concurrent.futures.ThreadPoolExecutor() as pool:
        # The builds side by side: each is one compiler process, and gpu_check gives the step 2 minutes.
        results = [pool.submit(probe, compiler, index, directory) for index, compiler in enumerate(compilers)]
        raising = []
        for compiler, result in zip(compilers, results):
            version = (subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.splitlines()
                       or ["version unknown"])[0]
            print(f"{compiler} ({version}): {result.result()}", file=sys.stderr if pick else sys.stdout, flush=True)
            if result.result().startswith("raised:"):
                raising.append(compiler)
    if pick:
        if not raising:
            sys.exit(1)
        print(raising[0])


if __name__ == "__main__":
    main()
