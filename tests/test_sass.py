"""The SASS reading (cupy_attn._sass) on hand-made disassembly with known answers."""
import pytest

from cupy_attn import _sass

# A loop at 0x10..0x70 whose optional block (0x30, 0x40: a feature a call may not use) sits behind a
# branch; the fastest path skips it.
FEATURE_BEHIND_A_BRANCH = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0020*/              @P0 BRA `(.L_x_1) ;
        /*0030*/                   FMUL R4, R4, R5 ;
        /*0040*/                   FMUL R4, R4, R5 ;
.L_x_1:
        /*0050*/                   LDSM.16.M88.4 R8, [R2] ;
        /*0060*/                   MUFU.EX2 R3, R3 ;
        /*0070*/              @P1 BRA `(.L_x_0) ;
        /*0080*/                   EXIT ;
"""

# The same shape, but the branch skips a block holding tensor work and an asynchronous copy: every
# iteration's tensor instructions must be on the path, so the path cannot skip it.
TENSOR_WORK_BEHIND_A_BRANCH = FEATURE_BEHIND_A_BRANCH.replace(
    "/*0030*/                   FMUL R4, R4, R5 ;", "/*0030*/                   HMMA.16816.F32 R4, R8, R12, R4 ;").replace(
    "/*0040*/                   FMUL R4, R4, R5 ;", "/*0040*/                   LDGSTS.E.BYPASS.128 [R6], desc[UR4][R10.64] ;")

# Two loops: an outer one (0x10..0x90) with no tensor work of its own beyond the inner one
# (0x20..0x50, two HGMMA); the hot loop is the innermost with the most tensor instructions.
NESTED = """
.L_x_0:
        /*0010*/                   IADD3 R0, R0, 0x1, RZ ;
.L_x_1:
        /*0020*/                   HGMMA.64x128x16.F32 R24, gdesc[UR4], R24 ;
        /*0030*/                   HGMMA.64x128x16.F32 R24, gdesc[UR8], R24 ;
        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0050*/              @!P2 BRA `(.L_x_1) ;
        /*0060*/                   STS.128 [R3], R24 ;
        /*0070*/                   RED.E.ADD.F32.FTZ.RN.STRONG.GPU desc[UR4][R8.64], R9 ;
        /*0080*/                   ISETP.GE.AND P0, PT, R0, R1, PT ;
        /*0090*/              @!P0 BRA `(.L_x_0) ;
        /*00a0*/                   EXIT ;
"""


# A loop (0x10..0xd0) with the same tile copy two ways, chosen by a branch at 0x20: a checked copy
# (0x30..0x70: a test per chunk around each LDGSTS) and an unchecked one (0x90, 0xa0), then dQ's
# reduction as two scalar REDs (0xb0, 0xc0) or, behind a branch, nothing; the fastest path copies
# the tile the short way and keeps the reductions, whose bytes are steady work.
ALTERNATIVE_COPIES = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0020*/              @P0 BRA `(.L_x_2) ;
        /*0030*/                   ISETP.GE.AND P1, PT, R0, R1, PT ;
        /*0040*/              @!P1 LDGSTS.E.BYPASS.128 [R6], desc[UR4][R10.64] ;
        /*0050*/                   ISETP.GE.AND P1, PT, R2, R1, PT ;
        /*0060*/              @!P1 LDGSTS.E.BYPASS.128 [R6+0x10], desc[UR4][R10.64+0x10] ;
        /*0070*/                   BRA `(.L_x_3) ;
.L_x_2:
        /*0080*/                   NOP ;
        /*0090*/                   LDGSTS.E.BYPASS.128 [R6], desc[UR4][R10.64] ;
        /*00a0*/                   LDGSTS.E.BYPASS.128 [R6+0x10], desc[UR4][R10.64+0x10] ;
.L_x_3:
        /*00b0*/              @P2 BRA `(.L_x_4) ;
        /*00c0*/                   RED.E.ADD.F32.FTZ.RN.STRONG.GPU desc[UR4][R8.64], R9 ;
        /*00d0*/                   RED.E.ADD.F32.FTZ.RN.STRONG.GPU desc[UR4][R8.64+0x4], R5 ;
.L_x_4:
        /*00e0*/              @P3 BRA `(.L_x_0) ;
        /*00f0*/                   EXIT ;
"""


def report(text, arch):
    return _sass.hot_loop_report(*_sass.parse(text), arch)


def test_fastest_path_skips_optional_work_and_the_model_divides_issue_by_tensor_cycles():
    instructions, labels = _sass.parse(FEATURE_BEHIND_A_BRANCH)
    assert _sass.loops(instructions, labels) == [(0x10, 0x70)]
    r = report(FEATURE_BEHIND_A_BRANCH, "sm_80")
    assert (r.loop_instructions, r.path_instructions) == (7, 5)
    assert r.tensor_instructions == {"HMMA.16816.F32": 1}
    assert r.counts == {"ldsm": 1, "mufu": 1}
    assert r.issue_per_tensor == pytest.approx(5 / 8)  # m16n8k16: 2048 FMA at 256 per cycle on sm_80
    assert r.mufu_per_tensor == pytest.approx(8 / 8)  # one MUFU: 8 cycles of the sub-partition's unit
    on_sm90 = report(FEATURE_BEHIND_A_BRANCH, "sm_90")
    assert on_sm90.issue_per_tensor == pytest.approx(5 / 4)  # 512 per cycle
    assert on_sm90.mufu_per_tensor == pytest.approx(8 / 4) and on_sm90.as_row()["mufu_per_tensor"] == 2.0


def test_fastest_path_keeps_tensor_work_and_asynchronous_copies():
    r = report(TENSOR_WORK_BEHIND_A_BRANCH, "sm_80")
    assert (r.loop_instructions, r.path_instructions) == (7, 7)
    assert r.tensor_instructions == {"HMMA.16816.F32": 2}
    assert r.counts == {"ldsm": 1, "mufu": 1, "ldgsts": 1}
    assert r.issue_per_tensor == pytest.approx(7 / 16)


# The wgmma forward's loop: thread 0 issues the next tile's TMA copies behind a branch the other
# threads take around them; the path issues them (in the warp whose thread does).
TMA_BEHIND_A_BRANCH = FEATURE_BEHIND_A_BRANCH.replace(
    "/*0030*/                   FMUL R4, R4, R5 ;", "/*0030*/                   UTMALDG.4D [UR8], [UR4] ;")


def test_fastest_path_issues_the_tma_copies_of_the_thread_that_loads():
    r = report(TMA_BEHIND_A_BRANCH, "sm_90a")
    assert (r.loop_instructions, r.path_instructions) == (7, 7)
    assert r.counts == {"ldsm": 1, "mufu": 1, "tma": 1}


def test_hot_loop_is_the_innermost_with_the_most_tensor_instructions():
    instructions, labels = _sass.parse(NESTED)
    assert _sass.loops(instructions, labels) == [(0x10, 0x90), (0x20, 0x50)]
    r = report(NESTED, "sm_90a")
    assert (r.loop_instructions, r.path_instructions) == (4, 4)
    assert r.tensor_instructions == {"HGMMA.64x128x16.F32": 2}
    assert r.counts == {"bar": 1}
    # a warp's quarter of m64n128k16 is 32768 FMA: 64 cycles at 512 per cycle
    assert r.issue_per_tensor == pytest.approx(4 / 128)



# A hot loop (0x10..0x80) holding two loops of its own: one (0x30, 0x40) behind a branch the
# fastest path takes around it, one (0x60, 0x70) on every path, as a rolled Philox's rounds were.
LOOPS_INSIDE = """
.L_x_0:
        /*0010*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0020*/              @P0 BRA `(.L_x_2) ;
.L_x_1:
        /*0030*/                   IMAD.WIDE.U32 R2, R3, 0x5, RZ ;
        /*0040*/              @P1 BRA `(.L_x_1) ;
.L_x_2:
        /*0050*/                   MUFU.EX2 R3, R3 ;
.L_x_3:
        /*0060*/                   LOP3.LUT R5, R5, R6, R7, 0x96, !PT ;
        /*0070*/              @P2 BRA `(.L_x_3) ;
        /*0080*/              @P3 BRA `(.L_x_0) ;
        /*0090*/                   EXIT ;
"""


def test_loops_inside_the_hot_loop_that_its_path_enters_are_counted():
    """Such a loop's body counts once on the path, whatever its trip count: the report says how
    many the path enters, so that a budget check can refuse an undercounted loop."""
    instructions, labels = _sass.parse(LOOPS_INSIDE)
    assert _sass.loops(instructions, labels) == [(0x10, 0x80), (0x30, 0x40), (0x60, 0x70)]
    r = report(LOOPS_INSIDE, "sm_80")
    assert r.path_instructions == 6  # 0x10, 0x20, 0x50, 0x60, 0x70, 0x80
    assert r.nested_loops == 1
    assert r.as_row()["nested_loops"] == 1
    assert report(FEATURE_BEHIND_A_BRANCH, "sm_80").nested_loops == 0
    assert report(NESTED, "sm_90a").nested_loops == 0  # the loop around the hot one is not inside it

# The warp-specialised forward's shape: its key loop (0x40..0x90) waits on an mbarrier whose retry
# ptxas puts after the kernel's end (0xb0..0xd0: TRYWAIT, @!P BRA to itself, BRA back to the
# instruction after the branch that entered it). An earlier wait (0x10), before the loop, has
# such a stub too (0xe0..0x100), whose jump back to 0x30 spans the loop: neither is a loop.
WAIT_STUBS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ;
        /*0020*/              @!P0 BRA `(.L_x_7) ;
.L_x_5:
        /*0030*/                   IADD3 R0, R0, 0x1, RZ ;
.L_x_0:
        /*0040*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR6], R2 ;
        /*0050*/              @!P0 BRA `(.L_x_2) ;
.L_x_3:
        /*0060*/                   HGMMA.64x128x16.F32 R24, gdesc[UR4], R24 ;
        /*0070*/                   MUFU.EX2 R3, R3 ;
        /*0080*/                   ISETP.GE.AND P1, PT, R0, R1, PT ;
        /*0090*/              @!P1 BRA `(.L_x_0) ;
        /*00a0*/                   EXIT ;
.L_x_2:
        /*00b0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR6], R2 ;
        /*00c0*/              @!P0 BRA `(.L_x_2) ;
        /*00d0*/                   BRA `(.L_x_3) ;
.L_x_7:
        /*00e0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ;
        /*00f0*/              @!P0 BRA `(.L_x_7) ;
        /*0100*/                   BRA `(.L_x_5) ;
"""


def test_an_mbarrier_wait_retried_out_of_line_is_no_loop():
    instructions, labels = _sass.parse(WAIT_STUBS)
    assert _sass.loops(instructions, labels) == [(0x40, 0x90), (0xb0, 0xc0), (0xe0, 0xf0)]
    r = _sass.hot_loop_report(instructions, labels, "sm_90a")
    assert (r.loop_instructions, r.path_instructions) == (6, 6)
    assert r.tensor_instructions == {"HGMMA.64x128x16.F32": 1}
    # a jump back that is not a stub's return (the code before it falls into it) stays a loop
    merged = WAIT_STUBS.replace("/*00a0*/                   EXIT ;", "/*00a0*/                   NOP ;")
    assert (0x60, 0xd0) in _sass.loops(*_sass.parse(merged))


def test_never_executed_padding_takes_a_slot_but_counts_in_no_class():
    text = FEATURE_BEHIND_A_BRANCH.replace("/*0060*/                   MUFU.EX2 R3, R3 ;",
                                           "/*0060*/              @!PT LDS RZ, [RZ] ;")
    r = report(text, "sm_80")
    assert r.path_instructions == 5 and r.counts == {"ldsm": 1}


def test_counters_cover_atomics_and_stores():
    instructions, _ = _sass.parse(NESTED)
    counted = [_sass.COUNTED.get(i.opcode.split(".")[0]) for i in instructions]
    assert counted.count("atomics") == 1 and counted.count("sts") == 1 and counted.count("bar") == 1


def test_no_tensor_loop_reports_nothing():
    text = FEATURE_BEHIND_A_BRANCH.replace("HMMA.16816.F32", "FFMA")
    r = report(text, "sm_80")
    assert r.issue_per_tensor is None and r.path_instructions == 0


@pytest.mark.parametrize("opcode, fma", [("HMMA.16816.F32", 2048), ("HMMA.16816.F32.BF16", 2048), ("HMMA.1688.F32", 1024),
                                         ("HGMMA.64x64x16.F32", 16384), ("HGMMA.64x256x16.F32.BF16", 65536)])
def test_tensor_work_per_instruction(opcode, fma):
    assert _sass.tensor_fma(opcode) == fma


def test_not_a_tensor_instruction_is_refused():
    with pytest.raises(ValueError, match="not a tensor-core instruction"):
        _sass.tensor_fma("FFMA")


def test_advisories_are_ptxas_warnings_and_performance_notes():
    clean = "ptxas info    : Used 166 registers, used 1 barriers\nptxas info    : Compile time = 330.671 ms\n"
    assert _sass.advisories(clean) == []
    noted = clean + ("ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized "
                     "due to the presence of Extern calls in the function\n"
                     "ptxas warning : Registers are spilled to local memory in function 'f', 8 bytes spill stores\n")
    found = _sass.advisories(noted)
    assert len(found) == 2 and "C7515" in found[0] and found[1].startswith("ptxas warning")


def test_garbage_is_refused():
    with pytest.raises(_sass.SassError, match="no instructions"):
        _sass.parse("not a disassembly")
    with pytest.raises(_sass.SassError, match="no cubin"):
        _sass.disassemble(b"")


def test_fastest_path_takes_the_shorter_of_two_copies_and_keeps_the_reductions():
    r = report(ALTERNATIVE_COPIES, "sm_80")
    # HMMA, BRA, NOP, 2 LDGSTS (the unchecked copy), BRA, 2 RED, BRA
    assert (r.loop_instructions, r.path_instructions) == (14, 9)
    assert r.counts == {"ldgsts": 2, "atomics": 2}
    # a vector reduction moving the same bytes replaces the two scalar ones: one instruction fewer
    vector = ALTERNATIVE_COPIES.replace(
        "/*00c0*/                   RED.E.ADD.F32.FTZ.RN.STRONG.GPU desc[UR4][R8.64], R9 ;",
        "/*00c0*/                   REDG.E.ADD.F32x2.FTZ.RN.STRONG.GPU desc[UR4][R8.64], R4 ;").replace(
        "/*00d0*/                   RED.E.ADD.F32.FTZ.RN.STRONG.GPU desc[UR4][R8.64+0x4], R5 ;\n", "")
    assert report(vector, "sm_80").path_instructions == 8


@pytest.mark.parametrize("opcode, expected", [("LDGSTS.E.BYPASS.128", 16), ("LDGSTS.E.64", 8), ("LDGSTS.E", 4),
                                              ("STS.128", 16), ("STS.U16", 0), ("RED.E.ADD.F32.FTZ.RN.STRONG.GPU", 4),
                                              ("REDG.E.ADD.F32x2.FTZ.RN.STRONG.GPU", 8), ("REDG.E.ADD.F32x4.FTZ", 16),
                                              ("REDUX.SUM", 0), ("FFMA", 0)])
def test_steady_bytes(opcode, expected):
    assert _sass.steady_bytes(_sass.Instruction(0, opcode)) == expected
    assert _sass.steady_bytes(_sass.Instruction(0, opcode, never=True)) == 0


# A backward-shaped wgmma loop (0x10..0xf0): S and dP issued as two groups, a wait that leaves dP
# in flight while the softmax's exponential issues (0x50, 0x60), a wait for dP, then dS (0x80,
# 0x90) with nothing in flight, dV issued, and the back-edge's test while dV runs; dV is retired
# by the next iteration's first wait, so it overlaps the loop's head too.
OVERLAPPED = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   WARPGROUP.ARRIVE ;
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0 ;
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R56, gdesc[UR8], RZ, !UPT, gsb0 ;
        /*0040*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0050*/                   MUFU.EX2 R24, R24 ;
        /*0060*/                   MUFU.EX2 R25, R25 ;
        /*0070*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0080*/                   FADD R56, R56, -R3 ;
        /*0090*/                   FMUL R56, R24, R56 ;
        /*00a0*/                   WARPGROUP.ARRIVE ;
        /*00b0*/                   HGMMA.64x128x16.F32.BF16 R88, R24, gdesc[UR12].tnspB, R88 ;
        /*00c0*/                   UIADD3 UR12, UR12, 0x40, URZ ;
        /*00d0*/                   HGMMA.64x128x16.F32.BF16 R88, R26, gdesc[UR12].tnspB, R88, gsb0 ;
        /*00e0*/                   ISETP.GE.AND P1, PT, R0, R1, PT ;
        /*00f0*/              @!P1 BRA `(.L_x_0) ;
        /*0100*/                   EXIT ;
"""


def test_exposed_instructions_are_those_issued_with_no_wgmma_in_flight():
    r = report(OVERLAPPED, "sm_90a")
    assert r.path_instructions == 15
    # with nothing in flight: the wait for dP itself and dS's two instructions, then the fence
    # before dV; the loop's head (dV from the last iteration in flight) and the UIADD3 between dV's
    # HGMMAs (the group open) are not
    assert r.exposed_instructions == 4
    tensor_cycles = 2 * 64 * 64 * 16 / 4 / 512 + 2 * 64 * 128 * 16 / 4 / 512
    assert r.exposed_per_tensor == pytest.approx(4 / tensor_cycles)
    # serialised: every group waited for at once, the exponentials exposed as well
    serial = OVERLAPPED.replace("WARPGROUP.DEPBAR.LE gsb0, 0x1 ;", "WARPGROUP.DEPBAR.LE gsb0, 0x0 ;")
    assert report(serial, "sm_90a").exposed_instructions == 7
    # and the last group retired before the back-edge: the loop's head waits exposed too
    drained = OVERLAPPED.replace("/*00e0*/                   ISETP.GE.AND P1, PT, R0, R1, PT ;",
                                 "/*00e0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;")
    assert report(drained, "sm_90a").exposed_instructions == 4 + 3  # + the wait, the branch, the head's fence


def test_mma_sync_loops_have_no_exposed_count():
    assert report(FEATURE_BEHIND_A_BRANCH, "sm_80").exposed_instructions is None
    assert report(FEATURE_BEHIND_A_BRANCH, "sm_80").as_row()["exposed_per_tensor"] is None


def test_a_wgmma_wait_without_its_count_is_refused():
    text = OVERLAPPED.replace("WARPGROUP.DEPBAR.LE gsb0, 0x1 ;", "WARPGROUP.DEPBAR.LE gsb0 ;")
    with pytest.raises(_sass.SassError, match="group count"):
        report(text, "sm_90a")


@pytest.mark.parametrize("opcode, operands, expected", [
    ("LDSM.16.M88.4", "R8, [R2]", 4), ("LDSM.16.MT88.4", "R8, [R2]", 4), ("LDSM.16.M88.2", "R8, [R2]", 2),
    ("LDSM.16.M88", "R8, [R2]", 1), ("STSM.16.M88.4", "[R2], R8", 4),
    ("LDS", "R7, [R3]", 1), ("LDS.U16", "R7, [R3]", 1), ("LDS.64", "R6, [R3]", 2), ("LDS.128", "R4, [R3]", 4),
    ("STS", "[R3], R7", 1), ("STS.64", "[R3], R6", 2), ("STS.128", "[R3], R4", 4), ("ATOMS.ADD", "RZ, [R3], R7", 1),
    ("LDGSTS.E.BYPASS.128", "[R6], desc[UR4][R10.64]", 4), ("LDGSTS.E.64", "[R6], desc[UR4][R10.64]", 2),
    ("LDGSTS.E.BYPASS.LTC128B.128", "[R6], desc[UR4][R10.64]", 4),
    # a wgmma's operands from shared memory, a quarter of the warpgroup's per warp: both (A's 64
    # rows and B's N, 32 bytes each per k-step) or B alone when A comes from registers
    ("HGMMA.64x128x16.F32", "R24, gdesc[UR4], RZ, !UPT", (64 + 128) * 32 / 128 / 4),
    ("HGMMA.64x128x16.F32.BF16", "R88, R24, gdesc[UR12].tnspB, R88", 128 * 32 / 128 / 4),
    ("HGMMA.64x64x16.F32", "R24, gdesc[UR4], R24, gsb0", (64 + 64) * 32 / 128 / 4),
    ("LDG.E.128", "R4, desc[UR4][R2.64]", 0), ("STG.E.128", "desc[UR4][R2.64], R4", 0), ("HMMA.16816.F32", "R4, R8, R12, R4", 0),
    ("FFMA", "R4, R4, R5, R6", 0)])
def test_shared_wavefronts(opcode, operands, expected):
    assert _sass.shared_wavefronts(_sass.Instruction(0, opcode, operands=operands)) == expected
    assert _sass.shared_wavefronts(_sass.Instruction(0, opcode, operands=operands, never=True)) == 0


def test_shared_per_tensor_weighs_the_paths_wavefronts_against_its_tensor_cycles():
    # one LDSM.x4 (4 wavefronts, each 4 cycles of a sub-partition's share) per HMMA.16816: 16
    # cycles against 8 on sm_80 and 4 on sm_90 (the fastest path skips the FMULs, not the LDSM)
    r = report(FEATURE_BEHIND_A_BRANCH, "sm_80")
    assert r.shared_wavefronts == 4
    assert r.shared_per_tensor == pytest.approx(4 * 4 / 8) and r.as_row()["shared_per_tensor"] == 2.0
    assert report(FEATURE_BEHIND_A_BRANCH, "sm_90").shared_per_tensor == pytest.approx(4 * 4 / 4)
    # the second HMMA and its cp.async chunk halve the ratio's tensor side and add 4 wavefronts
    both = report(TENSOR_WORK_BEHIND_A_BRANCH, "sm_80")
    assert both.shared_wavefronts == 8 and both.shared_per_tensor == pytest.approx(4 * 8 / 16)
    # the wgmma loop: S and dP read both operands from shared memory, dV reads B alone
    wgmma = report(OVERLAPPED, "sm_90a")
    assert wgmma.shared_wavefronts == 2 * (64 + 64) / 16 + 2 * 128 / 16
    assert wgmma.shared_per_tensor == pytest.approx(4 * wgmma.shared_wavefronts / wgmma.tensor_cycles)
    # a loop without tensor work has no ratio
    assert _sass.LoopReport().shared_per_tensor is None
