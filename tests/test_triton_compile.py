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

The same compilation shows what each target's ``tl.dot``s lower to and how
its main loop loads their operands (read from the TTGIR, see
``_compile_targets.instruction_selection``): on sm_90 every dot should be a
wgmma, on sm_80 an mma.sync, and every operand a loop loads should be
pipelined (async copies issued at least one iteration ahead).  What falls
short is listed in ``FALLBACKS`` with its reason, and each listed fallback
must still happen.

The compiling happens in a subprocess (``_compile_targets.py``) because this
session runs with the Triton interpreter switched on.
"""

import fnmatch

import pytest
from _helpers import json_of_compiled_script

triton = pytest.importorskip("triton")

from transformer_kernels.backends.triton import _split_sum, attention, glu_conv, qkv  # noqa: E402

MODULES = {"attention": attention, "qkv": qkv, "glu_conv": glu_conv, "split_sum": _split_sum}
# Opt-in shared memory per block: sm_80 (A100) 163 KiB, sm_90 (H100) 227 KiB.
SHARED_MEMORY_LIMIT = {80: 166912, 90: 232448}
CASES = [
    (module_name, target.name, capability)
    for module_name, module in MODULES.items()
    for target in module.compile_targets()
    for capability in target.capabilities
]
CASE_IDS = [f"{name}@sm_{capability}" for _, name, capability in CASES]
# The tensor-core instruction a dot should lower to on each architecture.
EXPECTED_MMA = {80: "mma.sync", 90: "wgmma"}

# Targets (fnmatch patterns over "<target>@sm_<capability>") that fall short
# of EXPECTED_MMA or of pipelining, each with its reason.  The fallback is what
# the dots lower to instead ("mma.sync", "fma", or "none": no dot), or
# "sync:<operand>": a dot operand (its variable in the kernel) that the loop
# loads synchronously, "sync:*" all of them, or "restage:<operand>" (or "*"): a
# wgmma operand whose copied tile the loop takes into registers and stores
# back to shared memory before the dot.  Each must still happen: a target
# that does better than its fallback fails, as does a fallback no target needs.
#
# Triton picks wgmma only when a dot's M (its result's rows) is a multiple of
# 64 and num_warps a multiple of 4, else mma.sync.  M is the query block
# (BLOCK_M) in the attention forward and dQ kernels, the key block (BLOCK_N)
# in dK/dV.
FALLBACKS = {
    ("attention_forward_fp32_*@sm_90", "mma.sync"): "BLOCK_M 32",
    ("attention_grad_key_value_bf16_d256_*@sm_90", "mma.sync"): "BLOCK_N 16",
    ("attention_grad_key_value_fp32_*@sm_90", "mma.sync"): "BLOCK_N 16",
    ("attention_grad_query_fp16_d256_*@sm_90", "mma.sync"): "BLOCK_M 16 (MASKED tile)",
    ("attention_grad_query_fp32_*@sm_90", "mma.sync"): "BLOCK_M 16",
    # tf32x3 dots (float32 attention) are three TF32 tensor-core products, held
    # to the same instructions as 16-bit ones; "ieee" ones never use tensor cores.
    ("glu_conv_*-fp32-ieee*@sm_*", "fma"): 'input_precision "ieee": exact float32 products, on FMA by design',
    ("attention_delta_*@sm_*", "none"): "row sums of dO * O, no dot",
    ("attention_key_bounds@sm_*", "none"): "a scan of the padding mask, no dot",
    ("split_sum-*@sm_*", "none"): "a sum of float32 partial sums, no dot",
    ("glu_step*@sm_*", "none"): "a decoding step's batched GEMV on FMAs: a few rows, too short for a dot's tile",
    ("glu_conv_*16-tf32@sm_*", "sync:x_tile"): (
        "the tap shifts x's tile by an unknown offset, so 16-bit x loads 2 bytes at a time, "
        "under cp.async's 4-byte minimum (float32 x is pipelined)"
    ),
    ("glu_conv_*16-tf32-ragged@sm_*", "sync:x_tile"): "as channel-first x of whole rows",
    ("attention_forward_fp16_d256_all_masks*@sm_80", "sync:*"): "num_stages 1 in its config",
    ("attention_grad_key_value_*_d256_*@sm_*", "sync:*"): "num_stages 1 in its config",
    ("attention_grad_query_*_d256_*@sm_80", "sync:*"): "num_stages 1 in its config",
    ("attention_grad_query_fp16_d256_*@sm_90", "sync:*"): "num_stages 1 in its config (MASKED tile)",
    ("attention_*_fp32_*@sm_*", "sync:*"): "num_stages 1 in its config",
    # The kernel loads Q (dK/dV) or K (dQ) transposed and also feeds it,
    # transposed back, to a second dot through registers (convert_layout,
    # tt.trans); with mma.sync dots that keeps the load synchronous.
    ("attention_grad_key_value_*@sm_80", "sync:q_t"): "q_t also feeds dK transposed, from registers",
    ("attention_grad_query_*@sm_80", "sync:k_t"): "k_t also feeds dQ transposed, from registers",
    ("attention_grad_query_fp16_d256_*@sm_90", "sync:k_t"): "as on sm_80: mma.sync (MASKED tile)",
}
FALLBACKS.update({
    ("glu_conv_*-pad1-*16-tf32-channel_last*@sm_90", "restage:x_tile"): (
        "a padding value other than +0.0 is selected into the tile in registers (PAD_BY_FILL off)"
    ),
    ("glu_conv_*-fp32-tf32x3*@sm_90", "restage:*"): "tf32x3 splits each operand into two TF32 parts in registers",
    ("attention_grad_key_value_fp16_d256_*@sm_90", "mma.sync"): "BLOCK_N 16 (MASKED tile)",
    ("attention_grad_key_value_fp16_d256_*@sm_90", "sync:q_t"): "as on sm_80: mma.sync (MASKED tile)",
})


def fallbacks(case_id: str) -> dict:
    """The FALLBACKS entries for ``case_id``: fallback -> reason."""
    return {
        fallback: reason for (pattern, fallback), reason in FALLBACKS.items() if fnmatch.fnmatchcase(case_id, pattern)
    }


@pytest.fixture(scope="module")
def compiled() -> dict:
    return json_of_compiled_script("_compile_targets.py", timeout=1500)


def test_every_module_lists_targets():
    for name, module in MODULES.items():
        assert module.compile_targets(), f"backends/triton/{name}.py: compile_targets() is empty"


@pytest.mark.slow
@pytest.mark.parametrize("module_name, name, capability", CASES, ids=CASE_IDS)
def test_compiles_fits_and_does_not_spill(compiled, module_name, name, capability):
    usage = compiled[f"{name}@sm_{capability}"]
    assert "error" not in usage, usage.get("error")
    assert usage["shared"] <= SHARED_MEMORY_LIMIT[capability], f"{usage['shared']} bytes of shared memory"
    # ptxas spills land in the stack frame (STACK) and local memory (LOCAL).
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, f"register spills: {usage}"


@pytest.mark.slow
@pytest.mark.parametrize("module_name, name, capability", CASES, ids=CASE_IDS)
def test_dots_lower_to_the_architectures_mma(compiled, module_name, name, capability):
    case_id = f"{name}@sm_{capability}"
    facts = compiled[case_id]
    assert "error" not in facts, facts.get("error")
    instead = {fallback for fallback in fallbacks(case_id) if not fallback.startswith(("sync:", "restage:"))}
    assert len(instead) <= 1, f"FALLBACKS disagree: {instead}"
    expected = instead.pop() if instead else EXPECTED_MMA[capability]
    assert facts["dots"] == ([] if expected == "none" else [expected]), (
        f"dots lower to {facts['dots']}, FALLBACKS say {fallbacks(case_id) or 'none apply'}"
    )
    # The PTX must hold the tensor-core instructions the TTGIR was read as.
    assert facts["ptx_mma"] == [dot for dot in facts["dots"] if dot != "fma"], f"PTX holds {facts['ptx_mma']}"


@pytest.mark.slow
@pytest.mark.parametrize("module_name, name, capability", CASES, ids=CASE_IDS)
def test_main_loop_operands_are_pipelined(compiled, module_name, name, capability):
    case_id = f"{name}@sm_{capability}"
    facts = compiled[case_id]
    assert "error" not in facts, facts.get("error")
    stages = facts["operand_stages"]
    # Every dot here sits in a loop that loads an operand; finding none means
    # the TTGIR reading no longer matches what Triton writes.
    assert stages or not facts["dots"], "no main-loop dot operand found in the TTGIR"
    excused = {fallback.removeprefix("sync:") for fallback in fallbacks(case_id) if fallback.startswith("sync:")}
    expected = set(stages) if "*" in excused else excused & set(stages)
    synchronous = {operand for operand, count in stages.items() if count < 2}
    assert synchronous == expected, (
        f"loaded synchronously: {sorted(synchronous)}, FALLBACKS say {sorted(expected)} "
        f"(stages per operand {stages}, num_stages {facts['num_stages']})"
    )


@pytest.mark.slow
@pytest.mark.parametrize("module_name, name, capability", CASES, ids=CASE_IDS)
def test_wgmma_operands_stay_in_shared_memory(compiled, module_name, name, capability):
    """A main-loop wgmma reads its copied operands where the copies put them: a tile taken into
    registers and stored back (a select on it, a conversion) costs loads, stores and a barrier
    per step, and its single buffer makes the next step wait for the dot (the H200 timed the GLU
    weight gradient at 2.9x its input gradient so)."""
    case_id = f"{name}@sm_{capability}"
    facts = compiled[case_id]
    assert "error" not in facts, facts.get("error")
    excused = {fallback.removeprefix("restage:") for fallback in fallbacks(case_id) if fallback.startswith("restage:")}
    restaged = set(facts["restaged"])
    expected = restaged if "*" in excused else excused & restaged
    assert restaged == expected, f"restaged through registers: {sorted(restaged)}, FALLBACKS say {sorted(excused)}"


@pytest.mark.slow
def test_every_fallback_is_needed(compiled):
    """A FALLBACKS entry whose pattern matches no target, or whose operand no
    matching target loads in its loop, is stale."""

    def applies(fallback: str, facts: dict) -> bool:
        kind, _, operand = fallback.partition(":")
        if not operand:
            return True
        found = facts["operand_stages"] if kind == "sync" else facts["restaged"]
        return bool(found) if operand == "*" else operand in found

    stale = [
        f"{pattern} {fallback}: {reason}"
        for (pattern, fallback), reason in FALLBACKS.items()
        if not any(
            fnmatch.fnmatchcase(case_id, pattern) and applies(fallback, facts) for case_id, facts in compiled.items()
        )
    ]
    assert not stale, stale
