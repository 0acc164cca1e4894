"""FileStage: the cold tier's records brought from the disk into the OS page cache in one
sequential pass, on the reading thread, before they are copied.

A record not in the page cache is read from the disk when it is first touched: LMDB touches its
first page when it looks it up (the kernel reads around that page, as far as the device's
read-ahead reaches: 8 MiB on the VM measured, 128 KiB on many disks), and the copying threads
fault in the rest. Copying threads faulting pages in while another thread reads made a pattern
that a VM's disk served at 0.4-0.6 GB/s, where one thread's sequential pass over the same file ran
at 1.3-3.5 GB/s (BENCHMARKS.md, "The cold read from the disk in one sequential pass"). So
LmdbReader looks a batch's records up before it copies them, and `stage` asks the kernel which
of their pages are still missing (mincore over the map) and faults those in, in address order, a
few MiB a call (madvise MADV_POPULATE_READ: the kernel's own read, no copy into this process).
A batch already in the page cache costs one mincore per stretch of adjacent records.

Linux 5.14+ (MADV_POPULATE_READ); elsewhere `available` is False and reads go on without it.
Nothing here reads a byte of a record: a staged page that is damaged is found by the checksum
afterwards, as any other.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import threading
from typing import Iterable

import numpy as np

from kvstore.tiers.buffers import MiB, libc_function, libc_madvise

_MADV_POPULATE_READ = 22        # Linux 5.14+
STAGE_BYTES = 4 * MiB           # pages faulted in per madvise call
_PAGE = mmap.PAGESIZE


class FileStage:
    """Stages the records of a read (their addresses in a map of the file) that are not in the page
    cache; counts the bytes it brought in (`staged_bytes`). Thread-safe; turns itself off for good
    where the kernel lacks a call it needs."""

    def __init__(self):
        self._mincore = libc_function("mincore", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
        self._madvise = libc_madvise()
        self.available = self._mincore is not None and self._madvise is not None
        self.staged_bytes = 0
        self._lock = threading.Lock()

    def stage(self, spans: Iterable[tuple[int, int]]) -> int:
        """Bring into the page cache the pages of the spans (address, length; in one file mapping,
        valid for the call) that are not there; how many bytes that was."""
        if not self.available:
            return 0
        staged = 0
        for start, end in _stretches(spans):
            resident = np.empty((end - start) // _PAGE, np.uint8)
            if self._mincore(start, end - start, resident.ctypes.data) != 0:
                return self._counted(staged, fail=ctypes.get_errno())
            for a, b in _missing_runs(resident):
                for at in range(start + a * _PAGE, start + b * _PAGE, STAGE_BYTES):
                    n = min(STAGE_BYTES, start + b * _PAGE - at)
                    if self._madvise(at, n, _MADV_POPULATE_READ) != 0:
                        # EFAULT/EIO: a page past the file's end, or unreadable: the copy finds it
                        return self._counted(staged, fail=ctypes.get_errno())
                    staged += n
        return self._counted(staged)

    def _counted(self, staged: int, fail: int = 0) -> int:
        if fail in (errno.EINVAL, errno.ENOSYS):   # no MADV_POPULATE_READ (or mincore) in this kernel
            self.available = False
        with self._lock:
            self.staged_bytes += staged
        return staged


def _stretches(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The spans' pages as sorted, merged [start, end) address ranges, page aligned."""
    pages = sorted((a & ~(_PAGE - 1), (a + n + _PAGE - 1) & ~(_PAGE - 1)) for a, n in spans if n > 0)
    out: list[list[int]] = []
    for s, e in pages:
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _missing_runs(resident: np.ndarray) -> list[tuple[int, int]]:
    """[a, b) page index runs whose mincore byte says not resident."""
    missing = np.concatenate(([0], (resident & 1) == 0, [0])).astype(np.int8)
    edges = np.flatnonzero(np.diff(missing))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))
