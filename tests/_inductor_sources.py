"""Rebuild every Triton kernel from the source Inductor writes for it, compile it for sm_90, and
print, as JSON, per kernel: whether it compiled, and whether its Triton IR is the original's.

Under torch.compile a triton-backend op decomposes into its launches (``ops/_library.py``), and
Inductor compiles each kernel from source it generates into its own module: the kernel's source
and the transitive closure of what it calls (JIT helpers, global constants, triton imports), from
``user_defined_triton_kernel_transitive_closure_source_code``.  A helper or constant that closure
misses fails only there, on a GPU, at a user's first compiled call; here it fails without one.
Each kernel is rebuilt for the compile target that turns on the most of its switches, and compiled
with the argument types Inductor gives it (a Python float is float64 there: on 2026-11-27 the
attention forward, compiled so, failed its first compiled call on an H200).

Run in its own process by ``test_triton_tracing.py``: only compiled kernels can be compiled (the
test session interprets them, ``TRITON_INTERPRET=1``).
"""

import importlib.util
import json
import os
import re
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
from _compile_targets import MODULES  # noqa: E402
from torch._inductor.codegen.triton import TritonKernel  # noqa: E402
from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from transformer_kernels.backends.triton._common import compile_source  # noqa: E402

CAPABILITY = 90


def _switches_on(launch) -> int:
    return sum(value is True for value in launch.kwargs.values())


def _richest_launches() -> dict:
    """Per kernel name, the launch of the compile target with the most switches on."""
    chosen = {}
    for module in MODULES.values():
        for target in module.compile_targets():
            if CAPABILITY not in target.capabilities:
                continue
            launch = target.launch()
            name = launch.kernel.__name__
            if name not in chosen or _switches_on(launch) > _switches_on(chosen[name]):
                chosen[name] = launch
    return chosen


def _as_inductor_writes_it(kernel, folder: str):
    """``kernel`` rebuilt from the module Inductor generates for it."""
    source = "\n".join([TritonKernel.gen_common_triton_imports(), "@triton.jit",
                        user_defined_triton_kernel_transitive_closure_source_code(kernel)])
    path = os.path.join(folder, f"inductor_{kernel.__name__}.py")
    with open(path, "w") as file:
        file.write(source)
    spec = importlib.util.spec_from_file_location(f"inductor_{kernel.__name__}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return getattr(module, kernel.__name__)


# The argument types Inductor gives a user kernel (``signature_of`` in
# torch/_inductor/codegen/triton_utils.py), where Triton's launcher gives others: a Python float is
# fp64, a bool tensor *i1, and an integer i32 whatever its annotation (i64 only for values that
# need it, which no representative shape has).
_INDUCTOR_TYPES = {"fp32": "fp64", "*u1": "*i1", "i64": "i32"}


def _compiled(launch, as_inductor_types: bool = False):
    """The launch compiled for sm_90; with ``as_inductor_types``, with the argument types and the
    ``debug`` option (device assertions on) Inductor compiles it with."""
    source, options = compile_source(launch, CAPABILITY)
    if as_inductor_types:
        source.signature = {name: _INDUCTOR_TYPES.get(kind, kind) for name, kind in source.signature.items()}
        options = dict(options, debug=True)
    return triton.compile(source, target=GPUTarget("cuda", CAPABILITY, 32), options=options)


def _ttir(launch) -> str:
    """The launch's Triton IR, without source locations and alignment facts: a kernel rebuilt from
    source has a plain ``@triton.jit``, so Inductor specializes the attention kernels on their
    arguments' 16-byte alignment, which their launchers exempt them from (``attention._kernel``);
    either is right for the arguments it was compiled for."""
    ttir = _compiled(launch).asm["ttir"]
    return re.sub(r"\s*loc\([^)]*\)|#loc.*| \{tt\.divisibility = 16 : i32\}", "", ttir)


def main() -> None:
    facts = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, launch in sorted(_richest_launches().items()):
            try:
                rebuilt = launch._replace(kernel=_as_inductor_writes_it(launch.kernel, folder))
                _compiled(rebuilt, as_inductor_types=True)
                ttir = _ttir(rebuilt)
            except Exception as error:  # reported, not raised: the test lists every kernel that fails
                facts[name] = {"compiles": False, "error": f"{type(error).__name__}: {error}"[:2000]}
                continue
            facts[name] = {"compiles": True, "same_ir": ttir == _ttir(launch)}
    print(json.dumps(facts))


if __name__ == "__main__":
    main()
