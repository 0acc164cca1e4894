"""LmdbReader: the cold tier's reads.

`read`, `read_many` and `scan` are thread-safe and block: a read verifies the record (key
derivation, namespace, tokens, geometry, then the checksum over the bytes it copied) and
returns False for anything missing or untrustworthy, never raising on bad data. `read_many`
checks a batch's records on the caller's thread, in one read transaction under the shared remap
lock, and copies their pages there and on a small pool's threads. DiskTier (disk.py) holds one, on the tier's LmdbEnv (lmdb_env.py); the rules
are DiskTier's.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from typing import Callable, Iterator, Sequence, TypeVar

import lmdb
import numpy as np

from kvstore.errors import KVStoreError
from kvstore.pages import record
from kvstore.pages.record import RecordError, RecordHeader
from kvstore.pages.spec import KVSpec
from kvstore.tiers.buffers import MiB, read_target
from kvstore.tiers.file_stage import FileStage
from kvstore.tiers.lmdb_env import LmdbEnv

log = logging.getLogger("kvstore.store")

_SCAN_CHUNK = 4096              # records read per read transaction in scan() and sizes()
_RUN_BYTES = 2 * MiB          # pages checked before they are handed to the copy, at most (one page at least)
_SHARED_BYTES = 8 * MiB       # a batch larger than this is copied by pool threads too
_LOOKUP_BYTES = 16 * MiB      # pages looked up (and staged) at a time, ahead of the copy
_MEMORY_RATE = 8e9            # bytes/s: a first lookup slower than this came from the disk
K = TypeVar("K", bound=tuple)


class LmdbReader:
    """Verified reads of `spec`'s pages from the store `env`, a `read_many` batch on up to
    `threads` threads (the caller's included; the pool starts on first use). Counts what it
    refuses: `missing` keys, `corrupt` records, and the `last_error` of one."""

    def __init__(self, env: LmdbEnv, spec: KVSpec, threads: int):
        self.env = env
        self.spec = spec
        self.threads = threads
        self.corrupt = 0        # reads refused: damaged record or header mismatch
        self.missing = 0        # reads of keys not stored
        self.last_error = ""
        self._stats_lock = threading.Lock()
        self._lock = threading.Lock()   # starting the pool against close()
        self._pool: ThreadPoolExecutor | None = None
        self._from_file = env.data_fd is not None   # pages read with pread (record.PayloadCopies)
        self.one_pass = True    # records read in one pass where the native copy can (record.PayloadCopies)
        self.stage = FileStage()   # what is not in the page cache comes in from the file first

    def read(self, key: bytes, expect_namespace: bytes, expect_tokens: bytes, expect_spec: bytes,
             out) -> bool:
        """Copy the verified page `key` into `out` (spec.page_bytes bytes); False on any miss
        (then `out` is untouched, or zeroed if the checksum failed)."""
        return self.read_many([(key, expect_namespace, expect_tokens, expect_spec, out)])[0]

    def read_many(self, requests: Sequence[tuple[bytes, bytes, bytes, bytes, object]],
                  threads: int | None = None) -> list[bool]:
        """Several reads (key, namespace, tokens, spec fingerprint, out); True for each page copied.

        The caller's thread looks the records up, in one read transaction, _LOOKUP_BYTES of pages at a
        time, and brings what of them is not in the page cache in from the file (`_looked_up`); then it
        checks each header and hands the pages that pass, a run of about _RUN_BYTES at a time, to the copy
        (record.PayloadCopies). In a batch of more than _SHARED_BYTES, once the first run is handed
        over, up to `threads` - 1 pool threads (default: the reader's `threads`) copy while the caller
        checks the rest; then the caller copies too. The copying threads take one page at a time in native code, never waiting for the
        interpreter, so they finish within a page of each other. A False leaves its target
        untouched, or zeroed when the checksum of what was copied failed.
        """
        page_bytes = self.spec.page_bytes
        targets = [read_target(req[4], page_bytes) for req in requests]
        ok = [False] * len(requests)
        threads = threads or self.threads
        run = max(1, _RUN_BYTES // page_bytes)
        pooled = threads > 1 and len(requests) * page_bytes > _SHARED_BYTES
        copies = record.PayloadCopies(len(requests), page_bytes, self._lmdb_file(), self.one_pass)
        helpers: list = []
        where: list[int] = []   # the request of each page added
        with self.env.reading() as txn:
            values: list = []
            try:
                for start in range(0, len(requests), run):
                    end = min(start + run, len(requests))
                    while len(values) < end:
                        values += self._looked_up(txn, requests, len(values))
                    for i in range(start, end):
                        found = self._checked(values[i], *requests[i][:4])
                        if found is not None:
                            copies.add(*found, targets[i])
                            where.append(i)
                    copies.publish()
                    if pooled and not helpers and copies.parallel:
                        helpers = [self._read_pool().submit(copies.drain) for _ in range(threads - 1)]
            finally:
                copies.close()
                try:
                    copies.drain()
                finally:
                    for f in helpers:
                        if not f.cancel():   # one that has not started is not waited for
                            f.result()       # never leave a pool thread writing into a target
            errors, disagreed = copies.finish()
        for i, error in zip(where, errors):
            if error is None:
                ok[i] = True
            else:
                self._refused(requests[i][0], error)
        if disagreed:
            self._stop_file_reads(disagreed)
        return ok

    def records(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The stored record of each key as bytes (None when there is none), unverified: for a copy
        elsewhere (the remote tier), whose reader verifies it. One read transaction."""
        with self.env.reading() as txn:
            return [bytes(v) if (v := txn.get(key)) is not None else None for key in keys]

    def has(self, key: bytes) -> bool:
        """Whether a record is committed under `key` (one LMDB lookup; the record is not verified)."""
        with self.env.reading() as txn:
            return txn.get(key) is not None

    def _read_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            self.env.check_open()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=max(1, self.threads - 1),
                                                thread_name_prefix="kvstore-cold-read")
            return self._pool

    def _lmdb_file(self) -> tuple[int, int] | None:
        return (self.env.data_fd, self.env.psize) if self._from_file else None

    def _stop_file_reads(self, pages: int) -> None:
        with self._stats_lock:
            if not self._from_file:
                return
            self._from_file = False
        log.error("cold store %s: %d page(s) read from data.mdb failed their checksum where the same pages in "
                  "LMDB's map passed; they were served from the map, and every read copies from the map "
                  "from now on", self.env.path, pages)

    def _looked_up(self, txn, requests, start: int) -> list:
        """The records (views into the map, or None) of requests from `start` on, _LOOKUP_BYTES of
        pages of them at least, with what of them is not in the page cache brought in from the file
        (FileStage) before a copy touches them. LMDB reads a record's first page as it looks it up
        (and the kernel reads around it). The copies of the records looked up before go on meanwhile,
        from memory; but where the batch's first lookups came from the disk (slower than
        _MEMORY_RATE), all its records are looked up at once, so that the disk reads the batch in
        one sequential pass with no copy running beside it (BENCHMARKS.md: 1.3-3.5 GB/s against
        0.4-0.7 with copies beside it, on a VM's disk)."""
        count = max(1, _LOOKUP_BYTES // self.spec.page_bytes)
        began = time.perf_counter()
        values = [txn.get(req[0]) for req in requests[start:start + count]]
        if start == 0 and time.perf_counter() - began > len(values) * self.spec.page_bytes / _MEMORY_RATE:
            values += [txn.get(req[0]) for req in requests[count:]]
        if self.stage.available:
            self.stage.stage((np.frombuffer(v, np.uint8).ctypes.data, len(v)) for v in values if v is not None)
        return values

    def _checked(self, value, key, expect_namespace, expect_tokens, expect_spec):
        """(record, header) of `key`'s value when its header is the one expected; None (counted) if not."""
        if value is None:
            with self._stats_lock:
                self.missing += 1
            return None
        try:
            header = record.read_header(value)
            if header.key != key:
                raise RecordError("record is stored under another key")
            if header.namespace != expect_namespace:
                raise RecordError("namespace differs")
            if header.tokens != expect_tokens:
                raise RecordError("tokens differ")
            if header.spec != expect_spec or header.nbytes != self.spec.page_bytes:
                raise RecordError("page geometry differs")
        except RecordError as exc:
            self._refused(key, str(exc))
            return None
        return value, header

    def _refused(self, key, why: str) -> None:
        with self._stats_lock:
            self.corrupt += 1
            self.last_error = f"{bytes(key).hex()}: {why}"

    def scan(self) -> Iterator[tuple[bytes, RecordHeader | None, int]]:
        """Every record in `pages` as (key, header or None when it does not parse, length).

        Reads headers only (no checksum). Runs in short read transactions of a few thousand
        records, so writes and map growth may proceed between chunks.
        """
        return self._walk(_scan_item)

    def sizes(self) -> dict[bytes, int]:
        """key -> record length of every committed record: O(records), read from LMDB now, in
        short read transactions (like `scan`), so writes committing meanwhile may or may not show."""
        return dict(self._walk(lambda key, value: (bytes(key), len(value))))

    def _walk(self, item: Callable[[memoryview, memoryview], K]) -> Iterator[K]:
        """item(key, value) of every record in key order, read in chunks of short read
        transactions; each item is a tuple that starts with the key (as bytes)."""
        last: bytes | None = None
        while True:
            with self.env.shared() as env:
                try:
                    with env.begin(db=self.env.pages, buffers=True) as txn:
                        cursor = txn.cursor()
                        found = cursor.first() if last is None else cursor.set_range(last)
                        if found and last is not None and cursor.key() == last:
                            found = cursor.next()
                        chunk = [item(k, v) for k, v in islice(cursor.iternext(), _SCAN_CHUNK)] if found else []
                except lmdb.Error as exc:
                    raise KVStoreError(f"cold tier at {self.env.path}: reading its records failed: {exc}") from None
            yield from chunk
            if len(chunk) < _SCAN_CHUNK:
                return
            last = chunk[-1][0]

    def close(self) -> None:
        """End the pool's threads, once they have read what they were given (`env` marked closed)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _scan_item(key: memoryview, value: memoryview) -> tuple[bytes, RecordHeader | None, int]:
    try:
        header = record.read_header(value)
    except RecordError:
        header = None
    return bytes(key), header, len(value)
