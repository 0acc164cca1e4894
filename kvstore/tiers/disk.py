"""DiskTier: the cold tier, page records in LMDB on local disk.

Rules:
- It stores and deletes whole records under their page key, in the LMDB sub-database
  `pages` (`quarantine` holds what `kvstore fsck --repair` set aside). Values are
  kvstore.record records: header, checksum, page bytes. It never decides what to evict.
- It never holds more than `max_bytes` of records: `put_many` refuses, before writing
  anything, a batch that would go above it (pending writes count). Making room is the
  caller's job.
- One writer thread owns every write transaction. `put_many` / `delete_many` return a
  concurrent.futures.Future that resolves only after the batch's transaction has
  committed durably (sync + metasync); up to `write_batch` queued requests share one
  transaction. A failed transaction fails its futures; nothing of it is visible.
  `put_many` checksums a payload at once but the writer copies it later: the payload
  must stay alive and unchanged until its future resolves.
- The map grows on demand (doubling, up to `map_size_max`). Resizing needs every
  transaction of this process closed, so reads and scans hold a shared lock and the
  writer takes it exclusively to resize.
- Reads (`read`, `read_many`, `scan`) are thread-safe and block: call them from worker
  threads, never on an event loop. A read verifies the record (checksum, key derivation,
  namespace, tokens, geometry) and returns False for anything missing or untrustworthy;
  it never raises on bad data and never serves it.
- Any page may be missing: a write may not have happened yet, or fsck may have
  quarantined it. Only pages whose put future resolved survive a crash.
- One DiskTier per store directory per process (LMDB forbids opening it twice).
- Opening one raises glibc's malloc thresholds for the whole process (see
  `keep_write_buffers`), so LMDB's write buffers are reused, not faulted in anew.
"""

from __future__ import annotations

import os
import queue
import threading
import types
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping, Sequence

import lmdb
import numpy as np

from kvstore import record
from kvstore.errors import KVStoreError
from kvstore.record import RecordError, RecordHeader
from kvstore.spec import KVSpec
from kvstore.tiers.base import Tier
from kvstore.tiers.buffers import MiB, RemapLock, as_byte_array, as_byte_view, keep_write_buffers, round_up

PAGES_DB = b"pages"
QUARANTINE_DB = b"quarantine"
_SCAN_CHUNK = 1024  # records read per read transaction in scan()


def open_env(path: str, map_size: int, readonly: bool = False) -> lmdb.Environment:
    """The LMDB environment of a cold store: durable commits, no writable map."""
    return lmdb.open(path, map_size=map_size, subdir=True, readonly=readonly, create=not readonly,
                     max_dbs=2, sync=True, metasync=True, writemap=False, lock=True,
                     map_async=False, readahead=True)


def data_file_size(path: str) -> int:
    try:
        return os.path.getsize(os.path.join(path, "data.mdb"))
    except OSError:
        return 0


@dataclass
class _Request:
    puts: list[tuple[bytes, list, int]] = field(default_factory=list)   # (key, record parts, length)
    deletes: list[bytes] = field(default_factory=list)
    reserved: int = 0   # bytes this request counts against max_bytes until it commits
    future: Future = field(default_factory=Future)


_STOP = object()


class DiskTier(Tier):
    name = "cold"

    def __init__(self, path: str, spec: KVSpec, max_bytes: int, map_size_max: int,
                 write_batch: int = 64, map_size_initial: int = 64 * MiB):
        super().__init__(spec)
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.path = os.fspath(path)
        self.max_bytes = max_bytes
        self.map_size_max = round_up(map_size_max or 2 * max_bytes)
        self.write_batch = max(1, write_batch)
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as exc:
            raise KVStoreError(f"cannot create the cold tier directory {self.path}: {exc}") from None
        self.map_size = max(round_up(min(self.map_size_max, map_size_initial)),
                            round_up(data_file_size(self.path)))
        try:
            self._env = open_env(self.path, self.map_size)
        except lmdb.Error as exc:
            raise KVStoreError(f"cannot open cold tier at {self.path}: {exc}") from None
        try:
            self._env.reader_check()  # free reader slots left by a crashed process
            self._pages = self._env.open_db(PAGES_DB)
            self._quarantine = self._env.open_db(QUARANTINE_DB)
        except lmdb.Error as exc:
            self._env.close()
            raise KVStoreError(f"cannot open cold tier at {self.path}: {exc}") from None
        self._record_bytes = record.PREFIX_BYTES + 256 + 4 * spec.page_size + spec.page_bytes
        keep_write_buffers(self._record_bytes, self._record_bytes * self.write_batch)

        # stats
        self.corrupt = 0        # reads refused: damaged record or header mismatch
        self.missing = 0        # reads of keys not stored
        self.map_grows = 0
        self.last_error = ""
        self._stats_lock = threading.Lock()

        # accounting: committed sizes, plus bytes reserved by queued puts
        self._lock = threading.Lock()
        self._sizes: dict[bytes, int] = {}
        self._used = 0
        self._reserved = 0
        self._closed = False
        self._load_sizes()

        self._remap = RemapLock()
        self._scratch = bytearray(0)  # the writer thread's record buffer
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="kvstore-cold-writer", daemon=True)
        self._writer.start()

    # --- accounting -------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self.max_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of records committed to `pages`."""
        return self._used

    @property
    def pending_bytes(self) -> int:
        """Bytes queued puts will add (at most) once they commit."""
        return self._reserved

    @property
    def num_pages(self) -> int:
        return len(self._sizes)

    @property
    def sizes(self) -> Mapping[bytes, int]:
        """Live read-only view key -> record length of committed records.

        The writer thread updates it after each commit; iterate over `dict(tier.sizes)`.
        """
        return types.MappingProxyType(self._sizes)

    def __contains__(self, key: bytes) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def _load_sizes(self) -> None:
        with self._env.begin(db=self._pages, buffers=True) as txn:
            for key, value in txn.cursor().iternext(keys=True, values=True):
                self._sizes[bytes(key)] = len(value)
        self._used = sum(self._sizes.values())

    # --- writes -----------------------------------------------------------------

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
        with self._lock:
            self._check_open()
            stored = {key: self._sizes.get(key, 0) for key, _, _ in puts}
            req.reserved = max(0, sum(n for _, _, n in puts) - sum(stored.values()))
            if self._used + self._reserved + req.reserved > self.max_bytes:
                raise KVStoreError(
                    f"cold tier is full: {req.reserved} more bytes would take it above cold.max_bytes "
                    f"= {self.max_bytes} (used {self._used}, pending {self._reserved}); evict first")
            self._reserved += req.reserved
            self._queue.put(req)
        return req.future

    def delete_many(self, keys: Iterable[bytes]) -> Future:
        """Queue deletes (missing keys are ignored); the future resolves after commit."""
        req = _Request(deletes=[bytes(k) for k in keys])
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
        stop = False
        while not stop:
            first = self._queue.get()
            if first is _STOP:
                break
            batch = [first]
            while len(batch) < self.write_batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
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
                exc = KVStoreError(f"cold tier write failed at {self.path}: {exc}")
            self._unreserve(batch[0])
            batch[0].future.set_exception(exc)
            return
        for req in batch:
            req.future.set_result(None)

    def _commit(self, batch: list[_Request]) -> None:
        if not any(r.puts or r.deletes for r in batch):
            return
        batch_bytes = sum(n for r in batch for _, _, n in r.puts)
        keep_write_buffers(self._record_bytes, batch_bytes)
        self._grow_map(batch_bytes, before=True)
        while True:
            try:
                with self._env.begin(write=True, db=self._pages) as txn:
                    for req in batch:
                        for key, parts, length in req.puts:
                            txn.put(key, self._assemble(parts, length))
                        for key in req.deletes:
                            txn.delete(key)
                break  # committed on leaving the block
            except lmdb.MapFullError:
                self._grow_map()
        with self._lock:
            for req in batch:
                for key, _, length in req.puts:
                    self._used += length - self._sizes.get(key, 0)
                    self._sizes[key] = length
                for key in req.deletes:
                    self._used -= self._sizes.pop(key, 0)
                self._reserved -= req.reserved

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
            raise KVStoreError(f"cold tier map is full at {self.map_size} bytes (cold.map_size_max)")
        else:
            new_size = min(self.map_size * 2, self.map_size_max)
        with self._remap.exclusive():
            self._env.set_mapsize(new_size)
        self.map_size = new_size
        self.map_grows += 1

    # --- reads ------------------------------------------------------------------

    def read(self, key: bytes, expect_namespace: bytes, expect_tokens: bytes, expect_spec: bytes,
             out) -> bool:
        """Copy the verified page `key` into `out` (spec.page_bytes bytes); False on any miss."""
        return self.read_many([(key, expect_namespace, expect_tokens, expect_spec, out)])[0]

    def read_many(self, requests: Sequence[tuple[bytes, bytes, bytes, bytes, object]]) -> list[bool]:
        """Several reads (key, namespace, tokens, spec fingerprint, out) in one read transaction."""
        page_bytes = self.spec.page_bytes
        targets = []
        for req in requests:
            arr = as_byte_array(req[4])
            if arr.nbytes != page_bytes:
                raise ValueError(f"read target is {arr.nbytes} bytes, a page is {page_bytes}")
            targets.append(arr)
        with self._remap.shared():
            self._check_open()
            with self._env.begin(db=self._pages, buffers=True) as txn:
                return [self._read_one(txn, *req[:4], arr) for req, arr in zip(requests, targets)]

    def _read_one(self, txn, key, expect_namespace, expect_tokens, expect_spec, out: np.ndarray) -> bool:
        value = txn.get(key)
        if value is None:
            with self._stats_lock:
                self.missing += 1
            return False
        try:
            header, payload = record.decode(value)
            if header.key != key:
                raise RecordError("record is stored under another key")
            if header.namespace != expect_namespace:
                raise RecordError("namespace differs")
            if header.tokens != expect_tokens:
                raise RecordError("tokens differ")
            if header.spec != expect_spec or header.nbytes != self.spec.page_bytes:
                raise RecordError("page geometry differs")
        except RecordError as exc:
            with self._stats_lock:
                self.corrupt += 1
                self.last_error = f"{bytes(key).hex()}: {exc}"
            return False
        np.copyto(out, np.frombuffer(payload, dtype=np.uint8))
        return True

    def scan(self) -> Iterator[tuple[bytes, RecordHeader | None, int]]:
        """Every record in `pages` as (key, header or None when it does not parse, length).

        Reads headers only (no checksum). Runs in short read transactions, so writes and
        map growth may proceed between chunks.
        """
        last: bytes | None = None
        while True:
            chunk = []
            with self._remap.shared():
                self._check_open()
                with self._env.begin(db=self._pages, buffers=True) as txn:
                    cursor = txn.cursor()
                    more = cursor.first() if last is None else cursor.set_range(last)
                    if more and last is not None and bytes(cursor.key()) == last:
                        more = cursor.next()
                    while more and len(chunk) < _SCAN_CHUNK:
                        value = cursor.value()
                        try:
                            header = record.read_header(value)
                        except RecordError:
                            header = None
                        chunk.append((bytes(cursor.key()), header, len(value)))
                        more = cursor.next()
            yield from chunk
            if not more:
                return
            last = chunk[-1][0]

    # --- lifetime ---------------------------------------------------------------

    def close(self) -> None:
        """Commit everything queued, stop the writer thread and close LMDB. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        self._writer.join()
        with self._remap.exclusive():
            self._env.close()

    def __enter__(self) -> "DiskTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"DiskTier({self.path!r}, {self.num_pages} pages, {self._used}/{self.max_bytes} bytes, "
                f"map {self.map_size}/{self.map_size_max})")
