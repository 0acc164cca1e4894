"""Helpers of the memory and cold tiers: byte views of page buffers, copies that start no thread
team, the remap lock, the malloc tuning that keeps LMDB's write buffers between transactions, and
early writeback during commits."""

from __future__ import annotations

import ctypes
import os
import platform
import threading
from contextlib import contextmanager

import numpy as np
import torch

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
    write-behind threads, so its CPU copies go through numpy, which starts no threads.
    """
    if dst.shape != src.shape or dst.element_size() != src.element_size():
        raise ValueError(f"copy of {tuple(src.shape)} x {src.element_size()} bytes into "
                         f"{tuple(dst.shape)} x {dst.element_size()} bytes")
    np.copyto(_int_view(dst), _int_view(src), casting="no")


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
_libc_sync_file_range = None


def _sync_file_range():
    """libc's sync_file_range (Linux), or None."""
    global _libc_sync_file_range
    if _libc_sync_file_range is None:
        fn = None
        if platform.system() == "Linux":
            fn = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)
        if fn is not None:
            fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
            fn.restype = ctypes.c_int
        _libc_sync_file_range = fn or False
    return _libc_sync_file_range or None


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
