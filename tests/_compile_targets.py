"""Compile every Triton target for sm_80 and sm_90 and print, as JSON, its
resource usage and its instruction selection.

Each target is the launch its kernel module's launcher builds for a
representative shape, specialized by Triton's own launch-time rules
(``compile_source``), so what compiles here is what that launch runs.

Run in its own process by ``test_triton_compile.py``: the test session runs with
``TRITON_INTERPRET=1``, under which ``@triton.jit`` functions are interpreted
and cannot be compiled.

By hand, ``python tests/_compile_targets.py --loops [--save FILE] [--compare FILE]
[MODULE ...]`` prints each target's registers, stack, shared memory and the
instruction count of each loop of its SASS, the cost per iteration that a
kernel change moves without a GPU to time it (``--save`` writes them as JSON,
``--compare`` prints only the targets whose facts differ from a saved run).
"""

import argparse
import collections
import concurrent.futures
import itertools
import json
import os
import re
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

import _sass  # noqa: E402
from transformer_kernels.backends.triton import _split_sum, attention, glu_conv, qkv  # noqa: E402
from transformer_kernels.backends.triton._common import compile_source  # noqa: E402

MODULES = {"attention": attention, "qkv": qkv, "glu_conv": glu_conv, "split_sum": _split_sum}


def _targets(module_names):
    """``"<name>@sm_<capability>"`` -> (target, capability), for every architecture each target is for."""
    return {
        f"{t.name}@sm_{capability}": (t, capability)
        for name in module_names for t in MODULES[name].compile_targets() for capability in t.capabilities
    }


def _cuobjdump(cubin: bytes, option: str) -> str:
    """What ``cuobjdump option`` prints for ``cubin``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return _sass.cuobjdump(f.name, option)


def _resource_usage(cubin: bytes) -> dict:
    text = _cuobjdump(cubin, "--dump-resource-usage")
    line = next(line for line in text.splitlines() if "REG:" in line)
    return {key: int(value) for key, value in (item.split(":") for item in line.split() if ":" in item)}


# Instruction selection, read from the TTGIR: the IR after Triton's MMA
# selection and software pipelining.  The ops read here are spelled the same
# under triton 3.6 and 3.9; where the two lay out the same code differently
# (3.9 splits an Ampere dot along K and carries each next K slice of its
# operands across iterations) values are followed, not shapes of code matched.

# String literals (inline PTX holds braces) and source locations (one level of
# nested parentheses: loc("q_ptr"(#loc))) are blanked out before parsing; an
# op's location is kept first, to name what it loads (see _Ttgir.source_name).
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_LOCATION = re.compile(r"\bloc\((?:[^()]|\([^()]*\))*\)")
_OP_LOCATION = re.compile(r"\bloc\(((?:[^()]|\([^()]*\))*)\)\s*$")
# The module's location aliases, `#loc12 = loc(...)`, and the two kinds that
# name values: a variable's name (`"k_t"(#loc7)`) and an inlined call
# (`callsite(#loc3 at #loc9)`: the callee's location, then the call's).
_LOCATION_ALIAS = re.compile(r"^(#loc\d*) = loc\((.*)\)\s*$")
_NAME_LOCATION = re.compile(r'^"([^"]*)"\(')
_CALLSITE_LOCATION = re.compile(r"^callsite\((#loc\d*) at (#loc\d*)\)$")
# Variables of the kernels' jit helpers that load tiles for their callers: a
# load there is named after the variable its call assigns, one call out.
_HELPER_RESULTS = {"tile"}  # attention_kernels._load_tile
_VALUE = re.compile(r"%[\w$.-]+(?:#\d+)?")
# An op's attribute dictionary, which may hold ` : ` (`{num = 2 : i32}`) before
# its operands end.
_ATTRIBUTES = re.compile(r"\{[^{}]*\}")
# `%a = op`, `%a, %b = op`, or `%a:3 = op` (three results, used as %a#0 ...).
_DEFINITION = re.compile(r"^\s*(%[\w$.-]+(?::\d+)?(?:\s*,\s*%[\w$.-]+)*)\s*=\s*\"?([\w.]+)")
_MMA_LAYOUT = re.compile(r"^(#\w+) = #ttg\.nvidia_mma<\{versionMajor = (\d+)")
_DOT_RESULT_LAYOUT = re.compile(r"-> tensor<[^,]*, (#\w+)")
_ITER_ARGS = re.compile(r"iter_args\((.*?)\)\s*->")
# A dot (tt.dot, or ttng.warp_group_dot once lowered for Hopper) whose result
# has an nvidia_mma layout of version 3 is a wgmma, of version 2 Ampere's
# mma.sync; in any other layout (blocked) it has no tensor core: FMA.
_MMA_INSTRUCTIONS = {3: "wgmma", 2: "mma.sync"}
_PTX_MMA = {"wgmma": "wgmma.mma_async", "mma.sync": "mma.sync.aligned"}
# Ops whose result is the data of their first operand, moved, transposed,
# reshaped or converted: a dot operand is followed through them to its load.
# (tt.elementwise_inline_asm: the tf32x3 split rounds operands with it.)
_SAME_DATA_OPS = {
    "ttg.convert_layout", "ttg.local_alloc", "ttg.local_load", "ttg.memdesc_trans", "ttg.memdesc_subslice",
    "ttg.memdesc_reshape", "ttg.memdesc_reinterpret", "tt.trans", "tt.reshape", "tt.split",
    "arith.truncf", "arith.extf", "tt.fp_to_fp", "tt.bitcast", "tt.elementwise_inline_asm",
}
# Views of a shared-memory buffer: a wgmma operand is followed through them to its allocation.
_VIEW_OPS = {"ttg.memdesc_trans", "ttg.memdesc_subslice", "ttg.memdesc_reshape", "ttg.memdesc_reinterpret"}
# How the software pipeliner loads a tile ahead of the iteration that uses it:
# cp.async, or TMA for tensor descriptors.
_ASYNC_COPIES = {"ttg.async_copy_global_to_local", "ttng.async_tma_copy_global_to_local"}


class _Ttgir:
    """The ops of a TTGIR module and the regions they sit in.

    MLIR reuses value names in sibling regions (both causal loops of an
    attention kernel define a %qk), so a name is looked up from the region
    of its use outwards."""

    def __init__(self, text: str):
        self.mma_versions = {}  # layout alias -> nvidia_mma versionMajor
        self.definitions = {}  # (region, name) -> ("op", op, result index) or ("iter_arg", loop body, index)
        self.loop_yields = {}  # loop body region -> the values its scf.yield carries to the next iteration
        self.ops = []
        self.locations = {}  # location alias -> its body
        for line in text.splitlines():
            alias = _LOCATION_ALIAS.match(line)
            if alias:
                self.locations[alias.group(1)] = alias.group(2)
        new_region = itertools.count(1)
        regions = [0]  # the regions enclosing the current line, outermost first
        for line in text.splitlines():
            location = _OP_LOCATION.search(line)
            line = _LOCATION.sub("", _STRING.sub('""', line))
            layout = _MMA_LAYOUT.match(line)
            if layout:
                self.mma_versions[layout.group(1)] = int(layout.group(2))
            statement = line.strip()
            definition = _DEFINITION.match(line)
            op = None
            if definition:
                results = [result.split(":")[0].strip() for result in definition.group(1).split(",")]
                op = {
                    "index": len(self.ops),
                    "name": definition.group(2),
                    "result": results[0],
                    "operands": _VALUE.findall(_ATTRIBUTES.sub("", line[definition.end():]).split(" : ")[0]),
                    "regions": tuple(regions),
                    "text": statement,
                    "location": location.group(1) if location else None,
                }
                self.ops.append(op)
                for index, result in enumerate(results):
                    self.definitions[(regions[-1], result)] = ("op", op, index)
            elif statement.startswith("scf.yield") and regions[-1] in self.loop_yields:
                self.loop_yields[regions[-1]] = _VALUE.findall(statement.split(" : ")[0])
            opened = line.count("{") - line.count("}")
            if statement.startswith("}"):  # ends a region; `} else {` also begins one
                regions.pop()
                opened += 1
            if opened > 0:
                regions.append(next(new_region))
                if op is not None and op["name"] == "scf.for":
                    self.loop_yields[regions[-1]] = []
                    iter_args = _ITER_ARGS.search(line)
                    for index, binding in enumerate(iter_args.group(1).split(",") if iter_args else []):
                        argument = binding.split("=")[0].strip()
                        self.definitions[(regions[-1], argument)] = ("iter_arg", regions[-1], index)

    def _lookup(self, value: str, regions: tuple):
        name = value.split("#")[0]
        return next((self.definitions[(r, name)] for r in reversed(regions) if (r, name) in self.definitions), None)

    def origins(self, value: str, regions: tuple, followed: frozenset = frozenset()) -> list:
        """Where the data of ``value``, used in ``regions``, comes from: a list
        of ("buffer", alloc op) for a buffer of a ttg.local_alloc multibuffer
        (which async copies fill) and ("load", op) for a tt.load.  Values
        computed otherwise are no source: the walk stops there."""
        definition = self._lookup(value, regions)
        # `followed` ends the walk where a loop carries a value unchanged.
        if definition is None or (value, regions) in followed:
            return []
        followed = followed | {(value, regions)}
        if definition[0] == "iter_arg":
            # An operand carried in from the previous iteration (3.9 prefetches
            # an Ampere dot's next K slice so): what that iteration yielded.
            _, body, index = definition
            return self.origins(self.loop_yields[body][index], regions[: regions.index(body) + 1], followed)
        _, op, result_index = definition
        name, operands, regions = op["name"], op["operands"], op["regions"]
        if name == "tt.load":
            return [("load", op)]
        if name == "ttg.memdesc_index":  # one buffer of a multibuffer
            alloc = self._lookup(operands[0], regions)
            is_multibuffer = alloc is not None and alloc[0] == "op" and alloc[1]["name"] == "ttg.local_alloc"
            return [("buffer", alloc[1])] if is_multibuffer and not alloc[1]["operands"] else []
        if name == "ttng.warp_group_dot_wait":  # result i is operand i, once the wgmma is done
            data = [operands[int(value.partition("#")[2] or result_index)]]
        elif name == "arith.select":  # a loaded tile with padding in places (tl.where)
            data = operands[1:]
        elif name in _SAME_DATA_OPS and operands:
            data = operands[:1]
        else:
            return []
        return [source for operand in data for source in self.origins(operand, regions, followed)]

    def innermost_loop_body(self, regions: tuple):
        return next((r for r in reversed(regions) if r in self.loop_yields), None)

    def restaged(self, value: str, regions: tuple) -> list:
        """The buffers (async copies' destinations) whose data reaches the shared-memory operand
        ``value`` through registers: a ``ttg.local_alloc`` of a tensor, after a ``local_load`` of
        the copied tile and whatever changed it there, stores it to shared memory again."""
        definition = self._lookup(value, regions)
        if definition is None or definition[0] != "op":
            return []
        op = definition[1]
        if op["name"] == "ttg.local_alloc" and op["operands"]:
            return [source for kind, source in self.origins(value, regions) if kind == "buffer"]
        if op["name"] in _VIEW_OPS:
            return self.restaged(op["operands"][0], op["regions"])
        return []

    def _frames(self, location: str) -> list:
        """The variable each frame of ``location`` (an alias or a location's
        body) assigns, innermost first (None where the frame's statement
        assigns none): an inlined call's location is its callee's, then the
        call's own."""
        location = self.locations.get(location, location)
        call = _CALLSITE_LOCATION.match(location)
        if call:
            return [*self._frames(call.group(1)), *self._frames(call.group(2))]
        name = _NAME_LOCATION.match(location)
        return [name.group(1) if name else None]

    def source_name(self, op: dict) -> str:
        """The source variable a load or buffer holds, from the load's location
        (a buffer of async copies keeps its load's): the variable it is assigned
        to, or for a tile that a loading helper returns (``_HELPER_RESULTS``),
        the variable its call assigns.  Else from the value's name: MLIR names a
        value after its variable, numbered to keep values apart (%k_t_99 -> k_t)."""
        frames = [None] if op["location"] is None else self._frames(op["location"])
        name = frames[1] if frames[0] in _HELPER_RESULTS and len(frames) > 1 else frames[0]
        return name or re.sub(r"_\d+$", "", op["result"].lstrip("%"))


def instruction_selection(ttgir: str, ptx: str) -> dict:
    """What a compiled kernel's dots lower to and how their main-loop operands
    are loaded.

    ``dots``: the instructions its ``tl.dot``s lower to, "wgmma", "mma.sync"
    or "fma" (no tensor cores), read from the TTGIR; ``ptx_mma``: which of
    wgmma and mma.sync its PTX holds, which should agree.  ``operand_stages``:
    for each dot operand that the dot's loop loads from global memory, named
    after its variable in the kernel (:meth:`_Ttgir.source_name`), how many iterations' loads are in
    flight: for a load pipelined into async copies, the copies issued for its
    buffers (num_stages - 1 ahead of the loop, then one per iteration); 1 for
    a plain tt.load.  Operands loaded before the loop or computed in it are
    not listed; an operand of several loops gets the fewest stages.
    ``restaged``: the main-loop wgmma operands whose copied tile goes through
    registers and back to shared memory before the dot (:meth:`_Ttgir.restaged`)."""
    module = _Ttgir(ttgir)
    copies = collections.Counter()
    for op in module.ops:
        if op["name"] in _ASYNC_COPIES:
            # The destination is the operand that is a buffer: cp.async takes
            # it second, TMA after the descriptor's coordinates.
            for operand in op["operands"]:
                for kind, alloc in module.origins(operand, op["regions"]):
                    if kind == "buffer":
                        copies[alloc["index"]] += 1
    dots, operand_stages, restaged = set(), {}, set()
    for op in module.ops:
        if op["name"] not in ("tt.dot", "ttng.warp_group_dot"):
            continue
        layout = _DOT_RESULT_LAYOUT.search(op["text"]).group(1)
        dots.add(_MMA_INSTRUCTIONS.get(module.mma_versions.get(layout), "fma"))
        loop_body = module.innermost_loop_body(op["regions"])
        if loop_body is None:
            continue
        if op["name"] == "ttng.warp_group_dot":
            restaged.update(module.source_name(source) for operand in op["operands"][:2]
                            for source in module.restaged(operand, op["regions"]))
        sources = [source for operand in op["operands"][:2] for source in module.origins(operand, op["regions"])]
        for kind, source in sources:
            if kind == "buffer":
                stages = copies[source["index"]]
            elif kind == "load" and loop_body in source["regions"]:
                stages = 1
            else:
                continue
            name = module.source_name(source)
            operand_stages[name] = min(stages, operand_stages.get(name, stages))
    return {
        "dots": sorted(dots),
        "ptx_mma": sorted(kind for kind, mnemonic in _PTX_MMA.items() if mnemonic in ptx),
        "operand_stages": operand_stages,
        "restaged": sorted(restaged),
    }


def main_loops(sass: str) -> list[int]:
    """The instruction count of each loop of ``sass`` (:func:`_sass.loops`)."""
    return [loop.length for loop in _sass.loops(sass)]


def compile_one(module_names, case_id: str, loops: bool = False) -> dict:
    target, capability = _targets(module_names)[case_id]
    source, options = compile_source(target.launch(), capability)
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
    except Exception as error:  # reported per target by the test
        return {"error": f"{type(error).__name__}: {error}"[:2000]}
    facts = {"shared": compiled.metadata.shared, **_resource_usage(compiled.asm["cubin"])}
    if loops:
        return {**facts, "loops": main_loops(_cuobjdump(compiled.asm["cubin"], "-sass"))}
    return {
        **facts,
        "num_stages": options["num_stages"],
        **instruction_selection(compiled.asm["ttgir"], compiled.asm["ptx"]),
    }


def compile_all(module_names, loops: bool = False) -> dict:
    with concurrent.futures.ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        futures = {
            case_id: pool.submit(compile_one, module_names, case_id, loops) for case_id in _targets(module_names)
        }
        return {case_id: future.result() for case_id, future in futures.items()}


def _loop_facts(facts: dict) -> str:
    if "error" in facts:
        return facts["error"].splitlines()[0]
    return f"REG {facts['REG']:3d}  STACK {facts['STACK']:3d}  shared {facts['shared']:6d}  loops {facts['loops']}"


def print_loops(results: dict, compare_path: str = None) -> None:
    """One line per target; with ``compare_path`` (a ``--save``d run), only the targets whose facts
    differ, the saved ones above."""
    saved = {}
    if compare_path:
        with open(compare_path) as f:
            saved = json.load(f)
    for case_id, facts in results.items():
        if not compare_path:
            print(f"{case_id:60s} {_loop_facts(facts)}")
        elif saved.get(case_id) != facts:
            print(f"{case_id:60s} {_loop_facts(saved[case_id]) if case_id in saved else '(new)'}")
            print(f"{'':60s} {_loop_facts(facts)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help=f"of {', '.join(MODULES)} (default: all)")
    parser.add_argument("--loops", action="store_true", help="print the SASS loop facts instead of JSON")
    parser.add_argument("--save", help="with --loops: write them to this JSON file")
    parser.add_argument("--compare", help="with --loops: print only what differs from this saved file")
    options = parser.parse_args()
    unknown = set(options.modules) - set(MODULES)
    if unknown:
        parser.error(f"unknown modules {sorted(unknown)}; choose from {list(MODULES)}")
    results = compile_all(options.modules or list(MODULES), options.loops)
    if not options.loops:
        json.dump(results, sys.stdout)
        return
    if options.save:
        with open(options.save, "w") as f:
            json.dump(results, f, indent=1)
    print_loops(results, options.compare)


if __name__ == "__main__":
    main()
