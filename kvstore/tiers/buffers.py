"""Helpers of the memory and cold tiers: byte views of page buffers, copies that start no thread
team, the remap lock, the malloc tuning that keeps LMDB's write buffers between transactions, and
early writeback during commits."""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import threading
from contextlib import contextmanager

import numpy as np
import torch

from kvstore.pages import native_copy

MiB = 1 << 20

_malloc_tuned = {"mmap": 0, "trim": 0}


def keep_write_buffers(record_bytes: int, txn_bytes: int) -> None:
    """Let glibc keep the memory of LMDB's write buffers between transactions.

    Without writemap, LMDB mallocs a dirty copy of every value (one record) in a write
    transaction and frees it at commit. glibc then returns that heap to the kernel, so
    each transaction page-faults its whole size in again: measured 2-3x slower writes of
    2 MiB pages. Raising the mmap and trim thresholds (process-wide, only ever upwards,
    the trim threshold at most 1 GiB) keeps the buffers of a `txn_bytes` transaction,
    and values of `record_bytes`, on the heap for reuse. The writer is not the main
    thread, so its heaps are per-thread arenas, which glibc unmaps whole once empty
    unless the top pad is at least a heap (64 MiB); the pad is address space, not memory.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    mmap_threshold = min(32 * MiB, max(4 * MiB, round_up(2 * record_bytes)))
    trim_threshold = min(1 << 30, max(256 * MiB, round_up(2 * txn_bytes)))
    if mmap_threshold <= _malloc_tuned["mmap"] and trim_threshold <= _malloc_tuned["trim"]:
        return
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return
    mmap_threshold = max(mmap_threshold, _malloc_tuned["mmap"])
    trim_threshold = max(trim_threshold, _malloc_tuned["trim"])
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
    if (mallopt(M_MMAP_THRESHOLD, mmap_threshold) and mallopt(M_TRIM_THRESHOLD, trim_threshold)
            and mallopt(M_TOP_PAD, 64 * MiB)):
        _malloc_tuned.update(mmap=mmap_threshold, trim=trim_threshold)


_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 * MiB
@functools.lru_cache(maxsize=None)
def libc_function(name: str, *argtypes):
    """libc's function `name` with these argument types (its errno kept), or None off Linux or where
    libc lacks it."""
    if platform.system() != "Linux":
        return None
    fn = getattr(ctypes.CDLL(None, use_errno=True), name, None)
    if fn is not None:
        fn.argtypes = list(argtypes)
        fn.restype = ctypes.c_int
    return fn


def libc_madvise():
    """libc's madvise(addr, length, advice), or None off Linux / glibc."""
    return libc_function("madvise", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def huge_page_buffer(nbytes: int, zero: bool = False) -> torch.Tensor:
    """A host buffer of nbytes (uint8), 2 MiB aligned, that the kernel is asked to back with
    transparent huge pages (madvise MADV_HUGEPAGE, for where THP is in its `madvise` mode) before
    anything touches it: a first write then faults once per 2 MiB, not once per 4 KiB (235 MB
    written into a new buffer: 30 ms against 84 ms here). Best effort: plain pages where madvise or
    THP is missing."""
    span = round_up(nbytes, _HUGE_PAGE)
    buf = torch.empty(span + _HUGE_PAGE, dtype=torch.uint8)
    start = round_up(buf.data_ptr(), _HUGE_PAGE) - buf.data_ptr()   # whole huge pages, 2 MiB aligned
    buf = buf[start:start + nbytes]
    if nbytes >= _HUGE_PAGE and (madvise := libc_madvise()) is not None:
        madvise(buf.data_ptr(), span, _MADV_HUGEPAGE)
    if zero:
        buf.zero_()
    return buf


_MADV_POPULATE_WRITE = 23      # Linux 5.14+
_POPULATE_CHUNK = 64 * MiB


class Populator:
    """Faults in a lazily allocated host buffer on a thread of its own, 64 MiB at a time (madvise
    MADV_POPULATE_WRITE: it allocates the pages that are not there yet and changes no byte, so
    slots written meanwhile keep their bytes). A page's first write costs a fault (here, in a VM,
    about 9 us a 4 KiB page: a document's 117 MB demoted from hot into untouched warm slots took
    0.26 s against 9 ms once they had been touched) and it would be paid on the engine's thread,
    while a request waits. `stop` ends it early (the tier closes); the thread holds the buffer
    until it ends. Best effort: nothing where madvise or MADV_POPULATE_WRITE is missing."""

    def __init__(self, buf: torch.Tensor, name: str):
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None
        madvise = libc_madvise()
        if madvise is None or buf.numel() * buf.element_size() < _POPULATE_CHUNK:
            return
        self.thread = threading.Thread(target=self._run, args=(madvise, buf), name=name, daemon=True)
        self.thread.start()

    def _run(self, madvise, buf: torch.Tensor) -> None:
        start, end = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
        first = round_up(start, 4096)
        for a in range(first, end, _POPULATE_CHUNK):
            if self.stopped.is_set() or madvise(a, min(_POPULATE_CHUNK, (end - a) // 4096 * 4096),
                                                _MADV_POPULATE_WRITE):
                return   # stopped, or the kernel has no MADV_POPULATE_WRITE (EINVAL): first writes fault

    def stop(self) -> None:
        self.stopped.set()


def round_up(n: int, to: int = MiB) -> int:
    return -(-n // to) * to


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}   # numpy has no bfloat16


def copy_serial(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src for CPU tensors of one shape and element size, on the calling thread alone.

    PyTorch splits a large copy over its OpenMP threads, and an OpenMP region started by any
    thread but the engine's gives that thread a thread team of its own: on a machine with as many
    cores as the engine's threads, the two teams then take turns at the cores and every step of
    the engine slows down for as long as the process lives (decode 8 x 128 on two cores: 113
    against 154 tokens/s with write-behind running). The store copies pages from its daemon and
    write-behind threads, so its CPU copies go through the native copy (_copy_blocks: a MiB or
    more) or numpy, neither of which starts threads.
    """
    if dst.shape != src.shape or dst.element_size() != src.element_size():
        raise ValueError(f"copy of {tuple(src.shape)} x {src.element_size()} bytes into "
                         f"{tuple(dst.shape)} x {dst.element_size()} bytes")
    if dst.numel() * dst.element_size() < _STREAM_BYTES or not _copy_blocks(dst, src):
        np.copyto(_int_view(dst), _int_view(src), casting="no")


_STREAM_BYTES = MiB            # copy_serial streams copies this large past the cache, in blocks
_STREAM_BLOCK_BYTES = 4096     # of at least this many contiguous bytes


def _copy_blocks(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """dst[...] = src by native_copy.copy_blocks, on the calling thread: the two seen as the same
    blocks of contiguous bytes (their innermost dimensions that both lay out in row-major order,
    _STREAM_BLOCK_BYTES or more), every block's address listed, one native call. A page moved
    between tiers is written with non-temporal stores, not read for ownership first: one thread
    streamed 2 MiB pages at 9.5-9.8 GB/s where np.copyto gave 6.6 (BENCHMARKS.md). False, nothing
    copied, where the tensors have no such blocks or the native copy cannot be had."""
    native = native_copy.copier()
    if native is None or dst.dim() == 0:
        return False
    shape, size = list(dst.shape), dst.element_size()
    inner, block = len(shape), size   # dims inner.. are one contiguous block in both
    while inner > 0 and dst.stride(inner - 1) * size == block and src.stride(inner - 1) * size == block:
        inner -= 1
        block *= shape[inner]
    if block < _STREAM_BLOCK_BYTES:
        return False
    dsts, srcs = np.array([dst.data_ptr()], np.int64), np.array([src.data_ptr()], np.int64)
    for dim in range(inner):   # every block's address: the outer dimensions' offsets, added up
        steps = np.arange(shape[dim], dtype=np.int64)
        dsts = (dsts[:, None] + steps * (dst.stride(dim) * size)).reshape(-1)
        srcs = (srcs[:, None] + steps * (src.stride(dim) * size)).reshape(-1)
    native.copy_blocks(dsts, srcs, block)
    return True


def copy_bytes_serial(dst: torch.Tensor, payload) -> None:
    """dst[...] = the elements in `payload` (a buffer of dst's bytes, in row-major order), as copy_serial."""
    out = _int_view(dst)
    src = np.frombuffer(payload, dtype=np.uint8)
    if src.nbytes != out.nbytes:
        raise ValueError(f"payload is {src.nbytes} bytes, the destination {out.nbytes}")
    np.copyto(out, src.view(out.dtype).reshape(out.shape), casting="no")


def _int_view(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's elements as integers of their size."""
    return t.detach().view(_INT_OF_SIZE[t.element_size()]).numpy()


def as_byte_view(payload) -> memoryview:
    """A flat byte view of a CPU tensor, numpy array or any contiguous buffer (no copy)."""
    if isinstance(payload, torch.Tensor):
        if payload.device.type != "cpu" or not payload.is_contiguous():
            raise ValueError("page payload must be a contiguous CPU tensor")
        payload = payload.detach().reshape(-1).view(torch.uint8).numpy()
    view = memoryview(payload)
    if not view.c_contiguous:
        raise ValueError("page payload must be contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def as_byte_array(out) -> np.ndarray:
    """A writable flat uint8 numpy view of `out` (CPU tensor, numpy array or writable buffer)."""
    if isinstance(out, torch.Tensor):
        if out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError("read target must be a contiguous CPU tensor")
        arr = out.detach().reshape(-1).view(torch.uint8).numpy()
    elif isinstance(out, np.ndarray):
        if not out.flags.c_contiguous:
            raise ValueError("read target must be a contiguous array")
        arr = out.reshape(-1).view(np.uint8)
    else:
        arr = np.frombuffer(out, dtype=np.uint8)
    if not arr.flags.writeable:
        raise ValueError("read target is not writable")
    return arr


def read_target(out, nbytes: int):
    """`out` checked as a target of `nbytes` bytes to read into: a contiguous CPU tensor as is (its
    address is data_ptr(): no numpy view to build, a few microseconds a page), anything else as
    as_byte_array(out). ValueError naming what is wrong."""
    if isinstance(out, torch.Tensor) and out.device.type == "cpu" and out.is_contiguous():
        size = out.numel() * out.element_size()
    else:
        out = as_byte_array(out)
        size = out.nbytes
    if size != nbytes:
        raise ValueError(f"read target is {size} bytes, a page is {nbytes}")
    return out


class RemapLock:
    """Shared for transactions, exclusive for set_mapsize (which invalidates all of them)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._exclusive = False

    @contextmanager
    def shared(self):
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self):
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._exclusive = True  # new readers wait from here on
            while self._readers:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range():
    """libc's sync_file_range (Linux), or None."""
    return libc_function("sync_file_range", ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint)


@contextmanager
def early_writeback(path: str, interval: float = 0.005):
    """While the block runs, keep asking the kernel to start writing `path`'s dirty pages.

    An LMDB commit copies its pages into the file (pwrite), then waits for all of them in
    fdatasync: without help the disk idles during the copy and the copy waits for nothing.
    A helper thread calling sync_file_range(SYNC_FILE_RANGE_WRITE) every few milliseconds
    starts the writeback of what is already written, so the disk works during the copy.
    It only starts writes early: what is durable when, and in what order LMDB makes it so,
    does not change. A no-op where sync_file_range is missing.
    """
    fn = _sync_file_range()
    try:
        fd = os.open(path, os.O_RDONLY) if fn is not None else -1
    except OSError:
        fd = -1
    if fd < 0:
        yield
        return
    stop = threading.Event()

    def kick() -> None:
        while not stop.wait(interval):
            fn(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)

    thread = threading.Thread(target=kick, name="kvstore-cold-writeback", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        os.close(fd)
