"""Ring transports for context parallelism: each rank sends blocks to the next rank while it
receives the previous rank's, over MPI (mpi4py) or NCCL (CuPy).

Both engines sit behind one small interface, `Ring`: ``rank``, ``size``, ``start(sends, recvs,
channel)`` (begin sending each array of ``sends`` to rank + 1 and receiving rank − 1's into
``recvs``; the caller computes meanwhile), ``wait(transfer)``, ``send_recv`` (both at once) and
``check_same`` (every rank agrees on a tuple of ints, or every rank raises). mpi4py and CuPy are
never imported here unless the caller handed over one of their communicators.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np

from ._arrays import describe

# MPI tags of the ring's messages: channel c, array i of a transfer -> _TAG + 8·c + i. Distinct
# channels keep two transfers that are under way at once (the K/V blocks and the backward's
# dK/dV) from matching each other's messages; the offset keeps clear of tags a caller may use.
_TAG = 0x5247


def ring_of(comm, xp) -> "Ring":
    """The transport for ``comm`` (an mpi4py communicator or a CuPy NcclCommunicator) moving
    arrays of ``xp`` (numpy or cupy); TypeError for anything else, or for arrays it cannot move."""
    root = type(comm).__module__.split(".")[0]
    if root == "mpi4py" and hasattr(comm, "Isend"):
        return MpiRing(comm, xp)
    if root in ("cupy", "cupy_backends") and type(comm).__name__ == "NcclCommunicator":
        return NcclRing(comm, xp)
    raise TypeError(f"comm must be an mpi4py.MPI.Comm or a cupy.cuda.nccl.NcclCommunicator, got {describe(comm)}")


@dataclass
class Transfer:
    """A transfer under way: the engine's handle, and the arrays it reads and writes, kept alive
    until it is waited for (CuPy's memory pool would otherwise hand them out again while the
    transfer still uses them)."""

    handle: object
    arrays: tuple


class Ring:
    """Send to rank + 1, receive from rank − 1 (mod size); a 1-rank ring sends to itself."""

    rank: int
    size: int

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.size

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.size

    def start(self, sends, recvs, channel: int = 0) -> Transfer:
        """Begin sending each array of ``sends`` to the next rank and receiving the previous
        rank's into ``recvs`` (C-contiguous, pairwise of one shape and dtype). ``channel``
        separates transfers under way at the same time; every rank must start the same
        transfers in the same order."""
        if len(sends) != len(recvs):
            raise ValueError(f"start takes as many receive buffers as arrays to send, got {len(sends)} and "
                             f"{len(recvs)}")
        for s, r in zip(sends, recvs):
            if s.shape != r.shape or s.dtype != r.dtype or not (s.flags.c_contiguous and r.flags.c_contiguous):
                raise ValueError("each array sent and its receive buffer must be C-contiguous and of one shape and "
                                 f"dtype, got {describe(s)} and {describe(r)}")
        return Transfer(self._start(list(sends), list(recvs), channel), (*sends, *recvs))

    def wait(self, transfer: Transfer) -> None:
        """Until the transfer is done: its receive buffers are then ready for the caller's work
        (with CuPy, for the work queued after this call on the current stream)."""
        self._wait(transfer.handle)

    def send_recv(self, sends, recvs, channel: int = 0) -> None:
        self.wait(self.start(sends, recvs, channel))

    def check_same(self, what: str, names, values) -> None:
        """Raise ValueError on every rank unless every rank passed the same ``values`` (ints,
        named by ``names``): a collective call."""
        values = tuple(int(x) for x in values)
        every = [tuple(int(x) for x in row) for row in self._allgather(values)]
        if any(row != every[0] for row in every):
            named = "; ".join(f"rank {r}: " + ", ".join(f"{n}={x}" for n, x in zip(names, row))
                              for r, row in enumerate(every))
            raise ValueError(f"the ranks of comm disagree on {what}: {named}")


def _byte_view(x):
    """The bytes of a C-contiguous array, as a 1-D uint8 view: every dtype (bfloat16 too) moves
    as raw bytes, with no MPI or NCCL datatype needed for it."""
    return x.reshape(-1).view(np.uint8)


def _mpi_cuda_aware(comm) -> bool:
    """Whether ``comm`` takes CUDA device buffers: MPI 4.1's info key mpi_memory_alloc_kinds
    lists the memory kinds a communicator accepts ("cuda" or "cuda:device" for device memory)."""
    try:
        info = comm.Get_info()
    except Exception:  # an MPI before 4.1 without communicator info
        return False
    try:
        kinds = info.Get("mpi_memory_alloc_kinds") or ""
    finally:
        info.Free()
    for kind in kinds.split(","):
        name, *restrictors = kind.strip().split(":")
        if name == "cuda" and (not restrictors or "device" in restrictors):
            return True
    return False


class MpiRing(Ring):
    """Isend/Irecv + Waitall over an mpi4py communicator. NumPy arrays; CuPy arrays only where
    the MPI library is CUDA-aware (nothing is copied through the host behind the caller's back).

    MPI progresses a transfer inside MPI calls unless the library runs a progress thread
    (MPICH: MPIR_CVAR_ASYNC_PROGRESS=1): messages small enough to go eagerly leave at Isend,
    larger ones may move only at Waitall, which then limits the overlap with computation."""

    def __init__(self, comm, xp):
        if xp is not np and not _mpi_cuda_aware(comm):
            raise TypeError("q, k and v are CuPy arrays but comm is an MPI communicator that does not report CUDA "
                            "support (mpi_memory_alloc_kinds has no 'cuda'); pass NumPy arrays, a CUDA-aware MPI, "
                            "or a cupy.cuda.nccl.NcclCommunicator")
        self.comm, self.xp = comm, xp
        self.mpi = importlib.import_module("mpi4py.MPI")
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def _start(self, sends, recvs, channel):
        if self.xp is not np:  # MPI reads device memory outside CUDA's stream order
            self.xp.cuda.get_current_stream().synchronize()
        requests = []
        for i, (s, r) in enumerate(zip(sends, recvs)):
            tag = _TAG + 8 * channel + i
            requests.append(self.comm.Irecv(_byte_view(r), source=self.prev, tag=tag))
            requests.append(self.comm.Isend(_byte_view(s), dest=self.next, tag=tag))
        return requests

    def _wait(self, requests):
        self.mpi.Request.Waitall(requests)

    def _allgather(self, values):
        return self.comm.allgather(values)


class NcclRing(Ring):
    """ncclSend/ncclRecv in one group per transfer, on a stream of its own, ordered against the
    caller's current stream by events: the transfer starts once the work queued so far (which
    writes the arrays to send, and last read the receive buffers) is done, and work queued after
    `wait` sees the received arrays. The host never waits."""

    def __init__(self, comm, xp):
        if xp is np:
            raise TypeError("q, k and v are NumPy arrays but comm is a NCCL communicator, which moves CuPy arrays; "
                            "pass CuPy arrays or an mpi4py communicator")
        self.comm, self.xp = comm, xp
        self.nccl = importlib.import_module("cupy.cuda.nccl")
        self.rank, self.size = comm.rank_id(), comm.size()
        self.stream = xp.cuda.Stream(non_blocking=True)

    def _event_on(self, stream):
        event = self.xp.cuda.Event(disable_timing=True)
        event.record(stream)
        return event

    def _start(self, sends, recvs, channel):  # one stream orders the transfers: no channel needed
        self.stream.wait_event(self._event_on(self.xp.cuda.get_current_stream()))
        self.nccl.groupStart()
        try:
            for s, r in zip(sends, recvs):
                self.comm.send(s.data.ptr, s.nbytes, self.nccl.NCCL_INT8, self.next, self.stream.ptr)
                self.comm.recv(r.data.ptr, r.nbytes, self.nccl.NCCL_INT8, self.prev, self.stream.ptr)
        finally:
            self.nccl.groupEnd()
        return self._event_on(self.stream)

    def _wait(self, done):
        self.xp.cuda.get_current_stream().wait_event(done)

    def _allgather(self, values):
        xp = self.xp
        send = xp.asarray(np.asarray(values, dtype=np.int64))
        every = xp.empty((self.size, len(values)), dtype=np.int64)
        self.comm.allGather(send.data.ptr, every.data.ptr, len(values), self.nccl.NCCL_INT64,
                            xp.cuda.get_current_stream().ptr)
        return every.get().tolist()
