"""The order in which the tensor-core kernels' blocks start (kernels/block_info.cuh,
query_block_place and key_block_place; cupy_attn/_schedule.py): the grid and order by hand, the
device's mapping against its Python twin, the sections' sizes, the division it relies on, and
the kernels' results when sections split the (batch entry, head) pairs."""
import sys
from pathlib import Path

import numpy as np
import pytest

import cupy_attn
from cupy_attn import _compile, _config, _kernel_backend, _paths, _problem, _schedule
from cupy_attn.emulator import RawModule
from helpers import BF16, check_forward_and_backward, random_qkv, recorded_launches

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_launch_order_by_hand():
    # 3 query tiles of 2 heads (one batch entry), one pair per section: each pair's tiles in turn,
    # the last tile first
    assert _schedule.sectioned_grid(3, 2, 1) == (1, 3, 2)
    assert _schedule.launch_order((1, 3, 2), 2, True) == [(2, 0, 0), (1, 0, 0), (0, 0, 0), (2, 1, 0), (1, 1, 0),
                                                          (0, 1, 0)]
    # key tiles: the first first
    assert _schedule.launch_order((1, 3, 2), 2, False) == [(0, 0, 0), (1, 0, 0), (2, 0, 0), (0, 1, 0), (1, 1, 0),
                                                           (2, 1, 0)]
    # both pairs in one section: rank by rank
    assert _schedule.launch_order(_schedule.sectioned_grid(3, 2, 2), 2, True) == [(2, 0, 0), (2, 1, 0), (1, 0, 0),
                                                                                  (1, 1, 0), (0, 0, 0), (0, 1, 0)]
    # 2 heads of 2 entries, pairs (head, entry) (0, 0), (1, 0), (0, 1), (1, 1), in sections of 2 and of 4
    assert _schedule.launch_order((2, 2, 2), 2, True) == [(1, 0, 0), (1, 1, 0), (0, 0, 0), (0, 1, 0),
                                                          (1, 0, 1), (1, 1, 1), (0, 0, 1), (0, 1, 1)]
    assert _schedule.launch_order((4, 1, 1), 2, False) == [(0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1)]


@pytest.mark.parametrize("tiles,heads,entries", [(1, 1, 1), (5, 3, 2), (4, 7, 1), (3, 1, 5), (2, 6, 2)])
@pytest.mark.parametrize("last_tile_first", [True, False], ids=["queries", "keys"])
def test_launch_order_starts_every_tile_once_heaviest_first_within_a_section(tiles, heads, entries, last_tile_first):
    pairs = heads * entries
    for section in (s for s in range(1, pairs + 1) if pairs % s == 0):
        order = _schedule.launch_order(_schedule.sectioned_grid(tiles, pairs, section), heads, last_tile_first)
        assert sorted(order) == sorted((t, h, e) for t in range(tiles) for h in range(heads) for e in range(entries))
        for first in range(0, pairs, section):
            part = order[first * tiles:(first + section) * tiles]
            assert {h + heads * e for _, h, e in part} == set(range(first, first + section))  # the section's pairs only
            assert [t for t, _, _ in part] == sorted((t for t, _, _ in part), reverse=last_tile_first)


def test_query_grid_refuses_what_it_cannot_lay_out():
    with pytest.raises(ValueError, match="divisor of the 6 pairs, got 4"):
        _schedule.sectioned_grid(2, 6, 4)
    with pytest.raises(ValueError, match="at most 65535 tiles"):
        _schedule.sectioned_grid(65536, 2, 1)


def test_heads_per_section_by_hand(monkeypatch):
    monkeypatch.setattr(_schedule, "L2_SHARE", 1.0)
    assert _schedule.heads_per_section(10, 8, 40) == 4     # 4 fit: two sections of 4
    assert _schedule.heads_per_section(10, 8, 70) == 4     # 7 fit: the largest divisor of 8 below, 4
    assert _schedule.heads_per_section(10, 12, 50) == 4    # 5 fit: of 12's divisors, 4
    assert _schedule.heads_per_section(10, 8, 1000) == 8   # all fit: one section
    assert _schedule.heads_per_section(10, 8, 5) == 1      # none fits: one pair at a time
    assert _schedule.heads_per_section(0, 8, 5) == 8       # nothing shared
    assert _schedule.heads_per_section(10, 7, 50) == 1     # 5 fit, but 7 is prime
    # GQA groups of 2 heads (one kv head's K and V): 3 groups fit, of 4; 2 groups divide 4
    assert _schedule.heads_per_section(10, 8, 30, group=2) == 4
    assert _schedule.heads_per_section(10, 8, 5, group=2) == 2  # a group even where one pair does not fit
    assert _schedule.heads_per_section(10, 0, 30) == 1  # no pairs (nothing is launched)
    # at most 65535 sections (the grid's z), however little fits
    assert _schedule.heads_per_section(10, 2 * 65536, 5) == 4
    monkeypatch.setattr(_schedule, "L2_SHARE", 0.5)
    assert _schedule.heads_per_section(10, 8, 60) == 2  # the share of the L2, not all of it: 3 fit


@pytest.mark.parametrize("args,what", [((10, 8, 30, 0), "group = 0"), ((10, 7, 30, 2), "pairs = 7"),
                                       ((-1, 8, 30, 1), "shared_bytes = -1")])
def test_heads_per_section_refuses_what_it_cannot_size(args, what):
    with pytest.raises(ValueError, match=what):
        _schedule.heads_per_section(*args)


def test_division_magic_divides_every_pair_index_exactly():
    """query_block_place's pair // heads as a multiply-high and a shift, checked for every head
    count against the pair indices where the rounding could slip: 0, around each multiple of the
    divisor near 2^31, and the largest."""
    top = 2**31 - 1
    for d in range(1, 2**16):
        magic, shift = _schedule.division_magic(d)
        assert 0 < magic < 2**32
        k = top // d
        n = np.array([0, 1, d - 1, d, d + 1, (k - 1) * d, k * d - 1, k * d, top], dtype=np.uint64)
        n = n[n <= top]
        got = (((2 * n * np.uint64(magic)) >> np.uint64(32)) >> np.uint64(shift))
        np.testing.assert_array_equal(got, n // np.uint64(d), err_msg=str(d))
    for bad in (0, 2**16):
        with pytest.raises(ValueError, match="divisor in"):
            _schedule.division_magic(bad)


def test_a_wrong_magic_number_is_caught():
    """The check above can fail: one less than the magic number divides some indices wrongly."""
    d = 7
    magic, shift = _schedule.division_magic(d)
    n = np.arange(2**31 - 2**20, 2**31, dtype=np.uint64)
    got = (((2 * n * np.uint64(magic - 1)) >> np.uint64(32)) >> np.uint64(shift))
    assert (got != n // np.uint64(d)).any()


def test_query_grid_of_a_call(monkeypatch):
    """A call's sections: K and V of its kv heads (a GQA group of q heads shares them), against
    the device's L2 (the emulator's stand-in here)."""
    q, k, v = random_qkv(np.random.default_rng(0), b=2, h=6, hkv=3, sq=40, sk=100, d=16, dv=8, dtype=np.float16)
    problem = _problem.make_problem(q, k, v, backend="emulator")
    monkeypatch.setattr(_schedule, "L2_SHARE", 1.0)
    kv_bytes = 100 * (16 + 8) * 2
    for kv_heads_fit, section in ((1, 2), (2, 4), (3, 6), (5, 6), (6, 12)):
        monkeypatch.setattr(_kernel_backend, "EMULATOR_L2_BYTES", kv_heads_fit * kv_bytes)
        assert _kernel_backend._query_grid(problem, "emulator", 16) == (section, 3, 12 // section), kv_heads_fit


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=str)
def test_too_many_query_tiles_are_refused_before_any_kernel_runs(monkeypatch, dtype):
    """fp16/bf16: at most 65535 query tiles of 64 rows, the tensor-core forwards' and dQ's grid
    (a deterministic backward would otherwise stop at its dQ, after the others ran); fp32 runs on
    CUDA cores, whose grid has room."""
    monkeypatch.setattr(_kernel_backend, "_launch", lambda *a, **kw: pytest.fail("a kernel was launched"))
    q, k, v = random_qkv(np.random.default_rng(0), b=1, h=1, sq=65535 * 64 + 1, sk=1, d=1, dtype=dtype)
    what = r"float16/bfloat16 calls take at most 65535 query tiles of 64 rows \(seq_q up to 4194240\), got seq_q = 4194241"
    with pytest.raises(ValueError, match=what):
        cupy_attn.attention(q, k, v, backend="emulator")
    out = np.zeros(q.shape, dtype)
    lse = np.zeros((1, 1, q.shape[2]), np.float32)
    with pytest.raises(ValueError, match=what):
        cupy_attn.attention_backward(out, q, k, v, out, lse, backend="emulator", deterministic=True)
    ok = q[:, :, :65535 * 64]
    assert _kernel_backend._query_grid(_problem.make_problem(ok, k, v, backend="emulator"), "emulator", 64)[1] == 65535


@pytest.fixture(scope="module")
def places():
    source = (Path(__file__).parent / "emulator_kernels" / "block_place.cu").read_text()
    return RawModule(source, options=("-I" + str(_paths.kernel_dir()),))


@pytest.mark.parametrize("tiles,heads,entries", [(1, 1, 1), (5, 3, 2), (4, 7, 1), (3, 2, 3), (2, 6, 2)])
@pytest.mark.parametrize("keys", [False, True], ids=["query_block_place", "key_block_place"])
def test_the_kernels_order_is_its_twins(places, tiles, heads, entries, keys):
    """query_block_place and key_block_place, compiled from kernels/block_info.cuh and run on the
    emulator, give every block of every section size the tile, head and entry launch_order gives
    its linear index."""
    pairs = heads * entries
    magic, shift = _schedule.division_magic(heads)
    for section in (s for s in range(1, pairs + 1) if pairs % s == 0):
        grid = _schedule.sectioned_grid(tiles, pairs, section)
        out = np.full((tiles * pairs, 3), -1, np.int32)
        places.get_function("places")(grid, (32,), (out, np.int32(heads), np.uint32(magic), np.int32(shift),
                                                    np.int32(keys)))
        assert [tuple(row) for row in out] == _schedule.launch_order(grid, heads, not keys), section


@pytest.mark.parametrize("tiles,heads,entries", [(1, 1, 1), (5, 3, 2), (4, 7, 1), (3, 2, 3), (2, 6, 2)])
def test_the_persistent_forwards_work_tiles_are_the_sectioned_grids_blocks(places, tiles, heads, entries):
    """WorkTiles (kernels/block_info.cuh), the persistent wgmma forward's walk: on 1, 2, 5 blocks
    or one per work tile, each block starting with its own work tile and claiming the next on a
    counter, every work tile is taken once and gets the place the sectioned grid's block of its
    index gets in launch order; the counter ends at the work tiles past the grid plus one failed
    claim per block."""
    pairs = heads * entries
    magic, shift = _schedule.division_magic(heads)
    for section in (s for s in range(1, pairs + 1) if pairs % s == 0):
        grid = _schedule.sectioned_grid(tiles, pairs, section)
        total = grid[0] * grid[1] * grid[2]
        for blocks in sorted({min(b, total) for b in (1, 2, 5, total)}):
            out = np.full((total, 3), -1, np.int32)
            taken, claims = np.zeros(total, np.int32), np.zeros(1, np.uint32)
            places.get_function("work_places")((blocks,), (32,), (out, taken, claims, np.int32(heads), np.uint32(magic),
                                                                  np.int32(shift), np.int32(grid[0]), np.int32(grid[1]),
                                                                  np.int32(total)))
            assert [tuple(row) for row in out] == _schedule.launch_order(grid, heads, True), (section, blocks)
            assert taken.tolist() == [1] * total and claims[0] == total, (section, blocks)


@pytest.mark.parametrize("dtype,capability", [(np.float32, 80), (np.float16, 80), (np.float16, 90)],
                         ids=["cuda_cores", "mma_sync", "wgmma"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_kernels_in_sections(monkeypatch, dtype, capability, deterministic):
    """Forward and backward with the 12 (batch entry, head) pairs split into sections, outputs
    poisoned: every block of the tensor-core kernels finds its tile, head and entry (a decode one
    off fails here, as checked); the CUDA-core kernels keep the grid (tiles, heads, batch
    entries)."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", capability)
    monkeypatch.setattr(_kernel_backend, "POISON_OUTPUTS", True)
    monkeypatch.setattr(_schedule, "L2_SHARE", 1.0)
    # fp16: a kv head's K and V take 170 x 128 x 2 = 43,520 bytes, 3 fit (3 GQA groups of 2 heads:
    # 2 sections of 6 pairs); a head's Q, dO, lse and delta 200 x (128 x 2 + 8) = 52,800, 3 fit (4
    # sections of 3 pairs)
    monkeypatch.setattr(_kernel_backend, "EMULATOR_L2_BYTES", 160_000)
    grids, launched = recorded_launches(monkeypatch), []
    real_function = _compile.function
    monkeypatch.setattr(_compile, "function",
                        lambda target, f, name, **kw: launched.append(name) or real_function(target, f, name, **kw))
    rng = np.random.default_rng(capability + deterministic)
    # (batch, seq, head) rows and lengths per entry: a block given the wrong head or entry reads
    # other rows (in (batch, head, seq) rows head 6 + h of entry 0 would be entry 1's head h)
    q, k, v = random_qkv(rng, b=2, h=6, hkv=3, sq=200, sk=170, d=64, dtype=dtype, layout="bshd")
    kw = dict(causal=True, layout="bshd", q_lengths=np.array([200, 151]), kv_lengths=np.array([170, 97]))
    check_forward_and_backward("emulator", rng, q, k, v, kw, np.dtype(dtype), deterministic=deterministic)
    query_tiled = [g for name, g in grids if name.startswith(("attention_fwd", "attention_bwd_dq"))]
    key_tiled = [g for name, g in grids if name.startswith("attention_bwd_dkdv")]
    assert len(query_tiled) == 1 + deterministic and len(key_tiled) == 1, grids
    if dtype == np.float32:
        assert all(g[1:] == (6, 2) for g in query_tiled + key_tiled), grids
    else:
        # the wgmma forward: the sectioned grid's 6 x 2 x 2 blocks as work tiles (WorkTiles), which
        # the emulator's SMs' blocks claim
        sectioned = [g for name, g in grids if name.startswith(("attention_fwd_tc", "attention_bwd_dq"))]
        assert all(g[0] == 6 and g[2] == 2 for g in sectioned) and key_tiled[0][0] == 3 and key_tiled[0][2] == 4, grids
        work_tiles = [g for name, g in grids if name.startswith("attention_fwd_wgmma")]
        assert work_tiles == ([(_kernel_backend.EMULATOR_SMS, 1, 1)] if capability == 90 else []), grids
    if capability == 90:
        assert any("_wgmma<" in name for name in launched)


def test_the_wide_mma_sync_dkdv_keeps_the_grid(monkeypatch):
    """The mma.sync dK/dV above D = 128 decodes its place from (key tiles, heads, batch entries)
    (grid_place: key_block_place made it spill at D = 256); the launcher agrees."""
    assert [t.sectioned for t in _config.TENSOR_CORE_BACKWARD_TILES] == [t.head_dim <= 128
                                                                          for t in _config.TENSOR_CORE_BACKWARD_TILES]
    monkeypatch.setattr(_kernel_backend, "POISON_OUTPUTS", True)
    grids = recorded_launches(monkeypatch)
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, b=2, h=2, sq=40, sk=70, d=256, dtype=np.float16, layout="bshd")
    check_forward_and_backward("emulator", rng, q, k, v, dict(causal=True, layout="bshd"), np.dtype(np.float16))
    # 3 key tiles of 32 keys, 2 heads, 2 entries (a sectioned grid would be (4, 3, 1))
    assert [g for name, g in grids if name.startswith("attention_bwd_dkdv_tc<")] == [(3, 2, 2)], grids


def test_a_large_grid_in_one_section_on_the_emulator(monkeypatch):
    """The emulator's default L2 holds every pair of a small call: one section, rank by rank."""
    launches = recorded_launches(monkeypatch)
    q, k, v = random_qkv(np.random.default_rng(1), b=3, h=5, sq=70, sk=70, d=16, dtype=np.float16)
    cupy_attn.attention(q, k, v, causal=True, backend="emulator")
    grid = launches[0][1]
    assert grid[0] == 15 and grid[2] == 1


def schedule_model():
    sys.path.insert(0, str(BENCH))
    try:
        import schedule_model
    finally:
        sys.path.pop(0)
    return schedule_model


def test_the_modelled_tail_of_the_benchmarks_causal_calls_is_shorter():
    """bench/schedule_model.py on an H200 (132 SMs, 50 MiB of L2), one and two blocks per SM: no
    forward or dK/dV launch of the benchmark models a longer tail than the grid's former order
    gave, the causal ones a shorter one on average, and the rows the running blocks share stay
    within the L2. (A model's budget, as the SASS audit's: what a GPU measures decides.)"""
    rows = schedule_model().model_rows(132, 50 * 2**20, (1, 2))
    assert len(rows) == 2 * 4 * 5 * 2 * 2  # D, kernels (two families' forward and dK/dV), S, causal, blocks per SM
    assert [r for r in rows if r["tail_now"] > r["tail_before"] + 5e-4] == []
    for kernel in ("forward", "dK/dV"):
        for per_sm in (1, 2):
            causal = [r for r in rows if r["kernel"].startswith(kernel) and r["causal"] and r["blocks_per_sm"] == per_sm]
            assert sum(r["tail_before"] - r["tail_now"] for r in causal) / len(causal) > 0.02, (kernel, per_sm)
    assert max(r["shared_now"] for r in rows) <= 50 * 2**20


def test_the_model_by_hand():
    model = schedule_model()
    # 3 tiles of work 1, 2, 3 on 2 slots: lightest first leaves the 3 to start at 1 (ends at 4);
    # heaviest first ends at 3, the bound (6 / 2)
    work = [1, 2, 3]
    light_first = [(0, 0, 0), (1, 0, 0), (2, 0, 0)]
    assert model.simulate(light_first, work, 2, 7) == (4 / 3 - 1, 7)
    assert model.simulate(light_first[::-1], work, 2, 7) == (0.0, 7)
    # two pairs running at once share twice a pair's rows
    assert model.simulate([(0, 0, 0), (0, 1, 0)], [1], 2, 7) == (0.0, 14)
    # causal work at Sq = Sk = 300: query tiles of 128 rows over key tiles of 64, key tiles of 128 over 64 rows
    assert [model.tile_work("queries", t, 300, 128, 64, True) for t in range(3)] == [2, 4, 5]
    assert [model.tile_work("keys", t, 300, 128, 64, True) for t in range(3)] == [5, 3, 1]
    assert model.tile_work("keys", 2, 300, 128, 64, False) == 5
    # a fixed turn of 2 slots over work 3, 2, 1: slot 0 takes 3 and 1 (4), against the bound 3
    assert model.fixed_turn(light_first[::-1], work, 2) == 4 / 3 - 1
    # persistent slots claiming ahead over work 2, 1, 3: claiming half a tile ahead, slot 1 (at 0.5)
    # before slot 0 (at 1.5), the 3 runs from 1 (ends at 4, as on the slot that frees first);
    # claiming 2 ahead, both at 0, slot 0 first, from 2 (ends at 5), against the bound 3
    order = [(1, 0, 0), (0, 0, 0), (2, 0, 0)]
    assert model.simulate(order, work, 2, 7)[0] == model.claimed_ahead(order, work, 2, 0.5) == 4 / 3 - 1
    assert model.claimed_ahead(order, work, 2, 2) == 5 / 3 - 1


def test_persistent_blocks_claiming_ahead_keep_the_tail_of_blocks_on_free_sms():
    """Why the persistent wgmma forward's blocks claim work tiles (WorkTiles::claim) rather than
    take them in a fixed turn: in the model, over the benchmark's calls on one block per SM,
    claiming two tiles ahead of the end gives the tail of blocks handed to the SM that frees first,
    causal calls included, while a fixed turn keeps only the non-causal calls' tail and leaves
    causal ones at D = 128 a long one."""
    rows = [r for r in schedule_model().model_rows(132, 50 * 2**20, (1,)) if r["kernel"] == "forward wgmma"]
    assert len(rows) == 2 * 5 * 2
    assert all(abs(r["tail_claimed_ahead"] - r["tail_now"]) < 5e-3 for r in rows)
    assert all(abs(r["tail_fixed_turn"] - r["tail_now"]) < 5e-4 for r in rows if not r["causal"])
    assert min(r["tail_fixed_turn"] for r in rows if r["causal"] and r["D"] == 128) > 0.3


def test_too_many_key_tiles_are_refused_before_any_kernel_runs(monkeypatch):
    """fp16/bf16 backward up to D = 128: at most 65535 key tiles of 64 keys, the dK/dV kernels'
    grid (wider heads take the mma.sync dK/dV on the grid (key tiles, heads, batch entries))."""
    launched = []
    monkeypatch.setattr(_kernel_backend, "_launch", lambda target, f, name, *a, **kw: launched.append(name))
    q, k, v = random_qkv(np.random.default_rng(0), b=1, h=1, sq=2, sk=65535 * 64 + 1, d=1, dtype=np.float16)
    out, lse = np.zeros(q.shape, np.float16), np.zeros((1, 1, 2), np.float32)
    what = (r"the float16/bfloat16 backward up to D = 128 takes at most 65535 key tiles of 64 keys "
            r"\(seq_k up to 4194240\), got seq_k = 4194241")
    with pytest.raises(ValueError, match=what):
        cupy_attn.attention_backward(out, q, k, v, out, lse, backend="emulator")
    assert launched == []


@pytest.mark.parametrize("b,h,what", [(2, 65536, "at most 65535 heads and batch entries per call, got H = 65536, B = 2"),
                                      (32769, 65535, r"fewer than 2\^31 \(batch entry, head\) pairs per call, got H = 65535, "
                                                     "B = 32769")])
def test_grids_past_the_limits_are_refused(b, h, what):
    """Empty (no query rows), so only the sizes are at stake: the kernels' grids and the
    sectioned grids' pair index bound them."""
    q = np.empty((b, h, 0, 1), np.float16)
    with pytest.raises(ValueError, match=what):
        cupy_attn.attention(q, q, q, backend="emulator")
