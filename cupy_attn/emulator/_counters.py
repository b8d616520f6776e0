"""Memory-access counters over emulated launches: ``with counting() as counters: ...``.

Every launch inside the block records, per kernel and per counted access site (file:line of the
helper call: ldmatrix and cp.async in ptx.cuh, the tile helpers' plain loads and stores, epilogue
stores and atomics; see emu_counters.h for the bank and sector rules), the shared-memory
wavefronts or global 32-byte sectors its warp-wide accesses took and the fewest they could have.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

# The counters of the innermost counting() block of this thread (and asyncio task): another
# thread's launches meanwhile are not its own.
_active: ContextVar["MemoryCounters | None"] = ContextVar("cupy_attn_memory_counters", default=None)


@dataclass
class SiteCount:
    kernel: str
    site: str       # file:line
    space: str      # "shared" (wavefronts) or "global" (32-byte sectors)
    accesses: int   # warp-wide
    lanes: int      # lane accesses in them
    actual: int
    ideal: int

    @property
    def ratio(self) -> float:
        return self.actual / self.ideal if self.ideal else 1.0


class MemoryCounters:
    """What the launches of one ``counting()`` block recorded, summed over launches."""

    def __init__(self):
        self._sites: dict[tuple[str, str, str], SiteCount] = {}

    def add(self, kernel: str, text: str):
        for line in text.splitlines():
            file, number, space, accesses, lanes, actual, ideal = line.split("\t")
            space = "shared" if space == "0" else "global"
            key = (kernel, f"{Path(file).name}:{number}", space)  # kernels/ is flat: the name is enough
            site = self._sites.setdefault(key, SiteCount(kernel, key[1], space, 0, 0, 0, 0))
            site.accesses += int(accesses)
            site.lanes += int(lanes)
            site.actual += int(actual)
            site.ideal += int(ideal)

    @property
    def sites(self) -> list[SiteCount]:
        return sorted(self._sites.values(), key=lambda s: (s.kernel, s.space, s.site))

    def totals(self, kernel: str | None = None) -> dict[str, dict[str, int]]:
        """{"shared": {"actual", "ideal"}, "global": {...}} over every site (of one kernel)."""
        out = {space: {"actual": 0, "ideal": 0} for space in ("shared", "global")}
        for s in self._sites.values():
            if kernel is None or s.kernel == kernel:
                out[s.space]["actual"] += s.actual
                out[s.space]["ideal"] += s.ideal
        return out

    def kernels(self) -> list[str]:
        return sorted({s.kernel for s in self._sites.values()})


@contextmanager
def counting():
    """Count the memory accesses of every emulated launch in the block."""
    counters = MemoryCounters()
    token = _active.set(counters)
    try:
        yield counters
    finally:
        _active.reset(token)


def active() -> MemoryCounters | None:
    return _active.get()
