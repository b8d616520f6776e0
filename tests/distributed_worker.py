"""The MPI side of test_distributed.py, run under `mpiexec -n P python distributed_worker.py CASE...`.

Every rank runs every case named on the command line on the NumPy backend; rank 0 prints one JSON
line per case: {"case": name, "errors": {rank: message}} (empty when every rank passed), with
"skipped": reason where the case cannot run here. Every
rank builds the same full inputs from a fixed seed and checks its own shard of the results
against single-process `cupy_attn.attention` / `attention_backward` on the whole sequence.
"""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy_attn  # noqa: E402
from cupy_attn import _backends, _ring, distributed  # noqa: E402
from helpers import BF16, assert_close, random_qkv  # noqa: E402

F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
SEQ = 24  # a multiple of 2P for P = 1, 2, 3, 4: every load balance shards it

# name -> keywords of `ring_case`: causal with every load balance, non-causal, GQA and MQA,
# Dv != D, both layouts, every dtype, scale and softcap.
RING_CASES = {
    "causal-zigzag-f32-bhsd-gqa": dict(causal=True, load_balance="zigzag", dtype=F32, layout="bhsd", dv=12),
    "causal-zigzag-f64-bshd": dict(causal=True, load_balance="zigzag", dtype=F64, layout="bshd", hkv=1),
    "causal-contiguous-f32-bshd-gqa": dict(causal=True, load_balance="contiguous", dtype=F32, layout="bshd", dv=12),
    "causal-contiguous-f64-bhsd": dict(causal="top_left", load_balance="contiguous", dtype=F64, layout="bhsd", hkv=4),
    "causal-striped-f64-bhsd-gqa": dict(causal=True, load_balance="striped", dtype=F64, layout="bhsd", dv=12),
    "noncausal-zigzag-f32-bshd-softcap": dict(causal=False, load_balance="zigzag", dtype=F32, layout="bshd",
                                              softcap=3.0, scale=0.5),
    "noncausal-contiguous-f64-bhsd-mqa": dict(causal=False, load_balance="contiguous", dtype=F64, layout="bhsd",
                                              hkv=1, dv=5),
    "causal-zigzag-f16-bhsd": dict(causal=True, load_balance="zigzag", dtype=F16, layout="bhsd"),
    "causal-zigzag-bf16-bshd": dict(causal=True, load_balance="zigzag", dtype=BF16, layout="bshd"),
    # The blocks on the CUDA kernels and the merge on its kernel, as on a GPU, run by the emulator.
    "causal-zigzag-f16-bhsd-emulator": dict(causal=True, load_balance="zigzag", dtype=F16, layout="bhsd", d=16,
                                            backend="emulator"),
}


class Skip(Exception):
    """A case that cannot run here (the same on every rank, before any communication)."""


def ring_case(comm, *, causal, load_balance, dtype, layout, h=4, hkv=2, d=8, dv=None, softcap=None, scale=None,
              backend="auto"):
    if backend != "auto" and not _backends.available()[backend][0]:
        raise Skip(f"backend {backend!r} unavailable: {_backends.available()[backend][1]}")
    size, rank = comm.Get_size(), comm.Get_rank()
    rng = np.random.default_rng(1234)  # the same full sequence on every rank
    q, k, v = random_qkv(rng, b=2, h=h, hkv=hkv, sq=SEQ, sk=SEQ, d=d, dv=dv, dtype=dtype, layout=layout)
    kw = dict(causal=causal, scale=scale, softcap=softcap, layout=layout)
    want_out, want_lse = cupy_attn.attention(q, k, v, return_lse=True, **kw)
    dout = rng.standard_normal(want_out.shape).astype(dtype)
    want_grads = cupy_attn.attention_backward(dout, q, k, v, want_out, want_lse, **kw)

    def cut(x, lay=layout):
        return distributed.shard(x, rank, size, layout=lay, load_balance=load_balance)

    # Every collective call first, every check after: a rank whose check fails must not leave
    # the others waiting in a later collective.
    ring_kw = dict(kw, load_balance=load_balance, backend=backend)
    # One set of shards for both passes, as the README's example does: the ring must only read them
    # (from 3 ranks on it once received blocks into a contiguous caller's k and v).
    shards = {"q": cut(q), "k": cut(k), "v": cut(v), "dout": cut(dout)}
    unchanged = {name: x.copy() for name, x in shards.items()}
    out, lse = distributed.ring_attention(shards["q"], shards["k"], shards["v"], comm, return_lse=True, **ring_kw)
    every_out = comm.allgather(out)
    grads = distributed.ring_attention_backward(shards["dout"], shards["q"], shards["k"], shards["v"], out, lse, comm,
                                                **ring_kw)
    for name, x in shards.items():
        assert np.array_equal(x, unchanged[name]), f"the ring wrote into the caller's {name} shard"
    assert out.dtype == dtype and lse.dtype == want_lse.dtype, (out.dtype, lse.dtype)
    assert_close(out, cut(want_out), dtype, what="out")
    assert_close(lse, cut(want_lse, "bhsd"), dtype, what="lse")
    # The README's round trip: every rank's out, put back in sequence order, is the whole result.
    assert_close(distributed.unshard(every_out, layout=layout, load_balance=load_balance), want_out, dtype,
                 what="unsharded out")
    for name, got, want in zip(("dq", "dk", "dv"), grads, want_grads):
        assert got.dtype == dtype, (name, got.dtype)
        assert_close(got, cut(want), dtype, grad=True, what=name)


def transport_case(comm):
    """send_recv moves each array to the next rank; P hops bring every block home."""
    ring = _ring.ring_of(comm, np)
    size, rank = comm.Get_size(), comm.Get_rank()
    assert (ring.rank, ring.size) == (rank, size)
    sends = [np.full((2, 3), rank, np.float32), np.arange(5, dtype=np.int64) + 10 * rank,
             np.full(4, rank, np.float16).astype(BF16)]
    recvs = [np.empty_like(x) for x in sends]
    ring.send_recv(sends, recvs)
    prev = (rank - 1) % size
    assert (recvs[0] == prev).all() and (recvs[1] == np.arange(5) + 10 * prev).all(), recvs
    assert recvs[2].dtype == BF16 and (recvs[2].astype(np.float32) == prev).all(), recvs[2]
    block = np.full(3, rank, np.float64)
    for _ in range(size):  # two channels at once, as the backward has
        spare, other = np.empty_like(block), np.empty_like(block)
        first, second = ring.start([block], [spare]), ring.start([block * 2], [other], channel=1)
        ring.wait(second)
        ring.wait(first)
        assert (other == spare * 2).all()
        block = spare
    assert (block == rank).all(), block


def mismatch_case(comm):
    """Shards of different lengths on different ranks: ValueError on every rank, no hang."""
    rank, size = comm.Get_rank(), comm.Get_size()
    n = 4 if rank == 0 and size > 1 else 6
    q = np.ones((1, 2, n, 8), np.float32)
    try:
        distributed.ring_attention(q, q, q, comm, causal=True)
    except ValueError as exc:
        assert size > 1 and "disagree" in str(exc) and "Sq=4" in str(exc), exc
    else:
        assert size == 1, "no error for shards of different lengths"


def cuda_aware_case(comm):
    """This MPI reports no CUDA memory kind, so CuPy-like arrays are refused (not copied)."""
    assert not _ring._mpi_cuda_aware(comm)
    try:
        _ring.ring_of(comm, xp=object())  # anything but numpy stands for CuPy here
    except TypeError as exc:
        assert "CUDA" in str(exc), exc
    else:
        raise AssertionError("an MPI ring accepted non-NumPy arrays without CUDA support")


def comm_self_case(comm):
    """A 1-rank ring (MPI.COMM_SELF) is plain attention, whatever the world size."""
    from mpi4py import MPI

    rng = np.random.default_rng(comm.Get_rank())
    q, k, v = random_qkv(rng, b=1, h=2, sq=10, sk=10, d=4, dtype=F64)
    out, lse = distributed.ring_attention(q, k, v, MPI.COMM_SELF, causal=True, return_lse=True)
    want_out, want_lse = cupy_attn.attention(q, k, v, causal=True, return_lse=True)
    assert_close(out, want_out, F64, what="out")
    assert_close(lse, want_lse, F64, what="lse")
    dout = rng.standard_normal(out.shape)
    got = distributed.ring_attention_backward(dout, q, k, v, out, lse, MPI.COMM_SELF, causal=True)
    for name, g, w in zip(("dq", "dk", "dv"), got, cupy_attn.attention_backward(dout, q, k, v, want_out, want_lse,
                                                                               causal=True)):
        assert_close(g, w, F64, grad=True, what=name)


CASES = {**{f"ring-{name}": (lambda comm, kw=kw: ring_case(comm, **kw)) for name, kw in RING_CASES.items()},
         "transport": transport_case, "mismatch": mismatch_case, "cuda-aware": cuda_aware_case,
         "comm-self": comm_self_case}


def main(names) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    for name in names:
        error = skipped = None
        try:
            CASES[name](comm)
        except Skip as exc:
            skipped = str(exc)
        except Exception:  # reported per case and rank, so one failure does not hide the others
            error = traceback.format_exc(limit=-3)
        errors = comm.gather(error, root=0)
        if comm.Get_rank() == 0:
            print(json.dumps({"case": name, "errors": {r: e for r, e in enumerate(errors) if e}, "skipped": skipped}),
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(CASES))
