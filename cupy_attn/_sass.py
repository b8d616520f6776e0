"""A static reading of a kernel's machine code (SASS), no GPU needed: the hot loop's instruction
mix and a model of its issue cycles against its tensor-core cycles.

The cubin comes from NVRTC (`_nvrtc.compile_kernel`, built as CuPy builds it), the disassembly
from `nvdisasm` (the `nvidia-cuda-nvdisasm` wheel of the test extra, $CUDA_PATH/bin or PATH).

Hot loop: every backward branch (a BRA to an earlier label) closes a loop; the hot loop is the
one holding the most tensor-core instructions (HMMA for mma.sync, HGMMA for wgmma) of its own,
outside the loops nested in it, the innermost such loop where several hold as many (a persistent
kernel's loop over work tiles holds its key loop and the tiles peeled off its ends: the key loop
is the hot one). `loop_instructions` counts every instruction in
it (all paths; a nested loop's body once). The per-iteration numbers come from the fastest path:
the fewest instructions from the loop's head to its back-edge that do the work each iteration
does (every tensor instruction, and as many asynchronous copies, 16-byte shared stores and global
reductions as any path has: a tile staged by the checked copy of a boundary tile or the unchecked
one of an interior tile), with each conditional branch free to go either way. Features a call does not
use (masks, softcap, ALiBi, boundary tiles) sit behind branches such a path skips, so it is what
an interior tile of a call without them issues; `path_instructions` and the per-class counts
(ldsm, lds, sts, ldgsts, tma, bar, mufu, atomics) are of that path. Instructions predicated on !PT
(ptxas pads cp.async with never-executed loads) take issue slots but count in no class.

The model (README, "Performance without a GPU"): one warp scheduler per SM sub-partition issues
at most one instruction per cycle, and each of its warps issues every instruction of the loop
once per iteration; one warp's tensor-core instruction keeps that sub-partition's tensor core busy
for its multiply-adds over FMA_PER_CYCLE cycles. Both sides grow with the warps per scheduler alike, so

    issue_per_tensor = path instructions / tensor-core cycles of the path's tensor instructions

per warp and iteration, whatever the occupancy. Below 1 the tensor cores bound the loop; above 1
instruction issue does, and the tensor cores can be busy at most 1/issue_per_tensor of the time.
Ignored: latency and dependency stalls, shared-memory and barrier waits, memory bandwidth,
partial tiles, and time outside the loop.

wgmma is asynchronous: a warpgroup's instructions between a wgmma and the wait that retires it
overlap its tensor work. The path's instructions issued with none in flight are
`exposed_instructions` (exposed_instructions() below); `exposed_per_tensor` divides them by the
path's tensor cycles. With one warpgroup per tensor core the loop takes at least
(exposed + tensor cycles) per iteration; the other consumer warpgroups of the block can fill the
gap only where they are not exposed at the same time.

Issue slots are not the only budget: the special-function unit (MUFU: the softmax's exp2, the
softcap's exp2 and reciprocal) returns 16 results per clock per SM, so a warp's MUFU instruction
holds its sub-partition's unit for MUFU_CYCLES; `mufu_per_tensor` is the path's MUFU cycles per
tensor cycle, and above 1 that unit bounds the loop (FlashAttention-3's exp2 limit at D = 64).

Nor is shared memory: it returns one 128-byte wavefront per clock per SM (A100, H100: 128 bytes
per clock), for the SM's SUBPARTITIONS sub-partitions together, so each warp's wavefront takes
SUBPARTITIONS of its own sub-partition's cycles. `shared_per_tensor` is the path's wavefronts
(shared_wavefronts: ldmatrix, LDS, STS, cp.async's writes and wgmma's operands read from shared
memory, each without bank conflicts, as the emulator's memory counters find every kernel's) times
SUBPARTITIONS per tensor cycle; above 1 shared memory bounds the loop. A warp's fragments of K and
V serve as many MMAs as it has rows, so this is the ratio a tile's rows per warp set. Not counted:
TMA's writes (a box's size is not in the instruction) and bank conflicts.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

# SASS opcode (before the first dot) -> the counter it adds to.
COUNTED = {"LDSM": "ldsm", "LDS": "lds", "STS": "sts", "LDGSTS": "ldgsts", "UTMALDG": "tma", "BAR": "bar",
           "MUFU": "mufu", "ATOM": "atomics", "ATOMS": "atomics", "ATOMG": "atomics", "RED": "atomics", "REDG": "atomics"}
TENSOR_OPCODES = ("HMMA", "HGMMA")

# Dense fp16/bf16 multiply-adds per clock per SM sub-partition (fp32 accumulation): A100 (sm_80)
# 1024 per SM, H100 SXM (sm_90) 2048 per SM (989 TFLOP/s at 1.83 GHz over 132 SMs); four
# sub-partitions each. Assumed for mma.sync on sm_90 too, which makes its tensor cycles a lower
# bound and issue_per_tensor an upper bound there.
FMA_PER_CYCLE = {"sm_80": 256, "sm_86": 128, "sm_89": 128, "sm_90": 512, "sm_90a": 512}

# Special-function results (MUFU: exp2, reciprocal, tanh, ...) per clock per SM: 16 on every arch
# above (the CUDA C++ Programming Guide's throughput table; FlashAttention-3's 3.9 TFLOP/s on the
# H100 SXM), 4 per sub-partition, so one warp's MUFU holds its sub-partition's unit for 8 cycles.
MUFU_CYCLES = 8

# Shared memory's 128-byte wavefronts per clock per SM (A100, H100), shared by its sub-partitions.
SUBPARTITIONS = 4


class SassError(RuntimeError):
    """nvdisasm is missing or its output could not be read."""


def tensor_fma(opcode: str) -> int:
    """Multiply-adds one warp's tensor instruction does on its sub-partition: HMMA.16816.F32 is
    m16n8k16 (2048); HGMMA.64xNx16.F32 is a warpgroup's m64nNk16, a quarter per warp."""
    parts = opcode.split(".")
    if parts[0] == "HMMA":
        m, n, k = {"16816": (16, 8, 16), "1688": (16, 8, 8), "884": (8, 8, 4)}[parts[1]]
        return m * n * k
    if parts[0] == "HGMMA":
        m, n, k = (int(x) for x in parts[1].split("x"))
        return m * n * k // 4
    raise ValueError(f"not a tensor-core instruction: {opcode}")


def tensor_cycles(opcode: str, arch: str) -> float:
    return tensor_fma(opcode) / FMA_PER_CYCLE[arch]


@lru_cache(maxsize=1)
def nvdisasm() -> Path:
    roots = [Path(p) / "nvidia" for p in sys.path if (Path(p) / "nvidia").is_dir()]
    for root in roots:
        for candidate in sorted(root.glob("cu1*/bin/nvdisasm"), reverse=True) + [root / "cuda_nvdisasm/bin/nvdisasm"]:
            if candidate.is_file():
                return candidate
    cuda = os.environ.get("CUDA_PATH")
    for candidate in ([Path(cuda) / "bin" / "nvdisasm"] if cuda else []) + [Path("/usr/local/cuda/bin/nvdisasm")]:
        if candidate.is_file():
            return candidate
    found = shutil.which("nvdisasm")
    if found:
        return Path(found)
    raise SassError("nvdisasm not found: pip install nvidia-cuda-nvdisasm (the test extra has it), or set CUDA_PATH")


@dataclass
class Instruction:
    offset: int
    opcode: str  # with its modifiers, e.g. HMMA.16816.F32.BF16
    target: str | None = None  # a branch's label
    predicated: bool = False
    never: bool = False  # predicated on !PT: issued (ptxas pads cp.async with such loads) but never executed
    operands: str = ""

    @property
    def ends_block(self) -> bool:
        return self.opcode.startswith(("BRA", "EXIT", "RET", "JMP", "BRX", "JMX"))

    @property
    def falls_through(self) -> bool:
        return self.predicated or not self.ends_block


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_x]+)*)(.*);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def parse(text: str) -> tuple[list[Instruction], dict[str, int]]:
    """nvdisasm's text -> instructions in order, and each label's offset."""
    instructions, labels, pending = [], {}, []
    for line in text.splitlines():
        label = _LABEL.match(line.strip())
        if label:
            pending.append(label.group(1))
            continue
        match = _INSTRUCTION.search(line)
        if not match:
            continue
        offset = int(match.group(1), 16)
        for name in pending:
            labels[name] = offset
        pending = []
        opcode, operands = match.group(3), match.group(4)
        target = _TARGET.search(operands) if opcode.startswith("BRA") else None
        # "@P0 BRA P1, `(L)" and "BRA P1, `(L)" branch on a predicate operand too
        predicated = bool(match.group(2)) or (target is not None and re.match(r"\s*!?U?P[0-9],", operands) is not None)
        never = (match.group(2) or "").strip() == "@!PT"
        instructions.append(Instruction(offset, opcode, target.group(1) if target else None, predicated, never,
                                        operands.strip()))
    if not instructions:
        raise SassError("nvdisasm printed no instructions")
    return instructions, labels


def disassemble(cubin: bytes) -> tuple[list[Instruction], dict[str, int]]:
    if not cubin:
        raise SassError("no cubin: compile for a real architecture (sm_XX), not a virtual one")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        # -ndf: without the dataflow pass, which only labels jumps through the branch stack (BRX,
        # JMX), whose targets parse() does not read (every kernel family's listing is the same
        # without it), and took a third of nvdisasm's time
        result = subprocess.run([str(nvdisasm()), "-c", "-ndf", str(path)], capture_output=True, text=True)
    if result.returncode:
        raise SassError(f"nvdisasm failed: {result.stderr.strip()}")
    return parse(result.stdout)


def loops(instructions: list[Instruction], labels: dict[str, int]) -> list[tuple[int, int]]:
    """(first offset, last offset) of every loop: a branch back to an earlier (or its own) label,
    other than an out-of-line stub's return (_returns_from_stub)."""
    at = {i.offset: n for n, i in enumerate(instructions)}
    return sorted({(labels[i.target], i.offset) for i in instructions
                   if i.target in labels and labels[i.target] <= i.offset
                   and not _returns_from_stub(instructions, at, labels, i)})


def _returns_from_stub(instructions: list[Instruction], at: dict[int, int], labels: dict[str, int],
                       jump: Instruction) -> bool:
    """Whether the unconditional back-jump `jump` ends an out-of-line stub: code that only a branch
    right before the jump's target enters and that goes back to where that branch was. ptxas puts
    an mbarrier wait's retry loop so, after the kernel's end (TRYWAIT; @!P BRA wait, BRA back to
    the instruction after the one that branched to the stub): a detour, not a loop around the code
    in between."""
    target = at.get(labels[jump.target])
    if jump.predicated or not target:
        return False
    entry = instructions[target - 1]
    stub = labels.get(entry.target)
    if stub is None or not labels[jump.target] < stub <= jump.offset or instructions[at[stub] - 1].falls_through:
        return False
    return all(i is jump or i.target is None or labels.get(i.target) == stub
               for i in instructions[at[stub]:at[jump.offset] + 1])


@dataclass
class LoopReport:
    loop_instructions: int = 0  # every instruction in the hot loop, all paths
    path_instructions: int = 0  # the fastest path's, per iteration
    tensor_instructions: dict = field(default_factory=dict)  # opcode -> count on the path
    counts: dict = field(default_factory=dict)  # ldsm, lds, sts, ldgsts, tma, bar, mufu, atomics on the path
    tensor_cycles: float = 0.0
    issue_per_tensor: float | None = None  # None: no tensor instruction in any loop
    exposed_instructions: int | None = None  # wgmma kernels: the path's issued with no wgmma in flight
    shared_wavefronts: float = 0.0  # the path's 128-byte shared-memory wavefronts (shared_wavefronts())
    # Loops inside the hot loop that its fastest path enters: the path counts each one's body once,
    # whatever its trip count, so the figures above undercount where this is not 0.
    nested_loops: int = 0

    @property
    def exposed_per_tensor(self) -> float | None:
        return None if self.exposed_instructions is None else self.exposed_instructions / self.tensor_cycles

    @property
    def mufu_per_tensor(self) -> float | None:
        """The path's MUFU instructions' cycles on their sub-partition's unit (MUFU_CYCLES each) per
        tensor cycle: above 1 that unit bounds the loop, whatever issue_per_tensor says."""
        return None if self.issue_per_tensor is None else self.counts.get("mufu", 0) * MUFU_CYCLES / self.tensor_cycles

    @property
    def shared_per_tensor(self) -> float | None:
        """The path's shared-memory wavefronts, each SUBPARTITIONS cycles of its sub-partition's
        share of the SM's one wavefront per clock, per tensor cycle: above 1 shared memory's
        bandwidth bounds the loop, whatever issue_per_tensor says."""
        return None if self.issue_per_tensor is None else SUBPARTITIONS * self.shared_wavefronts / self.tensor_cycles

    def as_row(self) -> dict:
        exposed = self.exposed_per_tensor
        shared = self.shared_per_tensor
        row = {"loop_instructions": self.loop_instructions, "path_instructions": self.path_instructions,
               "tensor_instructions": self.tensor_instructions,
               "issue_per_tensor": None if self.issue_per_tensor is None else round(self.issue_per_tensor, 3),
               "exposed_instructions": self.exposed_instructions,
               "exposed_per_tensor": None if exposed is None else round(exposed, 3),
               "mufu_per_tensor": None if self.mufu_per_tensor is None else round(self.mufu_per_tensor, 3),
               "shared_wavefronts": self.shared_wavefronts,
               "shared_per_tensor": None if shared is None else round(shared, 3),
               "nested_loops": self.nested_loops}
        row.update({name: self.counts.get(name, 0) for name in sorted(set(COUNTED.values()))})
        return row


def _is_tensor(instruction: Instruction) -> bool:
    return instruction.opcode.startswith(TENSOR_OPCODES)


def steady_bytes(instruction: Instruction) -> int:
    """The memory work every iteration does, in bytes per lane: asynchronous copies (the next tile:
    LDGSTS; or TMA's UTMALDG, one thread's copy of a whole box, weighed as one 16-byte chunk: the
    path must issue it, in the warp whose thread does), 16-byte shared stores (staging through
    registers) and global reductions (dQ's atomics, scalar or vector: RED.…F32, REDG.…F32x2).
    Bytes, not instructions, so that one vector reduction weighs what the two scalar ones it
    replaces do."""
    op = instruction.opcode
    if instruction.never:
        return 0
    if op.startswith("LDGSTS"):
        return 16 if ".128" in op else 8 if ".64" in op else 4
    if op.startswith("UTMALDG"):
        return 16
    if op == "STS.128":
        return 16
    if op.split(".")[0] in ("RED", "REDG", "ATOM", "ATOMG"):  # not REDUX, a warp reduction
        return 4 * (4 if "x4" in op else 2 if "x2" in op else 1)
    return 0


def shared_wavefronts(instruction: Instruction) -> float:
    """The 128-byte shared-memory wavefronts one warp's instruction takes without bank conflicts:
    ldmatrix and stmatrix by their matrices (.x1, .x2, .x4: 8 rows of 16 bytes each); LDS, STS
    and ATOMS by their width (a warp's 4-byte or narrower, 8- and 16-byte accesses: 1, 2, 4);
    LDGSTS by the chunk it writes into shared memory (the same); a wgmma by its operands read from
    shared memory (a k-step's 32 bytes per row: B's N rows, and A's M unless A comes from
    registers; a warpgroup's instruction, a quarter per warp)."""
    parts = instruction.opcode.split(".")
    if instruction.never:
        return 0
    if parts[0] in ("LDSM", "STSM"):
        return 4 if parts[-1] == "4" else 2 if parts[-1] == "2" else 1
    if parts[0] in ("LDS", "STS", "LDGSTS", "ATOMS"):
        return 4 if "128" in parts else 2 if "64" in parts else 1
    if parts[0] == "HGMMA":
        m, n, _ = (int(x) for x in parts[1].split("x"))
        a_from_shared = instruction.operands.split(",")[1].strip().startswith("gdesc")
        return (m * a_from_shared + n) * 32 / 128 / 4
    return 0


def _weight(block: list[Instruction]) -> tuple[int, int, int]:
    """What a path through block gains, in the order fastest_path weighs it: tensor instructions
    and steady memory work (both negated: more is better), then instructions."""
    return -sum(map(_is_tensor, block)), -sum(map(steady_bytes, block)), len(block)


def fastest_path(body: list[Instruction], labels: dict[str, int]) -> list[Instruction] | None:
    """The path from body[0] to the back-edge at body[-1] that does every iteration's work with the
    fewest instructions: of the paths with the most tensor instructions (all of them, unless the
    code holds alternative copies of them: a checked and an unchecked epilogue, say), those with
    the most steady memory work (steady_bytes: a tile copied by cp.async one way or another, the
    checked copy of a boundary tile or the unchecked one of an interior tile), and of those the
    shortest; None if the back-edge cannot be reached. Forward edges only (a nested loop's
    back-edge is not taken, so its body counts once); edges out of the body end nowhere."""
    first, last = body[0].offset, body[-1].offset
    leaders = {first} | {o for o in labels.values() if first <= o <= last}
    leaders |= {b.offset for a, b in zip(body, body[1:]) if a.ends_block}
    blocks, current = [], []
    for instruction in body:
        if instruction.offset in leaders and current:
            blocks.append(current)
            current = []
        current.append(instruction)
    blocks.append(current)
    start_of = {block[0].offset: n for n, block in enumerate(blocks)}

    def successors(n):
        end = blocks[n][-1]
        nexts = []
        if end.falls_through and n + 1 < len(blocks):
            nexts.append(n + 1)
        if end.target in labels and labels[end.target] > end.offset and labels[end.target] in start_of:
            nexts.append(start_of[labels[end.target]])
        return nexts

    # The best (lexicographically least) weight of a path to each block: blocks in layout order,
    # forward edges go up, and tuples add elementwise, so one pass finds it.
    cost, back = {0: _weight(blocks[0])}, {}
    for n in range(len(blocks)):
        if n not in cost:
            continue
        for m in successors(n):
            candidate = tuple(x + y for x, y in zip(cost[n], _weight(blocks[m])))
            if m not in cost or candidate < cost[m]:
                cost[m], back[m] = candidate, n
    goal = len(blocks) - 1
    if goal not in cost:
        return None
    path, n = [goal], goal
    while n:
        n = back[n]
        path.append(n)
    return [instruction for n in path[::-1] for instruction in blocks[n]]


_WGMMA_WAIT = re.compile(r"gsb0,\s*(0x[0-9a-f]+|\d+)")


def exposed_instructions(path: list[Instruction]) -> int | None:
    """Of the path's instructions, those a warpgroup issues while none of its wgmma is in flight:
    issue its tensor work cannot hide. A wgmma (HGMMA) runs from its issue until a wait retires
    its group (WARPGROUP.DEPBAR.LE gsb0, N: all but the N most recent committed groups; the last
    HGMMA of a group carries gsb0), and the instructions issued meanwhile overlap it; those after
    a wait for every group and before the next HGMMA do not, and a warpgroup alone leaves the
    tensor cores idle for at least their issue (FlashAttention-3's reason to issue the next S
    before the softmax, and dV before dS). Steady state: the path walked twice, the groups in
    flight at its end carried round the back-edge. None for a path without HGMMA (mma.sync's HMMA
    is synchronous to its warp's scoreboard: no such window)."""
    if not any(i.opcode.startswith("HGMMA") for i in path):
        return None

    def walk(pending: int) -> tuple[int, int]:
        exposed, open_group = 0, False
        for i in path:
            if i.opcode.startswith("HGMMA"):
                ends_group = "gsb0" in i.operands
                pending, open_group = pending + ends_group, not ends_group
                continue
            if i.opcode.startswith("WARPGROUP.DEPBAR"):
                wait = _WGMMA_WAIT.search(i.operands)
                if wait is None:
                    raise SassError(f"a wgmma wait without its group count at {i.offset:#x}: {i.operands}")
                pending = min(pending, int(wait.group(1), 0))
            exposed += pending == 0 and not open_group
        return pending, exposed

    carried, _ = walk(0)
    return walk(carried)[1]


def hot_loop_report(instructions: list[Instruction], labels: dict[str, int], arch: str) -> LoopReport:
    def inside(span):
        return [i for i in instructions if span[0] <= i.offset <= span[1]]

    def own_tensor_instructions(span, spans):
        nested = [n for n in spans if n != span and span[0] <= n[0] and n[1] <= span[1]]
        return sum(_is_tensor(i) for i in inside(span) if not any(n[0] <= i.offset <= n[1] for n in nested))

    spans = loops(instructions, labels)
    candidates = [(own_tensor_instructions(s, spans), -(s[1] - s[0]), s) for s in spans]
    if not candidates or max(candidates)[0] == 0:
        return LoopReport()
    hot = max(candidates)[2]
    body = inside(hot)
    path = fastest_path(body, labels)
    if path is None:
        raise SassError(f"no path through the hot loop at {body[0].offset:#x} reaches its back-edge")
    report = LoopReport(loop_instructions=len(body), path_instructions=len(path))
    on_path = {i.offset for i in path}
    report.nested_loops = sum(s != hot and hot[0] <= s[0] and s[1] <= hot[1] and s[1] in on_path for s in spans)
    report.tensor_instructions = dict(Counter(i.opcode for i in path if _is_tensor(i)))
    report.counts = dict(Counter(COUNTED[i.opcode.split(".")[0]] for i in path
                                 if i.opcode.split(".")[0] in COUNTED and not i.never))
    report.tensor_cycles = sum(n * tensor_cycles(op, arch) for op, n in report.tensor_instructions.items())
    report.issue_per_tensor = report.path_instructions / report.tensor_cycles
    report.exposed_instructions = exposed_instructions(path)
    report.shared_wavefronts = sum(map(shared_wavefronts, path))
    return report


def advisories(ptxas_log: str) -> list[str]:
    """ptxas's warnings and performance notes (e.g. serialized wgmma) among NVRTC's log lines."""
    return [line.strip() for line in ptxas_log.splitlines()
            if "warning" in line.lower() or "performance" in line.lower() or re.search(r"\(C\d{4}\)", line)]
