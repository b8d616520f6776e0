"""The CUDA forward kernel, run on the CPU by the emulator, against the float64 reference.

Outputs are poisoned with NaN before every launch, so an element the kernel fails to write shows.
"""
import logging
import sys
import types

import numpy as np
import pytest

import cupy_attn
from cupy_attn import _compile, _config, _kernel_backend, _problem, emulator, reference
from helpers import BF16, assert_close, random_qkv, recorded_launches, tma_addressable
from test_forward import FEATURES, feature_keywords

KERNEL_DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(_kernel_backend, "POISON_OUTPUTS", True)


@pytest.fixture(params=["random", "warps"])
def schedule(request, monkeypatch):
    monkeypatch.setattr(_kernel_backend, "EMULATOR_SCHEDULE", request.param)
    return request.param


@pytest.fixture(params=[80, 90], ids=["mma_sync", "wgmma"])
def tensor_core_kernel(request, monkeypatch):
    """fp16/bf16 inputs on the mma.sync forward (compute capability 8.x) or the Hopper wgmma
    forward (9.0), which the emulator runs when it stands in for an sm_90 device."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", request.param)
    return request.param


def check(q, k, v, dtype, **kw):
    out, lse = cupy_attn.attention(q, k, v, backend="emulator", return_lse=True, **kw)
    want_out, want_lse = reference.attention(q, k, v, **kw)
    assert out.dtype == dtype and lse.dtype == np.float32
    assert_close(out, want_out, dtype, what="out")
    assert_close(lse, want_lse, dtype, what="lse")
    return out, lse


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("d,dv", [(16, 16), (40, 40), (64, 64), (80, 80), (96, 96), (128, 128), (256, 256),
                                  (1, 1), (7, 33), (200, 72), (64, 128), (130, 3)])
def test_head_dims(schedule, dtype, d, dv):
    rng = np.random.default_rng(d * 1000 + dv)
    q, k, v = random_qkv(rng, b=2, h=2, hkv=1, sq=37, sk=70, d=d, dv=dv, dtype=dtype)
    check(q, k, v, dtype, causal=True)


@pytest.mark.parametrize("d,dtype,kw", [
    (24, np.dtype(np.float16), dict(causal=True)), (64, BF16, dict(causal="top_left")),
    (100, np.dtype(np.float16), dict(kv_lengths=[400, 200])), (64, np.dtype(np.float16), dict(alibi_slopes=[0.2, 0.05])),
    (64, BF16, dict(mask=np.arange(400) % 5 > 0))], ids=["d24-causal", "d64-top_left", "d100-lengths", "d64-alibi", "d64-mask"])
def test_softcap_builds_with_more_exp2_on_the_fma_units(tensor_core_kernel, d, dtype, kw):
    """Softcap builds take a share of the softmax's exp2 on the FMA units (exp2_polynomial) in
    interior tiles: 3 of 4 at D = 32 and 2 of 3 at D = 64 in the mma.sync forward with softcap
    alone, 5 of 6 (D = 64) and 2 of 3 (D = 128) in the wgmma one, at D = 64 there 3 of 4 with
    ALiBi beside it and 2 of 3 with a mask; every 2nd in boundary tiles and with other features.
    Interior and boundary tiles (causal of both alignments, key lengths) against the reference."""
    rng = np.random.default_rng(d + len(kw))
    q, k, v = random_qkv(rng, b=2, h=2, hkv=1, sq=150, sk=400, d=d, dtype=dtype)
    check(*(tma_addressable(x) for x in (q, k, v)), dtype, softcap=4.0,
          **{key: np.array(x, np.int32) if key.endswith("lengths") else x for key, x in kw.items()})


@pytest.mark.parametrize("feature", ["softcap", "bool_mask", "float_mask", "lengths_causal", "top_left_window",
                                     "alibi_h", "everything"])
@pytest.mark.parametrize("d,dv", [(256, 256), (200, 136)])
def test_mma_sync_forward_at_d256_with_score_features(monkeypatch, schedule, feature, d, dv):
    """The mma.sync forward at D = 256 holds each warp's rows of Q in registers in builds without
    ALiBi, dropout or mods (softcap, masks, lengths, windows) and reads them from shared memory in
    the others (ALiBi; everything): both against the reference, on awkward sizes (113 queries:
    a last block of 49 rows, 203 keys: a last tile of 11)."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", 80)
    launches = recorded_launches(monkeypatch)
    rng = np.random.default_rng(d + dv + len(feature))
    q, k, v = random_qkv(rng, b=3, h=4, hkv=2, sq=113, sk=203, d=d, dv=dv, dtype=np.float16)
    check(q, k, v, np.float16, **feature_keywords(feature, rng))
    assert [name for name, _ in launches] == [_config.forward_tile(d, dv, np.float16, 80).name_expression(np.float16)]


@pytest.mark.parametrize("shape", [dict(b=0), dict(sq=0), dict(sk=0)])
def test_wgmma_forward_of_nothing_builds_no_map_and_says_nothing(monkeypatch, caplog, shape):
    """An empty batch or query axis launches nothing, and no keys leave every row dead (out 0, lse
    -inf, from the mma.sync forward): no tensor map is built (TMA refuses an axis of no entries),
    so no fallback is announced."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", 90)
    monkeypatch.setattr(_kernel_backend, "_SAID", set())
    caplog.set_level(logging.WARNING, logger="cupy_attn")
    q, k, v = random_qkv(np.random.default_rng(3), **dict(dict(b=2, h=2, sq=5, sk=9, d=64, dtype=np.float16), **shape))
    out, lse = cupy_attn.attention(q, k, v, backend="emulator", return_lse=True)
    assert out.shape == q.shape and caplog.text == ""
    assert (out == 0).all() and (lse == -np.inf).all()


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=str)
@pytest.mark.parametrize("d,dv", [(16, 16), (64, 64), (80, 80), (128, 128), (256, 256), (7, 33), (200, 72), (130, 3)])
def test_wgmma_head_dims(monkeypatch, schedule, dtype, d, dv):
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", 90)
    launched = []
    real_function = _compile.function
    monkeypatch.setattr(_compile, "function", lambda target, f, name, **kw: launched.append(name) or real_function(target, f, name, **kw))
    rng = np.random.default_rng(d * 1000 + dv + 1)
    q, k, v = random_qkv(rng, b=2, h=2, hkv=1, sq=77, sk=150, d=d, dv=dv, dtype=dtype)
    # q, k and v in rows padded to 16 bytes, as TMA needs (contiguous rows of 7 or 3 elements are
    # not addressable: such calls run the mma.sync forward), so every case runs the wgmma forward;
    # out gets such rows from the launcher (a contiguous copy is returned where Dv is not a
    # multiple of 8).
    q, k, v = (tma_addressable(x) for x in (q, k, v))
    check(q, k, v, dtype, causal=True)
    assert len(launched) == 1 and launched[0].startswith("attention_fwd_wgmma<"), launched


@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 203), (7, 7), (113, 203), (203, 113), (64, 64), (65, 129), (257, 31)])
@pytest.mark.parametrize("causal", [False, True, "top_left"])
def test_sequence_lengths(schedule, sq, sk, causal):
    rng = np.random.default_rng(sq * 7 + sk)
    q, k, v = random_qkv(rng, b=2, h=2, sq=sq, sk=sk, d=64)
    check(q, k, v, np.float32, causal=causal)


@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("sq,sk", [(1, 203), (7, 7), (113, 203), (203, 113), (257, 31)])
@pytest.mark.parametrize("causal", [False, True, "top_left"])
def test_row_tiles_of_the_128_row_forward(schedule, d, sq, sk, causal):
    """The mma.sync forward up to D = 128 takes 128 query rows per block (at D = 128 with tiles of
    32 keys, for calls without a mask or mods), two row tiles of 16 rows per warp, 64 rows apart:
    blocks whose second row tile is partly or wholly past the sequence, and causal rows of one
    warp that see different key tiles."""
    assert _config.forward_tile(d, d, np.float16).block_m == 128
    rng = np.random.default_rng(sq * 11 + sk + d)
    for dtype in (np.dtype(np.float16), BF16):
        q, k, v = random_qkv(rng, b=1, h=2, hkv=1, sq=sq, sk=sk, d=d, dtype=dtype)
        check(q, k, v, dtype, causal=causal)


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=str)
def test_features(feature, layout, dtype):
    rng = np.random.default_rng(len(feature) * 31 + len(layout))
    q, k, v = random_qkv(rng, b=3, h=4, hkv=2, sq=113, sk=203, d=40, dv=24, dtype=dtype, layout=layout)
    check(q, k, v, dtype, layout=layout, **feature_keywords(feature, rng))


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_wgmma_features(monkeypatch, feature, layout):
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", 90)
    rng = np.random.default_rng(len(feature) * 37 + len(layout))
    q, k, v = random_qkv(rng, b=3, h=4, hkv=2, sq=113, sk=203, d=40, dv=24, dtype=np.float16, layout=layout)
    check(q, k, v, np.float16, layout=layout, **feature_keywords(feature, rng))


@pytest.mark.parametrize("d,dv", [(100, 100), (200, 136)])
@pytest.mark.parametrize("feature", ["everything", "softcap", "window_both"])
def test_wgmma_tiles_of_calls_with_features(monkeypatch, schedule, d, dv, feature):
    """Calls with score features at D > 64 take the wgmma forward's tiles of 64 and 32 keys (plain
    calls 128 and 64; both overlap the softmax of one tile with P·V of the previous); a window
    alone is no score feature, so it keeps the plain tile."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", 90)
    launched = []
    real_function = _compile.function
    monkeypatch.setattr(_compile, "function", lambda target, f, name, **kw: launched.append(name) or real_function(target, f, name, **kw))
    rng = np.random.default_rng(d + len(feature))
    q, k, v = random_qkv(rng, b=3, h=4, hkv=2, sq=113, sk=203, d=d, dv=dv, dtype=np.float16)
    check(*(tma_addressable(x) for x in (q, k, v)), np.float16, **feature_keywords(feature, rng))
    plain = feature == "window_both"
    keys = {(100, True): 128, (100, False): 64, (200, True): 64, (200, False): 32}[d, plain]
    assert launched == [f"attention_fwd_wgmma<__half, {128 if d == 100 else 256}, {keys}>"], launched


@pytest.mark.parametrize("sms", [1, 2, 5])
@pytest.mark.parametrize("schedule_name", ["forward", "reverse", "random", "warps", "warps_reverse"])
@pytest.mark.parametrize("d,kw", [
    (64, dict(causal=True, q_lengths=[300, 70, 0], kv_lengths=[200, 150, 200])),  # plain, 128 keys
    (64, dict(causal="top_left", softcap=4.0, kv_lengths=[200, 0, 37])),  # features: 128 keys, rows one by one
    (256, dict(causal=True, q_lengths=[300, 129, 1])),                    # 64 keys, O staged in Q's rows
    (64, {}),                                                             # every tile as much work
    (64, dict(softcap=4.0)),
])
def test_wgmma_forward_blocks_claim_work_tiles(monkeypatch, sms, schedule_name, d, kw):
    """The persistent forward: 3 x 2 x 3 = 18 work tiles (query tiles of 128 rows, heads, batch
    entries) on 1, 2 or 5 blocks, so a block's next tile reloads Q over the last one's and its O
    staging tile over the last one's store, and the stage rings go on across tiles; tiles of padding
    rows and of an entry without keys (no Q loaded, O and lse of dead rows written) between others;
    every schedule, the producer far ahead (warps) or starving the consumers; tiles of differing
    work (causal, lengths), which blocks claim as they free. D = 256 with 64 keys has no room for
    O's tile and runs one block per work tile."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", 90)
    monkeypatch.setattr(_kernel_backend, "EMULATOR_SCHEDULE", schedule_name)
    monkeypatch.setattr(_kernel_backend, "EMULATOR_SMS", sms)
    grids = recorded_launches(monkeypatch)
    rng = np.random.default_rng(d + len(kw))
    q, k, v = random_qkv(rng, b=3, h=2, hkv=1, sq=300, sk=200, d=d, dtype=np.float16)
    check(q, k, v, np.float16, **{key: np.array(x, np.int32) if key.endswith("lengths") else x for key, x in kw.items()})
    [(name, grid)] = grids
    persistent = d == 64
    assert name.startswith("attention_fwd_wgmma<") and grid == ((min(18, sms) if persistent else 18), 1, 1), grids


def test_each_wgmma_forward_call_claims_work_tiles_from_none(monkeypatch):
    """The persistent forward's blocks claim work tiles on a counter of each launch's own: two
    calls in a row, outputs poisoned (by default), are both whole (a counter left at the first
    call's count would leave the second call's blocks their own tiles alone: rows of NaN), and
    each counter ends at one claim per work tile past the grid's and one per block."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", 90)
    counters, launch = [], _kernel_backend._launch

    def record_counter(target, filename, name, grid, args, *rest, **keywords):
        launch(target, filename, name, grid, args, *rest, **keywords)
        counters.append((grid, args[12].copy()))  # q, k, v, out, lse, 4 maps, 3 work sizes, claims

    monkeypatch.setattr(_kernel_backend, "_launch", record_counter)
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, b=2, h=2, hkv=1, sq=300, sk=200, d=64, dtype=np.float16)
    for _ in range(2):
        check(q, k, v, np.float16, causal=True)
    # 12 work tiles on 3 blocks: 9 claimed past the grid's own, and one claim per block that found none
    assert [(grid, c.tolist()) for grid, c in counters] == [((3, 1, 1), [12])] * 2, counters


@pytest.mark.parametrize("kw,keys", [({}, 176), (dict(kv_lengths=[150, 9]), 176), (dict(causal=True), 128),
                                     (dict(causal="top_left"), 128), (dict(window=(20, 0)), 128),
                                     (dict(window=(None, 30)), 128), (dict(softcap=4.0), 128),
                                     (dict(alibi_slopes=[0.3, 0.1], window=(20, 0)), 128),
                                     (dict(softcap=3.0, alibi_slopes=[0.3, 0.1]), 128),
                                     (dict(dropout_p=0.2, dropout_seed=5), 128),
                                     (dict(dropout_p=0.2, dropout_seed=5, alibi_slopes=[0.3, 0.1]), 64),
                                     (dict(mask=np.arange(150) % 7 > 0), 176), (dict(mask=np.arange(150) % 7 > 0, causal=True), 128),
                                     (dict(mask=np.arange(150) % 7 > 0, softcap=3.0), 128)])
def test_wgmma_forward_tile_at_d64_follows_the_diagonal(monkeypatch, kw, keys):
    """At D = 64 a plain call without causal or a window takes tiles of 176 keys (m64n176k16),
    and so does one with a mask alone; a causal or windowed one 128, whose diagonal tiles waste
    less (_config.HOPPER_TILES); a call with other score features 128, dropout included, but with
    ALiBi and dropout together (or mods) 64."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", 90)
    grids = recorded_launches(monkeypatch)
    rng = np.random.default_rng(keys + len(kw))
    q, k, v = random_qkv(rng, b=2, h=2, hkv=1, sq=40, sk=150, d=64, dtype=np.float16)
    check(q, k, v, np.float16, **{key: np.array(x, np.int32) if key.endswith("lengths") else x for key, x in kw.items()})
    assert [name for name, _ in grids] == [f"attention_fwd_wgmma<__half, 64, {keys}>"]


@pytest.mark.parametrize("schedule_name", ["random", "warps", "warps_reverse"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=str)
@pytest.mark.parametrize("sq,sk,kw", [
    (1, 1, {}), (7, 7, {}), (113, 203, {}), (203, 113, dict(dv=40)), (70, 353, dict(d=40, layout="bshd")),
    (129, 530, dict(q_lengths=[129, 1], kv_lengths=[177, 352])), (90, 1000, dict(hkv=2)),
    (113, 400, dict(mask="bool", kv_lengths=[400, 177])), (70, 203, dict(mask="float", dv=40)),
])
def test_wgmma_forward_of_176_key_tiles(monkeypatch, schedule_name, dtype, sq, sk, kw):
    """The tile of 176 keys (11 k-steps of P·V, 22 column tiles of S) of plain calls and calls
    with a mask alone: one key, a tile and a part, key lengths that end one past a tile (177) and
    inside the second, query lengths that leave a block one row, Dv < D, head dims padded to 64, a
    bshd layout, GQA and more key tiles (six) than the stage rings have stages, bool and float
    masks (a third of a float mask's scores -inf); the producer far ahead (warps) or starving the
    consumers (warps_reverse)."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", 90)
    monkeypatch.setattr(_kernel_backend, "EMULATOR_SCHEDULE", schedule_name)
    grids = recorded_launches(monkeypatch)
    rng = np.random.default_rng(sq * 1009 + sk)
    shape = dict(dict(b=2, h=2, hkv=1, d=64), **{key: x for key, x in kw.items() if key in ("d", "dv", "hkv", "layout")})
    call = {key: np.array(x, np.int32) for key, x in kw.items() if key.endswith("lengths")}
    if kw.get("mask") == "bool":
        call["mask"] = rng.random((2, 2, sq, sk)) < 0.7
    elif kw.get("mask") == "float":
        call["mask"] = np.where(rng.random((2, 1, sq, sk)) < 0.3, -np.inf, rng.standard_normal((2, 1, sq, sk))).astype(np.float32)
    q, k, v = random_qkv(rng, sq=sq, sk=sk, dtype=dtype, **shape)
    check(*(tma_addressable(x) for x in (q, k, v)), dtype, layout=shape.get("layout", "bhsd"), **call)
    assert [name for name, _ in grids] == [f"attention_fwd_wgmma<{'__half' if dtype == np.float16 else '__nv_bfloat16'}, 64, 176>"]


@pytest.mark.parametrize("schedule_name", ["forward", "reverse", "random", "warps", "warps_reverse"])
@pytest.mark.parametrize("sq,sk,kw,keys", [(1, 1100, {}, 176), (203, 1000, dict(causal=True), 128),
                                           (113, 1030, dict(causal="top_left", softcap=3.0, kv_lengths=[1030, 517]), 128),
                                           (70, 1000, dict(causal=True, softcap=3.0, kv_lengths=[1000, 517],
                                                           dropout_p=0.1, dropout_seed=9), 128),
                                           (70, 1000, dict(causal=True, alibi_slopes=[0.3, 0.1], kv_lengths=[1000, 517],
                                                           dropout_p=0.1, dropout_seed=9), 64)])
def test_wgmma_forward_over_many_key_tiles(monkeypatch, schedule_name, sq, sk, kw, keys):
    """Many key tiles: 7 of 176 keys (a plain call) and 8 of 128 (a causal one), so the producer's
    stage rings go round three or four times and the consumer groups take as many turns, on every
    schedule, the producer far ahead of the consumers (warps) and starving them (warps_reverse);
    plain builds, builds with softcap, and with softcap and dropout, over 9 tiles of 128 keys and
    one with ALiBi and dropout over 16 of 64 (each tile's softmax overlapping P·V of the one
    before); a block of one query row, whose second consumer group has none."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", 90)
    monkeypatch.setattr(_kernel_backend, "EMULATOR_SCHEDULE", schedule_name)
    grids = recorded_launches(monkeypatch)
    rng = np.random.default_rng(sq + sk)
    q, k, v = random_qkv(rng, b=2, h=2, hkv=1, sq=sq, sk=sk, d=64, dtype=np.float16)
    check(q, k, v, np.float16, **kw)
    assert [name for name, _ in grids] == [f"attention_fwd_wgmma<__half, 64, {keys}>"]


@pytest.mark.parametrize("feature", ["everything", "lengths_causal", "bool_mask"])
def test_features_random_schedule(monkeypatch, tensor_core_kernel, feature):
    monkeypatch.setattr(_kernel_backend, "EMULATOR_SCHEDULE", "random")
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, b=3, h=4, hkv=1, sq=113, sk=203, d=72, dv=56, dtype=np.float16)
    check(q, k, v, np.float16, **feature_keywords(feature, rng))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_non_contiguous_inputs(dtype):
    rng = np.random.default_rng(9)
    q, k, v = random_qkv(rng, b=2, h=4, hkv=2, sq=64, sk=226, d=32, dtype=dtype)
    # bshd views of bhsd storage, every other key, and a last axis that is not contiguous (copied once)
    qv = q.transpose(0, 2, 1, 3)
    kv_ = k[:, :, ::2].transpose(0, 2, 1, 3)
    vv = np.asfortranarray(v[:, :, ::2]).transpose(0, 2, 1, 3)
    check(qv, kv_, vv, dtype, layout="bshd", causal=True)


@pytest.mark.parametrize("offset", [0, 1, 3])
def test_tensor_core_copies_with_any_alignment(tensor_core_kernel, offset):
    """cp.async needs 16-byte-aligned rows; other inputs take the element-by-element copy."""
    rng = np.random.default_rng(10)
    buf = rng.standard_normal(3 * 2 * 4 * 90 * 48 + offset).astype(np.float16)
    q, k, v = (buf[offset + i * 2 * 4 * 90 * 48:][:2 * 4 * 90 * 48].reshape(2, 4, 90, 48) for i in range(3))
    assert _kernel_backend._copies_in_16_bytes(q) == (offset == 0)
    check(q, k, v, np.float16, causal=True)


def test_fully_masked_rows_give_zero(tensor_core_kernel):
    rng = np.random.default_rng(11)
    q, k, v = random_qkv(rng, b=2, sq=90, sk=40, d=16, dtype=np.float16)
    mask = np.ones((2, 1, 90, 40), bool)
    mask[1, :, 70:] = False
    out, lse = check(q, k, v, np.float16, causal=True, q_lengths=[80, 90], mask=mask)
    assert (out[0, :, :40] == 0).all() and (lse[0, :, :40] == -np.inf).all()  # causal, q_len 80 > Sk 40
    assert (out[0, :, 80:] == 0).all() and (out[1, :, 70:] == 0).all()
    assert not np.isnan(out.astype(np.float32)).any()


def test_rows_whose_first_key_tiles_are_all_masked(tensor_core_kernel):
    """The online softmax starts its running max from the lowest float, not -inf (softmax.cuh):
    rows whose first 150 keys are masked (2 tiles of 64 or 1 of 128 and part of the next with
    nothing to attend) then attend the rest; rows whose every score is a finite -1e38 (below any
    real score, above the start) weigh their keys evenly, as the reference does; a row that
    attends nothing gives 0. A start that stayed put on a finite score, or that shifted by -inf,
    fails here (NaN, inf or 0 rows)."""
    rng = np.random.default_rng(17)
    q, k, v = random_qkv(rng, b=1, h=2, sq=70, sk=300, d=64, dtype=np.float16)
    mask = np.zeros((1, 1, 70, 300), np.float32)
    mask[..., :35, :150] = -np.inf
    mask[..., 35:40, :] = -1e38
    mask[..., 40, :] = -np.inf
    out, lse = check(q, k, v, np.float16, mask=mask)
    assert (out[:, :, 40] == 0).all() and (lse[:, :, 40] == -np.inf).all()


def rising_scores(dtype):
    """q, k, v (1, 2, 70 | 300, 64) whose scores step up by 2.6 (natural log; 3.75 base 2) every
    64 keys and jump by 28 (40 base 2) at key 290, with little noise (scale 1/8: score ≈
    k[..., 0])."""
    rng = np.random.default_rng(29)
    q, k, v = random_qkv(rng, b=1, h=2, sq=70, sk=300, d=64, dtype=np.float32)
    q[..., 1:] *= 0.1
    q[..., 0] = 8.0
    k[..., 0] = 2.6 * (np.arange(300) // 64)
    k[..., 290:, 0] += 28.0
    return tuple(x.astype(dtype) for x in (q, k, v))


@pytest.mark.parametrize("dtype,compute_capability", [(np.dtype(np.float32), 80), (np.dtype(np.float16), 80),
                                                      (np.dtype(np.float16), 90), (BF16, 90)],
                         ids=["cuda_cores", "mma_sync", "wgmma_fp16", "wgmma_bf16"])
def test_running_max_that_rises_tile_after_tile(monkeypatch, dtype, compute_capability):
    """rising_scores: the tensor-core forwards' online softmax moves its reference max only when a
    tile exceeds it by more than 8 (base 2; tc_forward.cuh, TcSoftmax; the fp32 forward keeps the
    exact max), so tiles of 64 keys (mma.sync) and of 128 (wgmma, causal) take probabilities up to
    2^7.5 against a lagging max and others rescale O (the wgmma forward's 176-key tiles without
    causal: the second tile moves the max past the jump and rescales). A max that lagged without
    bound would overflow fp16 P (2^16), one that moved without rescaling O would be wrong."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", compute_capability)
    q, k, v = rising_scores(dtype)
    check(q, k, v, dtype)
    check(q, k, v, dtype, causal=True)  # rows whose keys end before the jump, and some after it


@pytest.mark.parametrize("compute_capability", [80, 90], ids=["mma_sync", "wgmma"])
def test_dropout_builds_keep_the_exact_running_max(monkeypatch, compute_capability):
    """With dropout P·V sees P/(1 − p): rising_scores' lagged tiles (P = 2^7.5 for every key)
    would give P·1000 = 1.8e5 at p = 0.999, past fp16's 65504 (inf in O). The exact max keeps
    P <= 1."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", compute_capability)
    q, k, v = rising_scores(np.float16)
    check(q, k, v, np.float16, dropout_p=0.999, dropout_seed=3)


@pytest.mark.parametrize("capability", [80, 90], ids=["mma_sync", "wgmma"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=str)
def test_tensor_core_forwards_normalise_by_the_rounded_probabilities(monkeypatch, dtype, capability):
    """The mma.sync forward and the wgmma forward at D = 64 (builds without dropout) sum each
    row's P as rounded to the input type, on the tensor cores (P·1 beside P·V), so V's rows are
    weighed by weights that sum to 1 as used: with V all ones every output is exactly 1, as the
    reference's. Here every P but the first (1) lies 0.44 of an ulp above 0.75 and rounds down, so
    a sum of the unrounded P (float adds, as the other kernels take) would leave every row one ulp
    below 1. 400 keys: several key tiles of 176, so both stages of the wgmma forward's ring of V,
    each with its own ones."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", capability)
    ulp = 2.0 ** -(np.finfo(dtype).nmant + 1)  # the spacing in [0.5, 1)
    target = 8 * np.log(0.75 + 0.44 * ulp)  # the score giving that P at D = 64 (scale 1/8)
    q = np.zeros((1, 1, 5, 64), dtype)
    k = np.zeros((1, 1, 400, 64), dtype)
    q[..., :2] = 1
    k[..., 1:, 0] = target
    k[..., 1:, 1] = target - k[0, 0, 1, 0].astype(np.float64)  # the rest, in finer steps
    v = np.ones((1, 1, 400, 64), dtype)
    p = np.exp((k[0, 0, :, 0].astype(np.float64) + k[0, 0, :, 1].astype(np.float64)) / 8)
    rounded = p.astype(dtype).astype(np.float64)
    assert np.all(rounded[1:] == 0.75) and p[0] == 1  # P rounds down by 0.44 ulp ...
    assert np.float64(rounded.sum() / p.sum()).astype(dtype) != 1  # ... enough to show in O
    out = cupy_attn.attention(q, k, v, backend="emulator")
    assert out.dtype == dtype and np.all(out.astype(np.float64) == 1)


def passed_mask(q, k, v, mask):
    """The mask array the kernels are given for a call with `mask`."""
    return _kernel_backend._mask_arguments(_problem.make_problem(q, k, v, mask=mask))[0]


def test_masks_with_contiguous_keys_are_read_in_place():
    """Broadcast over batch, heads or queries (stride 0, or an axis of 1), or stepping backwards
    over the queries: the kernels read the caller's array through its strides."""
    rng = np.random.default_rng(12)
    q, k, v = random_qkv(rng, b=3, h=4, sq=33, sk=77, d=16)
    for mask in (rng.random((3, 1, 1, 77)) < 0.8, np.broadcast_to(rng.random((1, 4, 1, 77)) < 0.5, (3, 4, 33, 77)),
                 rng.standard_normal((4, 33, 77)).astype(np.float32)[:, ::-1]):
        check(q, k, v, np.float32, mask=mask)
        assert np.shares_memory(passed_mask(q, k, v, mask), mask)


def strided_key_masks(rng, b, h, sq, sk):
    """(mask, the shape the kernels get it in) for masks whose keys are not contiguous: strided (a
    transposed view), broadcast over the keys (an axis of 1, or stride 0 with the batch too)."""
    return [((rng.random((sk, sq)) < 0.7).T, (1, 1, sq, sk)),
            (rng.standard_normal((h, sq, 1)).astype(np.float32), (1, h, sq, sk)),
            (np.broadcast_to(rng.random((1, h, sq, 1)) < 0.6, (b, h, sq, sk)), (1, h, sq, sk)),
            (rng.standard_normal((b, 1, 2 * sk, sq)).astype(np.float32)[:, :, ::-2].swapaxes(2, 3), (b, 1, sq, sk))]


@pytest.mark.parametrize("capability", [80, 90], ids=["mma_sync", "wgmma"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float16)], ids=str)
def test_masks_with_strided_or_broadcast_keys_are_copied_once_with_their_keys_contiguous(monkeypatch, capability,
                                                                                        dtype):
    """The kernels read a mask row's keys contiguously (kernels/mask.cuh): any other mask is
    copied, its own rows only (axes broadcast by stride 0 taken once); the caller's is untouched."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", capability)
    launches = recorded_launches(monkeypatch)
    rng = np.random.default_rng(16)
    q, k, v = random_qkv(rng, b=2, h=3, sq=33, sk=77, d=16, dtype=dtype)
    for mask, shape in strided_key_masks(rng, 2, 3, 33, 77):
        before = mask.copy()
        check(q, k, v, dtype, mask=mask)
        kernel = launches[-1][0].split("<")[0]
        assert kernel == ("attention_fwd" if dtype == np.float32 else
                          "attention_fwd_wgmma" if capability == 90 else "attention_fwd_tc"), kernel
        passed = passed_mask(q, k, v, mask)
        assert passed.shape == shape and passed.flags.c_contiguous and not np.shares_memory(passed, mask)
        assert np.array_equal(mask, before)


@pytest.mark.parametrize("capability", [80, 90], ids=["mma_sync", "wgmma"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float16)], ids=str)
def test_masks_are_read_only_where_the_structure_keeps_the_pair(monkeypatch, capability, dtype):
    """Keys past a sequence's end and padding rows need no mask element: the kernels compute every
    feature of a boundary tile's scores and select after, but load the mask only inside the
    structure. The emulator's counters fail a launch whose counted access leaves every array
    argument, as the loads of the last mask row's keys past Sk, or of padding rows, would."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", capability)
    rng = np.random.default_rng(17)
    q, k, v = random_qkv(rng, b=2, h=3, sq=33, sk=77, d=16, dtype=dtype)
    for mask in (rng.random((33, 77)) < 0.7, rng.standard_normal((3, 33, 77)).astype(np.float32)):
        with emulator.counting() as counters:
            out, lse = check(q, k, v, dtype, mask=mask, causal=True, softcap=4.0)
            for deterministic in (False, True):
                cupy_attn.attention_backward(out, q, k, v, out, lse, mask=mask, causal=True, softcap=4.0,
                                             backend="emulator", deterministic=deterministic)
        assert any(s.site.startswith("mask.cuh") for s in counters.sites)


def test_the_most_negative_float_masks_like_minus_infinity():
    """finfo(float32).min (transformers' masks), or a float64 mask below float32's range: the kernels'
    base 2 takes it to -inf, and so do the NumPy backend and the reference, fully masked rows too."""
    rng = np.random.default_rng(15)
    q, k, v = random_qkv(rng, b=3, h=4, sq=33, sk=77, d=16)
    allowed = rng.random((33, 1)) < 0.5  # every key of half the rows
    want = cupy_attn.attention(q, k, v, mask=np.broadcast_to(allowed, (33, 77)), return_lse=True)
    for lowest in (np.float32(np.finfo(np.float32).min), -1e39, -2.5e38):
        mask = np.where(allowed, 0.0, lowest)  # float32 for the float32 one, else float64
        for run in (lambda **kw: cupy_attn.attention(q, k, v, return_lse=True, **kw),
                    lambda **kw: cupy_attn.attention(q, k, v, return_lse=True, backend="emulator", **kw),
                    lambda **kw: reference.attention(q, k, v, **kw)):
            out, lse = run(mask=mask)
            assert_close(out, want[0], np.float32, what=f"out, mask of {lowest}")
            assert (lse[..., ~allowed[:, 0]] == -np.inf).all()


def field(values, dtype):
    """``values`` as one field of a structured array: byte strides of no whole number of elements."""
    record = np.zeros(values.shape, dtype=[("x", dtype), ("pad", np.uint8)])
    record["x"] = values
    return record["x"]


def test_byte_strides_of_part_elements_are_copied_once():
    rng = np.random.default_rng(13)
    q, k, v = random_qkv(rng, b=3, h=4, sq=33, sk=77, d=16)
    q_field, mask = field(q, np.float32), field(rng.standard_normal((33, 1)).astype(np.float32), np.float32)
    assert q_field.strides[-1] == 5 and mask.strides[0] == 5
    check(q_field, k, v, np.float32, mask=mask)


def test_no_query_heads():
    """H = 0 (with a kv head): nothing to launch; dq is empty and dk, dv are 0, as the kv head serves
    no query."""
    rng = np.random.default_rng(14)
    q, k, v = random_qkv(rng, b=2, h=1, sq=5, sk=7, d=16, dtype=np.float16)
    q = q[:, :0]
    for packed in (False, True):
        args = (q[0].transpose(1, 0, 2), k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2),
                np.array([0, 5], np.int32), np.array([0, 7], np.int32), 5, 7) if packed else (q, k, v)
        forward, backward = ((cupy_attn.attention_varlen, cupy_attn.attention_varlen_backward) if packed
                             else (cupy_attn.attention, cupy_attn.attention_backward))
        out, lse = forward(*args, backend="emulator", return_lse=True)
        assert out.shape == args[0].shape and lse.size == 0
        for deterministic in (False, True):
            dq, dk, dv = backward(out, *args[:3], out, lse, *args[3:], backend="emulator", deterministic=deterministic)
            assert dq.shape == args[0].shape and dk.shape == args[1].shape and dv.shape == args[2].shape
            assert not dk.any() and not dv.any()


def test_compute_capability_selects_the_forward(monkeypatch):
    """fp16/bf16 take the wgmma kernel on compute capability 9.0 and mma.sync elsewhere; fp32
    keeps the CUDA-core kernel everywhere."""
    launched = []
    real_function = _compile.function
    monkeypatch.setattr(_compile, "function", lambda target, f, name, **kw: launched.append(name) or real_function(target, f, name, **kw))
    q, k, v = random_qkv(np.random.default_rng(13), d=64, dtype=np.float16)
    for capability, dtype, kernel in ((90, np.float16, "attention_fwd_wgmma<__half, 64, 176>"),
                                      (90, BF16, "attention_fwd_wgmma<__nv_bfloat16, 64, 176>"),
                                      (80, np.float16, "attention_fwd_tc<__half, 64, 128, 64, 64, 1>"),
                                      (90, np.float32, "attention_fwd<float, 64, 64, 64, 2>")):
        monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", capability)
        launched.clear()
        check(q.astype(dtype), k.astype(dtype), v.astype(dtype), np.dtype(dtype))
        assert launched == [kernel]


@pytest.mark.parametrize("case,kernel", [
    ("padded_rows", "attention_fwd_wgmma<__half, 64, 128>"),       # rows 144 bytes apart: TMA reads them
    ("unaligned_rows", "attention_fwd_tc<__half, 64, 128, 64, 64, 1>"),  # 136 bytes: not a multiple of 16
    ("unaligned_q", "attention_fwd_tc<__half, 64, 128, 64, 64, 1>"),  # q's rows 136 bytes apart
    ("offset_q", "attention_fwd_tc<__half, 64, 128, 64, 64, 1>"),  # rows 160 bytes apart, from byte 16
    ("odd_value_dims", "attention_fwd_wgmma<__half, 64, 128>"),    # Dv = 36: out in rows of 40 (a copy returned)
    ("packed", "attention_fwd_tc<__half, 64, 128, 64, 64, 1>"),     # a box would reach into the next sequence
])
def test_wgmma_forward_runs_where_tma_can_address_its_operands(monkeypatch, caplog, case, kernel):
    """The wgmma forward reads q, k and v and writes out through TMA maps; where TMA cannot address
    them the call runs the mma.sync forward, which reads and writes any strides, and says so in the
    log. Out is the launcher's: rows of a multiple of 8 elements, returned contiguous."""
    monkeypatch.setattr(_kernel_backend, "EMULATOR_COMPUTE_CAPABILITY", 90)
    monkeypatch.setattr(_kernel_backend, "_SAID", set())
    caplog.set_level(logging.WARNING, logger="cupy_attn")
    launched = []
    real_function = _compile.function
    monkeypatch.setattr(_compile, "function", lambda target, f, name, **kw: launched.append(name) or real_function(target, f, name, **kw))
    rng = np.random.default_rng(14)
    if case == "packed":
        lengths = [70, 13]
        q, k, v = (rng.standard_normal((sum(lengths), 2, 64)).astype(np.float16) for _ in range(3))
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        out = cupy_attn.attention_varlen(q, k, v, cu, cu, 70, 70, causal=True, backend="emulator")
        for s0, s1 in zip(cu[:-1], cu[1:]):
            want, _ = reference.attention(*(x[s0:s1].transpose(1, 0, 2)[None] for x in (q, k, v)), causal=True)
            assert_close(out[s0:s1], want[0].transpose(1, 0, 2), np.float16)
    elif case == "odd_value_dims":
        q, k, v = random_qkv(rng, b=2, h=2, sq=70, sk=150, d=64, dv=36, dtype=np.float16)
        out, _ = check(q, k, tma_addressable(v), np.float16, causal=True)  # v in rows of 40
        assert out.flags.c_contiguous and out.shape == (2, 2, 70, 36)
    else:
        q, k, v = random_qkv(rng, b=2, h=2, sq=70, sk=150, d=64, dtype=np.float16)
        width, first = {"padded_rows": (72, 0), "offset_q": (80, 8)}.get(case, (68, 0))
        x = q if case.endswith("_q") else k
        wide = np.zeros(x.shape[:-1] + (width,), np.float16)
        wide[..., first:first + 64] = x
        if case.endswith("_q"):
            check(wide[..., first:first + 64], k, v, np.float16, causal=True)
        else:
            check(q, wide[..., :64], v, np.float16, causal=True)
    assert launched == [kernel]
    assert ("the mma.sync forward runs instead" in caplog.text) == ("wgmma" not in kernel), caplog.text


def test_tma_alignment_is_judged_from_the_arrays_allocation():
    """A swizzled TMA map needs its array 128-byte aligned: a NumPy array stands in for a device
    allocation (256-byte aligned) from the start of the array holding its memory, through views
    of every kind, so the emulator chooses a kernel as a GPU would for the same view."""
    storage = np.zeros((4, 80), np.float16)
    as_strided = np.lib.stride_tricks.as_strided
    for view, offset in ((storage, 0), (storage[:, 8:72], 16), (storage[1:], 160), (storage.T, 0),
                         (as_strided(storage[:, 8:], (4, 64), storage.strides), 16),
                         (as_strided(storage, (2, 64), (320, 2))[:, 4:], 8)):
        assert _kernel_backend._allocation_offset(view) == offset


def test_a_tma_refusal_is_said_once_whatever_address_it_names(monkeypatch, caplog):
    monkeypatch.setattr(_kernel_backend, "_SAID", set())
    caplog.set_level(logging.WARNING, logger="cupy_attn")
    for address in (0x7F0000001008, 0x7F0000002008):
        _kernel_backend._say_tma_refused("forward", f"q: address must be 16-byte aligned, got {address:#x}")
    assert caplog.text.count("address must be 16-byte aligned") == 1, caplog.text


def test_environment_chooses_the_compute_capability(monkeypatch):
    launched = []
    real_function = _compile.function
    monkeypatch.setattr(_compile, "function", lambda target, f, name, **kw: launched.append(name) or real_function(target, f, name, **kw))
    q, k, v = random_qkv(np.random.default_rng(14), d=64, dtype=np.float16)
    for value, kernel in (("90", "attention_fwd_wgmma<__half, 64, 176>"), ("80", "attention_fwd_tc<__half, 64, 128, 64, 64, 1>"),
                          ("", "attention_fwd_tc<__half, 64, 128, 64, 64, 1>")):
        monkeypatch.setenv("CUPY_ATTN_COMPUTE_CAPABILITY", value)
        launched.clear()
        check(q, k, v, np.dtype(np.float16))
        assert launched == [kernel]
    for bad in ("8.0", "70", "sm_90", "-80"):
        monkeypatch.setenv("CUPY_ATTN_COMPUTE_CAPABILITY", bad)
        with pytest.raises(ValueError, match="CUPY_ATTN_COMPUTE_CAPABILITY must be a compute capability of at least"):
            cupy_attn.attention(q, k, v, backend="emulator")


@pytest.mark.parametrize("device, requested, chosen", [(90, None, 80), (90, "90", 90), (90, "80", 80), (80, None, 80),
                                                       (86, None, 86), (89, "80", 80), (100, None, 100)])
def test_gpu_kernel_choice_by_device_and_environment(monkeypatch, device, requested, chosen):
    """Without a GPU: a stand-in CuPy reports the device; an H100/H200 runs the mma.sync kernels
    unless wgmma is asked for (they measured faster: _config.DEFAULT_KERNELS_FOR)."""
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda: types.SimpleNamespace(compute_capability=str(device))))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    if requested:
        monkeypatch.setenv("CUPY_ATTN_COMPUTE_CAPABILITY", requested)
    else:
        monkeypatch.delenv("CUPY_ATTN_COMPUTE_CAPABILITY", raising=False)
    assert _kernel_backend.compute_capability("cuda") == chosen


@pytest.mark.parametrize("device, requested", [(90, "100"), (89, "90"), (80, "86")])
def test_gpu_kernels_the_device_cannot_run_are_refused(monkeypatch, device, requested):
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda: types.SimpleNamespace(compute_capability=str(device))))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setenv("CUPY_ATTN_COMPUTE_CAPABILITY", requested)
    with pytest.raises(ValueError, match="asks for kernels this GPU"):
        _kernel_backend.compute_capability("cuda")


def test_float64_is_refused():
    q, k, v = random_qkv(np.random.default_rng(0), dtype=np.float64)
    with pytest.raises(TypeError, match="float64 inputs run on the NumPy backend only"):
        cupy_attn.attention(q, k, v, backend="emulator")


FEATURE_CALLS = {  # a call's keywords -> the build it must run (_config.FEATURE_BITS)
    "plain": ({}, _config.PLAIN_FEATURES),
    "softcap": (dict(softcap=5.0), _config.SOFTCAP),
    "alibi": (dict(alibi_slopes=np.array([0.5, 0.25])), _config.ALIBI),
    "bool mask": (dict(mask=np.random.default_rng(1).random((33, 70)) < 0.7), _config.BOOL_MASK),
    "float mask": (dict(mask=np.random.default_rng(2).standard_normal((33, 70))), _config.FLOAT_MASK),
    "softcap, alibi, float mask, sinks": (dict(softcap=5.0, alibi_slopes=np.array([0.5, 0.25]), sinks=np.array([0.3, -1.0]),
                                               mask=np.random.default_rng(3).standard_normal((33, 70))), _config.ALL_FEATURES),
    "sinks": (dict(sinks=np.array([0.3, -1.0])), _config.PLAIN_FEATURES),  # read after the key loop: no build of its own
}


@pytest.mark.parametrize("feature", list(FEATURE_CALLS))
def test_a_call_runs_the_build_of_the_features_it_uses(monkeypatch, feature):
    """A call runs the module built for exactly its score features: none of the others, and none
    decided at run time."""
    built = []
    real_function = _compile.function
    monkeypatch.setattr(_compile, "function", lambda target, f, name, **kw: built.append(kw["features"])
                        or real_function(target, f, name, **kw))
    rng = np.random.default_rng(15)
    q, k, v = random_qkv(rng, b=1, h=2, sq=33, sk=70, d=64, dtype=np.float16)
    kw, expected = FEATURE_CALLS[feature]
    check(q, k, v, np.dtype(np.float16), **kw)
    assert built == [expected]


@pytest.mark.parametrize("built, call", [(_config.PLAIN_FEATURES, "softcap"), (_config.SOFTCAP, "plain"),
                                         (_config.BOOL_MASK, "float mask"), (_config.FLOAT_MASK | _config.ALIBI, "float mask")],
                         ids=["plain_build_softcap_call", "softcap_build_plain_call", "bool_mask_build_float_mask_call",
                              "alibi_float_mask_build_float_mask_call"])
def test_a_build_refuses_a_call_with_other_features(built, call):
    """Launched by hand with a module built for other features than the call's (one more, one
    fewer, the other mask kind), the kernel traps instead of ignoring a feature or reading an
    array that was not passed."""
    from cupy_attn import emulator

    q, k, v = random_qkv(np.random.default_rng(16), b=1, h=2, sq=33, sk=70, d=64, dtype=np.float16)
    problem = _problem.make_problem(q, k, v, **FEATURE_CALLS[call][0], backend="emulator")
    assert _kernel_backend.score_features(problem) != built
    tile = _config.forward_tile(64, 64, np.float16)
    wrong = _compile.function("emulator", tile.filename, tile.name_expression(np.float16), features=built)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_compile, "function", lambda target, f, name, **kw: wrong)
        with pytest.raises(emulator.EmulatorError, match="__trap"):
            _kernel_backend.forward(problem, q, k, v, target="emulator")
