"""SASS (``cuobjdump -sass``) as control flow: each function's instructions and its natural loops.

A loop is what a branch back to an earlier instruction (the header) closes: every instruction on a
path from the header to that branch.  That counts the blocks a compiler moves out of line (a loop's
rarely taken side, placed after the branch back), which an address range from the header to the
branch would miss, and both sides of a condition inside the loop; and it keeps out the code before
a loop that the compiler enters in its middle.  Used by ``_compile_targets.py`` (Triton kernels) and
``test_cuda_compile.py`` (the CUDA extension's).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import subprocess

import triton

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")

# `/*01a0*/  @!P0 FFMA R1, R2, R3, R4 ;`: address, predicate, opcode (with its modifiers).
_INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);")
_BRANCH_TARGET = re.compile(r"\b0x([0-9a-f]+)")
_FUNCTION = re.compile(r"^\s+Function : (\S+)", re.MULTILINE)
# Shorter "loops" are the trap at a function's end, which branches to itself.
_MIN_LOOP_INSTRUCTIONS = 8


def cuobjdump(cubin_path: str, option: str = "-sass") -> str:
    return subprocess.run([CUOBJDUMP, option, cubin_path], capture_output=True, text=True, check=True).stdout


@dataclasses.dataclass(frozen=True)
class Loop:
    opcodes: collections.Counter  # base opcode (before the first ".") -> count

    @property
    def length(self) -> int:
        return sum(self.opcodes.values())


def functions(sass: str) -> dict[str, str]:
    """The SASS of each function, by (mangled) name."""
    starts = list(_FUNCTION.finditer(sass))
    return {m.group(1): sass[m.end(): starts[i + 1].start() if i + 1 < len(starts) else len(sass)]
            for i, m in enumerate(starts)}


def loops(function_sass: str) -> list[Loop]:
    """The natural loops of one function, in the order of their branches back (an outer loop holds
    the instructions of the inner ones)."""
    instructions = []  # (address, predicated, opcode, operands)
    for line in function_sass.splitlines():
        match = _INSTRUCTION.match(line)
        if match:
            instructions.append((int(match.group(1), 16), match.group(2) is not None, match.group(3), match.group(4)))
    index = {address: i for i, (address, *_) in enumerate(instructions)}
    successors = []
    for i, (_, predicated, opcode, operands) in enumerate(instructions):
        base = opcode.split(".")[0]
        following = [i + 1] if i + 1 < len(instructions) else []
        if base == "BRA":
            target = _BRANCH_TARGET.search(operands)
            targets = [index[int(target.group(1), 16)]] if target and int(target.group(1), 16) in index else []
            successors.append(targets + (following if predicated else []))
        elif base == "EXIT" and not predicated:
            successors.append([])
        else:
            successors.append(following)
    predecessors = collections.defaultdict(list)
    for i, targets in enumerate(successors):
        for target in targets:
            predecessors[target].append(i)
    found = []
    for i, targets in enumerate(successors):
        for header in targets:
            if header > i or instructions[i][2].split(".")[0] != "BRA":
                continue
            body = _reached(header, successors) & _reached(i, predecessors)
            if len(body) >= _MIN_LOOP_INSTRUCTIONS:
                found.append(Loop(collections.Counter(instructions[n][2].split(".")[0] for n in body)))
    return found


def _reached(start: int, edges) -> set:
    """The instructions reached from ``start`` along ``edges`` (``start`` included)."""
    seen, stack = set(), [start]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(edges[node])
    return seen
