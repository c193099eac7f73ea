"""Every Triton configuration the dispatchers can choose, compiled for sm_80
and sm_90 on this CPU machine.

Each kernel module lists its configurations in ``compile_targets()``: each is
the launch its launcher builds for a representative shape, compiled with the
specialization Triton's own launcher derives from those arguments (which
integers are 1, which are divisible by 16, which pointers are aligned; see
``backends/triton/_common.py``).  Each must compile, fit in shared memory and
not spill registers.  Attention kernels specialize on no argument value, so
their check covers every launch; QKV and GLU launches of other shapes (odd
sizes, other strides) compile other variants, which are not checked.

The compiling happens in a subprocess (``_compile_targets.py``) because this
session runs with the Triton interpreter switched on.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("triton")

import transformer_kernels  # noqa: E402
from transformer_kernels.backends.triton import attention, glu_conv, qkv  # noqa: E402

MODULES = {"attention": attention, "qkv": qkv, "glu_conv": glu_conv}
# Opt-in shared memory per block: sm_80 (A100) 163 KiB, sm_90 (H100) 227 KiB.
SHARED_MEMORY_LIMIT = {80: 166912, 90: 232448}
CASES = [
    (module_name, target.name, capability)
    for module_name, module in MODULES.items()
    for target in module.compile_targets()
    for capability in SHARED_MEMORY_LIMIT
]


@pytest.fixture(scope="module")
def compiled() -> dict:
    script = pathlib.Path(__file__).with_name("_compile_targets.py")
    # A script's path starts at its own folder, not the working directory: put
    # the package this session imported first, or a checkout run from its root
    # would compile the installed copy's kernels instead of its own.
    package_root = str(pathlib.Path(transformer_kernels.__file__).resolve().parents[1])
    python_path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": python_path}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=1500)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout)


def test_every_module_lists_targets():
    for name, module in MODULES.items():
        assert module.compile_targets(), f"backends/triton/{name}.py: compile_targets() is empty"


@pytest.mark.slow
@pytest.mark.parametrize("module_name, name, capability", CASES, ids=[f"{n}@sm_{c}" for _, n, c in CASES])
def test_compiles_fits_and_does_not_spill(compiled, module_name, name, capability):
    usage = compiled[f"{name}@sm_{capability}"]
    assert "error" not in usage, usage.get("error")
    assert usage["shared"] <= SHARED_MEMORY_LIMIT[capability], f"{usage['shared']} bytes of shared memory"
    # ptxas spills land in the stack frame (STACK) and local memory (LOCAL).
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, f"register spills: {usage}"
