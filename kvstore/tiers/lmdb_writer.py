"""LmdbWriter: the cold tier's writes (DiskTier's writer half).

One writer thread owns every write transaction: `put_many` and `delete_many` queue a request
and return a Future that resolves once its transaction committed durably (sync + metasync); up
to `write_batch` queued requests share one transaction, and a failed one fails its futures with
nothing of it visible. The map grows here, under the exclusive remap lock. The rules are
DiskTier's (kvstore/tiers/disk.py); this mixin holds no state of its own.
"""

from __future__ import annotations

import logging
import os
import queue
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Iterable

import lmdb

from kvstore.errors import KVStoreError
from kvstore.pages import record
from kvstore.pages.record import RecordHeader
from kvstore.tiers.buffers import MiB, as_byte_view, early_writeback, keep_write_buffers
from kvstore.tiers.lmdb_env import ColdFull, write_totals

log = logging.getLogger("kvstore.store")

_EARLY_WRITEBACK_BYTES = 8 * MiB   # commits this large start the disk while they still copy


@dataclass
class _Request:
    puts: list[tuple[bytes, list, int]] = field(default_factory=list)   # (key, record parts, length)
    deletes: list[bytes] = field(default_factory=list)
    reserved: int = 0   # bytes this request counts against max_bytes until it commits
    future: Future = field(default_factory=Future)


STOP = object()     # queued by close(): the writer thread ends


class LmdbWriter:
    def put_many(self, items: Iterable[tuple[RecordHeader, object]]) -> Future:
        """Queue records (header, payload) for one durable write; the future resolves after commit.

        The payload (CPU tensor, numpy array, bytes, memoryview) is checksummed now and
        copied by the writer thread: it must stay alive and unchanged until the future
        resolves (a payload changed in between is stored with a bad checksum, so it
        reads as damaged, never as wrong data). Raises KVStoreError, writing nothing,
        when the batch would take the tier above max_bytes.
        """
        puts = []
        for header, payload in items:
            view = as_byte_view(payload)
            if view.nbytes != header.nbytes:
                raise ValueError(f"payload is {view.nbytes} bytes, header says {header.nbytes}")
            parts = record.encode(header, view)
            puts.append((header.key, parts, sum(len(p) for p in parts)))
        req = _Request(puts=puts)
        self._wait_counted()
        # Overwrites reserve only what they add. A record deleted between this lookup and the
        # commit frees its bytes at the same time, so the limit holds either way.
        stored = self._stored_sizes({key for key, _, _ in puts})
        with self._lock:
            self._check_open()
            req.reserved = max(0, sum(n for _, _, n in puts) - sum(stored.values()))
            if self._used + self._reserved + req.reserved > self.max_bytes:
                raise ColdFull(
                    f"cold tier is full: {req.reserved} more bytes would take it above cold.max_bytes "
                    f"= {self.max_bytes} (used {self._used}, pending {self._reserved}); evict first")
            self._reserved += req.reserved
            self._queue.put(req)
        return req.future

    def delete_many(self, keys: Iterable[bytes]) -> Future:
        """Queue deletes (missing keys are ignored); the future resolves after commit."""
        req = _Request(deletes=[bytes(k) for k in keys])
        self._wait_counted()
        with self._lock:
            self._check_open()
            self._queue.put(req)
        return req.future

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every write queued before this call has committed (or failed)."""
        with self._lock:
            self._check_open()
            req = _Request()
            self._queue.put(req)
        req.future.result(timeout)

    def _check_open(self) -> None:
        if self._closed:
            raise KVStoreError(f"cold tier at {self.path} is closed")

    def _write_loop(self) -> None:
        if not self._counted.is_set():
            self._count_totals()
        stop = False
        while not stop:
            first = self._queue.get()
            if first is STOP:
                break
            batch = [first]
            while len(batch) < self.write_batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is STOP:
                    stop = True
                    break
                batch.append(nxt)
            live = []
            for req in batch:
                if req.future.set_running_or_notify_cancel():
                    live.append(req)
                else:  # cancelled before it was written: drop it
                    self._unreserve(req)
            self._write_batch(live)

    def _unreserve(self, req: _Request) -> None:
        with self._lock:
            self._reserved -= req.reserved

    def _write_batch(self, batch: list[_Request]) -> None:
        try:
            self._commit(batch)
        except Exception as exc:
            if len(batch) > 1:  # one bad request must not sink the others
                for req in batch:
                    self._write_batch([req])
                return
            if isinstance(exc, lmdb.Error):
                exc = self._write_error(exc, batch[0])
            self._unreserve(batch[0])
            batch[0].future.set_exception(exc)
            return
        for req in batch:
            req.future.set_result(None)

    def _write_error(self, exc: lmdb.Error, req: _Request) -> KVStoreError:
        """A failed write transaction: ColdFull when the filesystem is out of room (ENOSPC, or the
        short write LMDB reports as EIO with the disk full), else KVStoreError."""
        need = sum(n for _, _, n in req.puts)
        try:
            st = os.statvfs(self.path)
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = None
        if isinstance(exc, lmdb.DiskError) or (need and free is not None and free < need + MiB):
            return ColdFull(f"cold tier write failed at {self.path}: its filesystem is full "
                            f"({free if free is not None else '?'} bytes free; {exc})")
        return KVStoreError(f"cold tier write failed at {self.path}: {exc}")

    def _commit(self, batch: list[_Request]) -> None:
        if not any(r.puts or r.deletes for r in batch):
            return
        batch_bytes = sum(n for r in batch for _, _, n in r.puts)
        keep_write_buffers(self._record_bytes, batch_bytes)
        self._grow_map(batch_bytes, before=True)
        while True:
            try:
                if batch_bytes >= _EARLY_WRITEBACK_BYTES:
                    with early_writeback(os.path.join(self.path, "data.mdb")):
                        used, count = self._write_txn(batch)
                else:
                    used, count = self._write_txn(batch)
                break  # committed
            except lmdb.MapFullError:
                self._grow_map()
        with self._lock:
            self._used, self._count = used, count
            for req in batch:
                self._reserved -= req.reserved

    def _write_txn(self, batch: list[_Request]) -> tuple[int, int]:
        """One write transaction of the batch, totals in `meta` included; the new totals."""
        used, count = self._used, self._count   # only this thread changes them
        with self._env.begin(write=True, buffers=True) as txn:
            pages = self._pages
            for req in batch:
                for key, parts, length in req.puts:
                    old = txn.get(key, db=pages)   # a view into the map; only its length is used
                    used += length - (len(old) if old is not None else 0)
                    count += old is None
                    txn.put(key, self._assemble(parts, length), db=pages)
                for key in req.deletes:
                    old = txn.get(key, db=pages)
                    if old is not None:
                        used -= len(old)
                        count -= 1
                        txn.delete(key, db=pages)
            write_totals(txn, self._meta, used, count)
        return used, count

    def _assemble(self, parts: list, length: int) -> memoryview:
        """The record in the writer's scratch buffer: one copy, into memory that stays hot.

        LMDB copies the value during put, so the buffer is reused for the next record.
        """
        if len(self._scratch) < length:
            self._scratch = bytearray(length)
        out = memoryview(self._scratch)[:length]
        pos = 0
        for part in parts:  # 1-D byte buffers
            out[pos:pos + len(part)] = part
            pos += len(part)
        return out

    def _grow_map(self, batch_bytes: int = 0, before: bool = False) -> None:
        """Double the map (up to map_size_max): after MapFullError, or before a batch that cannot fit.

        Growing ahead spares a transaction that would fail halfway; the estimate ignores
        free pages LMDB may reuse, so ahead of a batch it only grows up to the cap and
        never fails.
        """
        if before:
            info, psize = self._env.info(), self._env.stat()["psize"]
            need = (info["last_pgno"] + 1) * psize + batch_bytes + batch_bytes // 8 + MiB
            if need <= self.map_size or self.map_size >= self.map_size_max:
                return
            new_size = self.map_size
            while new_size < need and new_size < self.map_size_max:
                new_size = min(new_size * 2, self.map_size_max)
        elif self.map_size >= self.map_size_max:
            raise ColdFull(f"cold tier map is full at {self.map_size} bytes (cold.map_size_max)")
        else:
            new_size = min(self.map_size * 2, self.map_size_max)
        with self._remap.exclusive():
            self._env.set_mapsize(new_size)
        self.map_size = new_size
        self.map_grows += 1

    # --- the tier interface (handles: keys; reads and writes take RecordHeaders) --
