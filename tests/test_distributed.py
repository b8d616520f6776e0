"""cupy_attn.distributed: ring attention over MPI, on 1 to 4 ranks (`mpiexec` running
distributed_worker.py on the NumPy backend), against single-process attention on the whole
sequence; shard/unshard and the causal block plan in process; argument errors; NCCL on a GPU."""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import cupy_attn
from cupy_attn import distributed, masks
from cupy_attn.distributed import positions, ring_attention, ring_attention_backward, shard, unshard
from distributed_worker import CASES
from helpers import assert_close, random_qkv
from test_readme import python_blocks

HERE = Path(__file__).resolve().parent
MPI_TIMEOUT_S = 120


def mpiexec() -> str | None:
    """The mpiexec of this environment (the mpich wheel puts it beside python), else PATH's."""
    beside = Path(sysconfig.get_path("scripts")) / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def run_mpi(ranks: int, *args: str) -> subprocess.CompletedProcess:
    if importlib.util.find_spec("mpi4py") is None or mpiexec() is None:
        pytest.skip("needs mpi4py and an mpiexec (pip install '.[test]' installs both, MPICH from the mpich wheel)")
    # MPICH's hydra starts more ranks than there are cores (CI has 2) without extra options.
    return subprocess.run([mpiexec(), "-n", str(ranks), sys.executable, *args], capture_output=True, text=True,
                          timeout=MPI_TIMEOUT_S, cwd=HERE)


@pytest.fixture(scope="module")
def mpi_results():
    """One mpiexec run per ring size, running every case: ranks -> ({case: the worker's JSON line},
    the finished process)."""
    runs = {}

    def results(ranks: int) -> dict:
        if ranks not in runs:
            done = run_mpi(ranks, str(HERE / "distributed_worker.py"))
            lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
            runs[ranks] = ({line["case"]: line for line in lines}, done)
        return runs[ranks]

    return results


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_ring_over_mpi(mpi_results, ranks, case):
    results, done = mpi_results(ranks)
    assert case in results, (f"mpiexec -n {ranks} gave no result for {case} (rc {done.returncode}):\n"
                             f"{done.stderr[-3000:]}")
    if results[case]["skipped"]:
        pytest.skip(results[case]["skipped"])
    errors = results[case]["errors"]
    assert not errors, "\n".join(f"rank {rank}:\n{error}" for rank, error in errors.items())


def test_readme_example_runs_under_mpiexec(tmp_path):
    (code,) = python_blocks("Context parallelism")
    script = tmp_path / "ring.py"
    script.write_text(code)
    done = run_mpi(2, str(script))
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("load_balance", distributed.LOAD_BALANCES)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_shard_unshard_round_trip(rng, load_balance, size):
    seq = 2 * size * 3
    x = rng.standard_normal((2, 3, seq, 5))
    for layout, full in (("bhsd", x), ("bshd", x.transpose(0, 2, 1, 3)), ("bhsd", x[..., 0])):  # the last: an lse
        shards = [shard(full, r, size, layout=layout, load_balance=load_balance) for r in range(size)]
        axis = distributed.SEQ_AXIS[layout]
        for r, s in enumerate(shards):
            assert s.flags.c_contiguous
            assert (s == np.take(full, positions(r, size, seq, load_balance=load_balance), axis=axis)).all()
        assert (unshard(shards, layout=layout, load_balance=load_balance) == full).all()
    every = np.sort(np.concatenate([positions(r, size, seq, load_balance=load_balance) for r in range(size)]))
    assert (every == np.arange(seq)).all()


def test_positions():
    assert positions(0, 2, 8).tolist() == [0, 1, 6, 7]  # zigzag: chunks r and 2P - 1 - r of 2P
    assert positions(1, 2, 8).tolist() == [2, 3, 4, 5]
    assert positions(1, 3, 6, load_balance="striped").tolist() == [1, 4]
    assert positions(2, 3, 6, load_balance="contiguous").tolist() == [4, 5]


@pytest.mark.parametrize("load_balance", distributed.LOAD_BALANCES)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_causal_pieces_cover_exactly_the_visible_keys(load_balance, size):
    """The union of each block's pieces, as attention's causal keywords define them, is the
    global causal mask between the two shards; and fully hidden blocks have no piece."""
    seq = 2 * size * 3
    n = seq // size
    for rank in range(size):
        for source in range(size):
            want = positions(source, size, seq, load_balance=load_balance)[None, :] <= \
                positions(rank, size, seq, load_balance=load_balance)[:, None]
            got = np.zeros((n, n), bool)
            for rows, keys, causal in distributed._pieces(True, load_balance, rank, source, n):
                sq, sk = len(range(n)[rows]), len(range(n)[keys])
                visible = masks.causal_mask(sq, sk, "bottom_right") if causal else np.ones((sq, sk), bool)
                assert not got[rows, keys].any(), "pieces overlap"
                got[rows, keys] = visible
            assert (got == want).all(), (rank, source)
            assert want.any() or not distributed._pieces(True, load_balance, rank, source, n)


def test_shard_rejects_lengths_that_do_not_divide():
    x = np.zeros((1, 1, 12, 4))
    with pytest.raises(ValueError, match=r"length 12 .* multiple of 8"):
        shard(x, 0, 4)  # zigzag: 2P = 8 chunks
    with pytest.raises(ValueError, match=r"multiple of 5"):
        shard(x, 0, 5, load_balance="contiguous")
    with pytest.raises(ValueError, match="rank must be"):
        shard(x, 3, 3, load_balance="striped")
    with pytest.raises(ValueError, match="load_balance must be one of"):
        shard(x, 0, 2, load_balance="ring")
    with pytest.raises(ValueError, match="shards"):
        unshard([x, x[:, :, :6]], load_balance="contiguous")


def test_shard_takes_a_3d_lse_only_in_layout_bhsd():
    lse = np.arange(32.0).reshape(1, 4, 8)  # (B, H, S): ring_attention's lse in every layout
    assert shard(lse, 0, 2).shape == (1, 4, 4)
    with pytest.raises(ValueError, match=r"x must be 4-D \(B, S, H, D\) \(or an lse \(B, H, S\) with layout 'bhsd'\)"):
        shard(lse, 0, 2, layout="bshd")  # would have cut H
    with pytest.raises(ValueError, match=r"shards\[0\] must be 4-D"):
        unshard([shard(lse, r, 2) for r in range(2)], layout="bshd")


class NcclCommunicator:  # stands for cupy.cuda.nccl.NcclCommunicator: the type the transport checks for
    __module__ = "cupy_backends.cuda.libs.nccl"


def test_ring_attention_argument_errors(rng):
    """Every one raised before any communication (comm is not even a communicator here, except
    where the communicator itself is the error)."""
    q, k, v = random_qkv(rng, b=1, h=2, sq=6, sk=6, d=4)
    with pytest.raises(ValueError, match="alibi_slopes is not supported"):
        ring_attention(q, k, v, None, alibi_slopes=[0.1, 0.2])
    with pytest.raises(ValueError, match="window is not supported"):
        ring_attention(q, k, v, None, window=(4, 0))
    with pytest.raises(ValueError, match="load_balance must be one of"):
        ring_attention(q, k, v, None, load_balance="none")
    with pytest.raises(ValueError, match="even shard length"):
        ring_attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], None, causal=True)
    with pytest.raises(ValueError, match="one length"):
        ring_attention(q, k[:, :, :4], v[:, :, :4], None, causal=True)
    with pytest.raises(ValueError, match="layout must be one of"):
        ring_attention(q, k, v, None, layout="thd")
    with pytest.raises(TypeError, match="comm must be an mpi4py.MPI.Comm or a cupy.cuda.nccl.NcclCommunicator"):
        ring_attention(q, k, v, "comm")
    with pytest.raises(TypeError, match="NCCL communicator, which moves CuPy arrays"):
        ring_attention(q, k, v, NcclCommunicator())
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        ring_attention_backward(q, q, k, v, q, q[..., 0], None, deterministic=1)
    with pytest.raises(TypeError, match="comm must be"):  # a NumPy bool is a flag, as in attention_backward
        ring_attention_backward(q, q, k, v, q, q[..., 0], None, deterministic=np.True_)
    with pytest.raises(TypeError, match="return_lse must be a bool, got str"):
        ring_attention(q, k, v, None, return_lse="yes")
    with pytest.raises(ValueError, match="dout must have the forward output's shape"):
        ring_attention_backward(q[:, :, :4], q, k, v, q, q[..., 0].astype(np.float32), "comm")


def test_import_does_not_import_mpi4py_or_cupy():
    code = "import sys, cupy_attn.distributed; assert not {'mpi4py', 'cupy'} & set(sys.modules), sys.modules.keys()"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.gpu
@pytest.mark.parametrize("load_balance", ["zigzag", "contiguous"])
def test_nccl_one_rank_ring_matches_attention(load_balance):
    """A 1-rank NCCL ring (its K/V never move, but the backward's dK/dV go through ncclSend and
    ncclRecv to itself, and the shape check through ncclAllGather) against attention."""
    cupy = pytest.importorskip("cupy")
    from cupy.cuda import nccl

    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    rng = np.random.default_rng(0)
    dtype = np.dtype(np.float16)
    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, b=2, h=4, hkv=2, sq=256, sk=256, d=64, dv=32, dtype=dtype))
    dout = cupy.asarray(rng.standard_normal((2, 4, 256, 32)).astype(dtype))
    out, lse = ring_attention(q, k, v, comm, causal=True, load_balance=load_balance, return_lse=True)
    want_out, want_lse = cupy_attn.attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(out, cupy.ndarray) and out.dtype == dtype
    assert_close(out.get(), want_out.get(), dtype, what="out")
    assert_close(lse.get(), want_lse.get(), dtype, what="lse")
    grads = ring_attention_backward(dout, q, k, v, out, lse, comm, causal=True, load_balance=load_balance)
    want = cupy_attn.attention_backward(dout, q, k, v, want_out, want_lse, causal=True)
    for name, got, w in zip(("dq", "dk", "dv"), grads, want):
        assert_close(got.get(), w.get(), dtype, grad=True, what=name)
