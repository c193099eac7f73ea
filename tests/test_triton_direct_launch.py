"""Launches that skip Triton's per-call argument binding (``DirectLaunch`` in
``backends/triton/_common.py``).

A template's later launches hand its compiled kernel the arguments themselves.
Under the installed Triton (``_direct_launches.py``, in a process that compiles
rather than interprets), for every compile target: the launch goes that way;
its arguments are exactly what Triton's binder gives; and the key it files the
compiled kernel under changes wherever Triton's specialization does when a
tensor's address loses its 16-byte alignment (attention's never does).
Here, with a stand-in kernel and compiled kernel: which launches go through
Triton (the first of each device and dtypes) and which run directly.
"""

import pytest
import torch
from _helpers import json_of_compiled_script

triton = pytest.importorskip("triton")

from triton.compiler import CompiledKernel  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from transformer_kernels.backends.triton import _common  # noqa: E402


@pytest.fixture(scope="module")
def direct_facts() -> dict:
    return json_of_compiled_script("_direct_launches.py", timeout=600)


def test_every_launch_runs_directly(direct_facts):
    assert direct_facts
    assert [case for case, facts in direct_facts.items() if not facts["direct"]] == []


def test_direct_launches_are_what_triton_would_launch(direct_facts):
    assert [case for case, facts in direct_facts.items() if not facts["arguments_match"]] == []
    assert [case for case, facts in direct_facts.items() if not facts["key_determines_variant"]] == []


def test_attention_launches_depend_on_no_address(direct_facts):
    attention = {case: facts for case, facts in direct_facts.items() if case.startswith("attention/")}
    assert attention
    assert [case for case, facts in attention.items() if facts["key_holds_addresses"]] == []


def _scale(x_ptr, out_ptr, n, seed_ptr, factor, BLOCK: "tl.constexpr", EXTRA: "tl.constexpr" = 3):  # noqa: F821
    pass  # a stand-in: only its signature is bound


class _Compiled:
    """Stands in for a compiled kernel under Triton's own ``compiled[grid](*arguments, stream=...)``
    (``CompiledKernel.__getitem__``), recording what reaches its launcher instead of launching."""

    __getitem__ = CompiledKernel.__getitem__
    function, packed_metadata = "function", "packed metadata"

    def __init__(self, launches: list):
        self.launches = launches

    def _init_handles(self):
        pass

    def launch_metadata(self, grid, stream, *arguments):
        return None

    def run(self, grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook,
            *arguments):
        assert (function, packed_metadata) == (self.function, self.packed_metadata)
        self.launches.append(("direct", (grid_x, grid_y, grid_z), arguments, stream))


def _stand_in_kernel(exempt: bool, launches: list) -> JITFunction:
    """``_scale`` as a JIT kernel whose Triton launch (``kernel[grid](...)``) records itself and returns
    a stand-in compiled kernel; ``exempt``: its tensors are exempt from alignment specialization."""
    tensors = ["x_ptr", "out_ptr", "seed_ptr"] if exempt else []
    kernel = JITFunction(_scale, do_not_specialize_on_alignment=tensors)

    def run(*args, grid, warmup, **kwargs):
        launches.append(("triton", grid, args, kwargs))
        return _Compiled(launches)

    kernel.run = run
    return kernel


def _launch(templates, kernel, x, out, seed, n=10):
    def build():
        return [_common.KernelLaunch(kernel, (4,), (x, out, n), dict(factor=0.5, BLOCK=16, num_warps=4, seed_ptr=seed))]

    (launch,) = templates.launches(("scale", n), (x, out), build, seed_ptr=seed)
    launch()


@pytest.fixture
def device_and_stream(monkeypatch):
    monkeypatch.setattr(_common, "current_device_and_stream", lambda: (0, 7))


def test_a_template_launches_through_triton_once_per_dtypes(device_and_stream):
    launches = []
    kernel, templates = _stand_in_kernel(True, launches), _common.LaunchTemplates()
    x, out, seed = torch.zeros(10), torch.zeros(10), torch.zeros(2, dtype=torch.int64)
    _launch(templates, kernel, x, out, seed)
    assert [way for way, *_ in launches] == ["triton"]
    assert launches[0][2] == (x, out, 10) and launches[0][3]["seed_ptr"] is seed

    x2, out2, seed2 = torch.ones(10), torch.ones(10), torch.ones(2, dtype=torch.int64)
    _launch(templates, kernel, x2, out2, seed2)
    way, grid, arguments, stream = launches[1]
    assert (way, grid, stream) == ("direct", (4, 1, 1), 7)
    # Every parameter in signature order, constexprs and defaults included, as Triton's binder gives them.
    assert len(arguments) == 7
    assert arguments[0] is x2 and arguments[1] is out2 and arguments[3] is seed2
    assert (arguments[2], *arguments[4:]) == (10, 0.5, 16, 3)

    # Another dtype compiles another variant: through Triton again, then directly.
    x3, out3 = torch.zeros(10, dtype=torch.float64), torch.zeros(10, dtype=torch.float64)
    _launch(templates, kernel, x3, out3, seed2)
    _launch(templates, kernel, x3, out3, seed2)
    assert [way for way, *_ in launches] == ["triton", "direct", "triton", "direct"]


def test_alignment_keys_the_compiled_kernel_of_a_kernel_that_specializes_on_it(device_and_stream):
    launches = []
    kernel, templates = _stand_in_kernel(False, launches), _common.LaunchTemplates()
    buffer, seed = torch.zeros(64), torch.zeros(2, dtype=torch.int64)
    aligned, misaligned = buffer[:10], buffer[1:11]  # 0 and 4 bytes past a 16-byte boundary
    assert aligned.data_ptr() % 16 == 0
    for x in (aligned, buffer[4:14], misaligned, misaligned):
        _launch(templates, kernel, x, torch.zeros(10), seed)
    assert [way for way, *_ in launches] == ["triton", "direct", "triton", "direct"]


def test_an_interpreted_kernel_launches_through_triton():
    launch = _common.KernelLaunch(lambda *args: None, (1,), (torch.zeros(1), 3), {})
    assert _common.DirectLaunch.of(launch, 1, ()) is None
