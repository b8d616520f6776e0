"""The emulator's memory counters on access patterns with known answers, and the tensor-core
kernels' conflict and coalescing ratios against their budgets (tests/memory_budgets.json)."""
import json
from pathlib import Path

import numpy as np
import pytest

from cupy_attn import _paths, emulator
from cupy_attn._memory_report import memory_report, ratio

HERE = Path(__file__).resolve().parent
BUDGETS = HERE / "memory_budgets.json"


@pytest.fixture(scope="module")
def counters_module():
    return emulator.RawModule((HERE / "emulator_kernels" / "counters.cu").read_text(),
                              options=("-I" + str(_paths.kernel_dir()),))


def line_of(text):
    lines = (HERE / "emulator_kernels" / "counters.cu").read_text().splitlines()
    return next(n for n, line in enumerate(lines, 1) if text in line)


def counted(fn, *args, threads=32, shared=4096):
    with emulator.counting() as c:
        fn(1, threads, args, shared_mem=shared)
    return c.sites


@pytest.mark.parametrize("stride, bytes_, wavefronts, ideal", [
    (4, 4, 1, 1),      # consecutive words: conflict-free
    (8, 4, 2, 1),      # every other word: two lanes per bank
    (128, 4, 32, 1),   # one bank for all 32 lanes
    (0, 4, 1, 1),      # one word for all: a broadcast
    (2, 2, 1, 1),      # 16-bit elements, two per word
    (8, 8, 2, 2),      # 8 bytes per lane: two half-warp phases, conflict-free
    (16, 16, 4, 4),    # 16 bytes per lane: four quarter-warp phases, conflict-free
    (128, 16, 32, 4),  # 16 bytes, lanes 128 bytes apart: every phase's 8 lanes on banks 0-3
    (32, 16, 8, 4),    # 16 bytes, lanes 32 bytes apart: 2-way
])
def test_shared_wavefronts(counters_module, stride, bytes_, wavefronts, ideal):
    (site,) = counted(counters_module.get_function("shared_pattern"), np.int32(stride), np.int32(bytes_))
    assert (site.space, site.accesses, site.lanes, site.actual, site.ideal) == ("shared", 1, 32, wavefronts, ideal)
    assert site.site == f"<kernel source>:{line_of('ATTN_LOAD_SHARED(sm + threadIdx.x * stride')}"


@pytest.mark.parametrize("stride, bytes_, sectors, ideal", [
    (4, 4, 4, 4),      # 128 contiguous bytes
    (32, 4, 32, 4),    # one sector per lane, 4 useful bytes each
    (16, 16, 16, 16),  # 512 contiguous bytes
    (0, 4, 1, 1),      # all lanes one word
    (2, 2, 2, 2),      # 64 contiguous bytes
])
def test_global_sectors(counters_module, stride, bytes_, sectors, ideal):
    data = np.zeros(1024 + 3, np.float32)[3:]  # misaligned on the host: sectors count from the array's start
    (site,) = counted(counters_module.get_function("global_pattern"), data, np.int32(stride), np.int32(bytes_))
    assert (site.space, site.actual, site.ideal) == ("global", sectors, ideal)


@pytest.mark.parametrize("row_bytes, wavefronts", [(16, 4), (144, 4), (128, 32), (64, 16)])
def test_ldmatrix_rows(counters_module, row_bytes, wavefronts):
    """Rows padded to 144 bytes (64 halves + 8, our layout) or packed are conflict-free; rows 128
    bytes apart put each matrix's 8 rows on the same 4 banks (8-way), 64 apart 4-way."""
    out = np.zeros(32, np.uint32)
    sites = counted(counters_module.get_function("ldmatrix_rows"), np.int32(row_bytes), out, shared=32 * row_bytes)
    (site,) = [s for s in sites if s.space == "shared"]
    assert (site.accesses, site.lanes, site.actual, site.ideal) == (1, 32, wavefronts, 4)


def test_each_iteration_is_its_own_warp_access_and_blocks_add_up(counters_module):
    with emulator.counting() as c:
        counters_module.get_function("repeated")(3, 64, (np.int32(5),), shared_mem=4096)
    (site,) = c.sites
    # 3 blocks x 2 warps x 5 iterations, each conflict-free
    assert (site.accesses, site.lanes, site.actual, site.ideal) == (30, 960, 30, 30)


def test_nothing_is_counted_outside_counting(counters_module):
    counters_module.get_function("shared_pattern")(1, 32, (np.int32(128), np.int32(4)), shared_mem=4096)
    with emulator.counting() as c:
        pass
    assert c.sites == []


def test_counting_sees_its_own_threads_launches_only(counters_module):
    """A counting() block counts the launches of its own thread: another thread's launches in the
    meantime, and a counting() block of that thread, are their own (a process-wide stack of
    counters gave the innermost block every thread's launches)."""
    import threading

    inside, go_on, theirs = threading.Event(), threading.Event(), {}

    def other():
        with emulator.counting() as c:
            inside.set()
            go_on.wait(60)
            counters_module.get_function("repeated")(1, 64, (np.int32(2),), shared_mem=4096)
        theirs["sites"] = c.sites

    worker = threading.Thread(target=other)
    worker.start()
    inside.wait(60)
    with emulator.counting() as mine:  # entered while the other thread's block is open
        launch = threading.Thread(target=lambda: counters_module.get_function("repeated")(1, 64, (np.int32(7),),
                                                                                        shared_mem=4096))
        launch.start()
        launch.join()
        go_on.set()
        worker.join()
        counters_module.get_function("repeated")(3, 64, (np.int32(5),), shared_mem=4096)
    (site,) = mine.sites
    assert site.accesses == 30  # this thread's launch alone: 3 blocks x 2 warps x 5
    (site,) = theirs["sites"]
    assert site.accesses == 4  # the other block's own launch: 1 block x 2 warps x 2


def test_counting_a_shared_address_outside_shared_memory_fails(counters_module):
    with pytest.raises(emulator.EmulatorError, match="not in the block's 64 bytes of dynamic shared memory"):
        counted(counters_module.get_function("shared_pattern"), np.int32(4), np.int32(4), shared=64)


def test_a_strided_views_elements_are_inside_it(counters_module):
    """A view's span runs from its lowest element to its highest, past its nbytes: 32 lanes
    reading the first float of each of 32 rows of a (32, 8) view of a (32, 40) array (its
    nbytes, 1 KB, ends at row 6)."""
    rows = np.zeros((32, 40), np.float32)[:, :8]
    (site,) = counted(counters_module.get_function("global_pattern"), rows, np.int32(160), np.int32(4))
    assert (site.space, site.actual, site.ideal) == ("global", 32, 4)
    with pytest.raises(emulator.EmulatorError, match="is not inside an array argument"):
        counted(counters_module.get_function("global_pattern"), rows[:31], np.int32(160), np.int32(4))


def test_counting_a_global_address_outside_the_arrays_fails(counters_module):
    with pytest.raises(emulator.EmulatorError, match="is not inside an array argument"):
        counted(counters_module.get_function("global_pattern"), np.zeros(8, np.float32), np.int32(4), np.int32(4))


def test_tensor_core_kernels_stay_within_their_memory_budgets():
    """Shared-memory wavefronts and global sectors over their minimum, per kernel (D = 64, both
    tensor-core families with the backward's preprocess, and the decoding kernel): a change may
    lower a ratio; raising one means raising its budget on purpose. (The preprocess read a row
    per thread before: 16 times its minimum.)"""
    budgets = json.loads(BUDGETS.read_text())
    rows = memory_report(head_dims=(64,))
    seen = set()
    for r in rows:
        key = f"{r['family']} D={r['head_dim']} {r['pass']}: {r['kernel']}"
        seen.add(key)
        assert key in budgets, f"no budget for {key}"
        gmem = ratio(r["gmem_sectors"], r["gmem_ideal"])
        assert gmem <= budgets[key]["gmem"] + 5e-3 and r["gmem_ideal"] > 0, (key, gmem)
        if budgets[key]["smem"] is None:  # a kernel of global memory alone (the backward's preprocess)
            assert r["smem_wavefronts"] == r["smem_ideal"] == 0, key
            continue
        smem = ratio(r["smem_wavefronts"], r["smem_ideal"])
        assert smem <= budgets[key]["smem"] + 5e-3 and r["smem_ideal"] > 0, (key, smem)
    assert seen == {k for k in budgets if " D=64 " in k}
