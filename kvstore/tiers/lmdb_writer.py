"""LmdbWriter: the cold tier's writes, on the one writer thread that owns every write transaction.

`put_many` and `delete_many` queue a request and return a Future that resolves once its
transaction committed durably (sync + metasync); up to `write_batch` queued requests share one
transaction, and a failed one fails its futures with nothing of it visible. The map grows here,
under the exclusive remap lock. DiskTier (disk.py) holds one, on the tier's LmdbEnv and Totals
(lmdb_env.py); the rules are DiskTier's.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Iterable

import lmdb

from kvstore.errors import KVStoreError
from kvstore.pages import record
from kvstore.pages.record import RecordHeader
from kvstore.tiers.buffers import MiB, as_byte_view, early_writeback, keep_write_buffers
from kvstore.tiers.lmdb_env import ColdFull, LmdbEnv, Totals, count_totals, write_totals

_EARLY_WRITEBACK_BYTES = 8 * MiB   # commits this large start the disk while they still copy


@dataclass
class _Request:
    puts: list[tuple[bytes, list, int]] = field(default_factory=list)   # (key, record parts, length)
    deletes: list[bytes] = field(default_factory=list)
    reserved: int = 0   # bytes this request counts against max_bytes until it commits
    future: Future = field(default_factory=Future)


STOP = object()     # queued by close(): the writer thread ends


class LmdbWriter:
    """The writer thread of the store `env`: it commits queued requests in batches of up to
    `write_batch`, keeps `totals` (counting them first when they are not exact) and grows the
    map up to `map_size_max`. `record_bytes` is the largest record, for keep_write_buffers."""

    def __init__(self, env: LmdbEnv, totals: Totals, write_batch: int, record_bytes: int, map_size_max: int):
        self.env = env
        self.totals = totals
        self.write_batch = max(1, write_batch)
        self.record_bytes = record_bytes
        self.map_size_max = map_size_max
        self.map_grows = 0
        self._lock = threading.Lock()   # queueing against close(): nothing is queued after STOP
        self._scratch = bytearray(0)    # the writer thread's record buffer
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write_loop, name="kvstore-cold-writer", daemon=True)
        self._thread.start()

    def put_many(self, items: Iterable[tuple[RecordHeader, object]]) -> Future:
        """Queue records (header, payload) for one durable write; the future resolves after commit.

        The payload (CPU tensor, numpy array, bytes, memoryview) is checksummed now and
        copied by the writer thread: it must stay alive and unchanged until the future
        resolves (a payload changed in between is stored with a bad checksum, so it
        reads as damaged, never as wrong data). Raises ColdFull, writing nothing, when the
        batch would take the tier above max_bytes.
        """
        puts = []
        for header, payload in items:
            view = as_byte_view(payload)
            if view.nbytes != header.nbytes:
                raise ValueError(f"payload is {view.nbytes} bytes, header says {header.nbytes}")
            parts = record.encode(header, view)
            puts.append((header.key, parts, sum(len(p) for p in parts)))
        req = _Request(puts=puts)
        self.totals.wait()
        # Overwrites reserve only what they add. A record deleted between this lookup and the
        # commit frees its bytes at the same time, so the limit holds either way.
        stored = self.env.lengths({key for key, _, _ in puts})
        req.reserved = max(0, sum(n for _, _, n in puts) - sum(stored.values()))
        return self._submit(req, reserve=True)

    def delete_many(self, keys: Iterable[bytes]) -> Future:
        """Queue deletes (missing keys are ignored); the future resolves after commit."""
        req = _Request(deletes=[bytes(k) for k in keys])
        self.totals.wait()
        return self._submit(req)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every write queued before this call has committed (or failed)."""
        self._submit(_Request()).result(timeout)

    def _submit(self, req: _Request, reserve: bool = False) -> Future:
        with self._lock:
            self.env.check_open()
            if reserve:
                self.totals.reserve(req.reserved)
            self._queue.put(req)
        return req.future

    def close(self) -> None:
        """Commit everything queued, then end the writer thread (once `env` is marked closed)."""
        with self._lock:
            self._queue.put(STOP)
        self._thread.join()

    def _write_loop(self) -> None:
        if not self.totals.counted:
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
                    self.totals.release(req.reserved)
            self._write_batch(live)

    def _count_totals(self) -> None:
        """Count `pages` and record the totals in `meta` (before any write)."""
        env = self.env
        try:
            with env.lmdb.begin(write=True, buffers=True) as txn:
                used, count = count_totals(txn, env.pages)
                write_totals(txn, env.meta, used, count)
        except BaseException as exc:  # reported by every accounting call
            self.totals.set_counted(None, exc)
        else:
            self.totals.set_counted((used, count))

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
            self.totals.release(batch[0].reserved)
            batch[0].future.set_exception(exc)
            return
        for req in batch:
            req.future.set_result(None)

    def _write_error(self, exc: lmdb.Error, req: _Request) -> KVStoreError:
        """A failed write transaction: ColdFull when the filesystem is out of room (ENOSPC, or the
        short write LMDB reports as EIO with the disk full), else KVStoreError."""
        path = self.env.path
        need = sum(n for _, _, n in req.puts)
        try:
            st = os.statvfs(path)
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = None
        if isinstance(exc, lmdb.DiskError) or (need and free is not None and free < need + MiB):
            return ColdFull(f"cold tier write failed at {path}: its filesystem is full "
                            f"({free if free is not None else '?'} bytes free; {exc})")
        return KVStoreError(f"cold tier write failed at {path}: {exc}")

    def _commit(self, batch: list[_Request]) -> None:
        if not any(r.puts or r.deletes for r in batch):
            return
        batch_bytes = sum(n for r in batch for _, _, n in r.puts)
        keep_write_buffers(self.record_bytes, batch_bytes)
        self._grow_map(batch_bytes, before=True)
        while True:
            try:
                with (early_writeback(os.path.join(self.env.path, "data.mdb"))
                      if batch_bytes >= _EARLY_WRITEBACK_BYTES else nullcontext()):
                    used, count = self._write_txn(batch)
                break  # committed
            except lmdb.MapFullError:
                self._grow_map()
        self.totals.commit(used, count, sum(req.reserved for req in batch))

    def _write_txn(self, batch: list[_Request]) -> tuple[int, int]:
        """One write transaction of the batch, totals in `meta` included; the new totals."""
        used, count = self.totals.used, self.totals.count   # only this thread changes them
        with self.env.lmdb.begin(write=True, buffers=True) as txn:
            pages = self.env.pages
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
            write_totals(txn, self.env.meta, used, count)
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
        size = self.env.map_size
        if before:
            info, psize = self.env.lmdb.info(), self.env.lmdb.stat()["psize"]
            need = (info["last_pgno"] + 1) * psize + batch_bytes + batch_bytes // 8 + MiB
            if need <= size or size >= self.map_size_max:
                return
            new_size = size
            while new_size < need and new_size < self.map_size_max:
                new_size = min(new_size * 2, self.map_size_max)
        elif size >= self.map_size_max:
            raise ColdFull(f"cold tier map is full at {size} bytes (cold.map_size_max)")
        else:
            new_size = min(size * 2, self.map_size_max)
        self.env.resize(new_size)
        self.map_grows += 1
