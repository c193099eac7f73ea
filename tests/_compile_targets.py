"""Compile every Triton target for sm_80 and sm_90 and print the resource usage as JSON.

Each target is the launch its kernel module's launcher builds for a
representative shape, specialized by Triton's own launch-time rules
(``compile_source``), so what compiles here is what that launch runs.

Run in its own process by ``test_triton_compile.py``: the test session runs with
``TRITON_INTERPRET=1``, under which ``@triton.jit`` functions are interpreted
and cannot be compiled.
"""

import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from transformer_kernels.backends.triton import attention, glu_conv, qkv  # noqa: E402
from transformer_kernels.backends.triton._common import compile_source  # noqa: E402

MODULES = {"attention": attention, "qkv": qkv, "glu_conv": glu_conv}
CAPABILITIES = (80, 90)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _targets(module_names):
    return {t.name: t for name in module_names for t in MODULES[name].compile_targets()}


def _resource_usage(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    line = next(line for line in text.splitlines() if "REG:" in line)
    return {key: int(value) for key, value in (item.split(":") for item in line.split() if ":" in item)}


def compile_one(module_names, name: str, capability: int) -> dict:
    source, options = compile_source(_targets(module_names)[name].launch(), capability)
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
    except Exception as error:  # reported per target by the test
        return {"error": f"{type(error).__name__}: {error}"[:2000]}
    return {"shared": compiled.metadata.shared, **_resource_usage(compiled.asm["cubin"])}


def main(module_names) -> None:
    jobs = [(name, cc) for name in _targets(module_names) for cc in CAPABILITIES]
    with concurrent.futures.ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        futures = {job: pool.submit(compile_one, module_names, *job) for job in jobs}
        results = {f"{name}@sm_{cc}": future.result() for (name, cc), future in futures.items()}
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:] or list(MODULES))
