"""Every Triton configuration the dispatchers can choose, compiled for sm_80
and sm_90 on this CPU machine: it must compile, fit in shared memory and use
no local memory (no register spills).

Each kernel module lists its configurations in ``compile_targets()``.
"""

import os
import subprocess
import tempfile

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from transformer_kernels.backends.triton import attention, glu_conv, qkv  # noqa: E402

# Opt-in shared memory per block: sm_80 (A100) 163 KiB, sm_90 (H100) 227 KiB.
SHARED_MEMORY_LIMIT = {80: 166912, 90: 232448}
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")

TARGETS = [t for module in (attention, qkv, glu_conv) for t in module.compile_targets()]


def _resource_usage(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    line = next(line for line in text.splitlines() if "REG:" in line)
    return {key: int(value) for key, value in (item.split(":") for item in line.split() if ":" in item)}


def test_every_module_lists_targets():
    for module in (attention, qkv, glu_conv):
        assert module.compile_targets(), f"{module.__name__}.compile_targets() is empty"


@pytest.mark.slow
@pytest.mark.parametrize("capability", sorted(SHARED_MEMORY_LIMIT))
@pytest.mark.parametrize("target", TARGETS, ids=[t.name for t in TARGETS])
def test_compiles_fits_and_does_not_spill(target, capability):
    source = ASTSource(fn=target.kernel, signature=target.signature, constexprs=target.constexprs)
    compiled = triton.compile(
        source,
        target=GPUTarget("cuda", capability, 32),
        options={"num_warps": target.num_warps, "num_stages": target.num_stages},
    )
    assert compiled.metadata.shared <= SHARED_MEMORY_LIMIT[capability], (
        f"{target.name}: {compiled.metadata.shared} bytes of shared memory on sm_{capability}"
    )
    usage = _resource_usage(compiled.asm["cubin"])
    assert usage["LOCAL"] == 0, f"{target.name}: spills to local memory on sm_{capability}: {usage}"
    assert usage["REG"] <= 255
