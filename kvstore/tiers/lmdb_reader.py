"""LmdbReader: the cold tier's reads.

`read`, `read_many` and `scan` are thread-safe and block: a read verifies the record (key
derivation, namespace, tokens, geometry, then the checksum over the bytes it copied) and
returns False for anything missing or untrustworthy, never raising on bad data. `read_many`
hands a batch out in runs to the caller's thread and a small pool, each thread in its own read
transaction, under the shared remap lock. DiskTier (disk.py) holds one, on the tier's LmdbEnv (lmdb_env.py); the rules
are DiskTier's.
"""

from __future__ import annotations

import logging
import threading
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
from kvstore.tiers.lmdb_env import LmdbEnv

log = logging.getLogger("kvstore.store")

_SCAN_CHUNK = 4096              # records read per read transaction in scan() and sizes()
_RUN_BYTES = 4 * MiB, 8 * MiB  # a run (pages copied in one record.copy_payloads call): its bounds
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
        self._from_file = env.data_fd is not None   # pages read with pread (record.copy_payloads)
        self.one_pass = True    # records read in one pass where the native copy can (record.copy_payloads)

    def read(self, key: bytes, expect_namespace: bytes, expect_tokens: bytes, expect_spec: bytes,
             out) -> bool:
        """Copy the verified page `key` into `out` (spec.page_bytes bytes); False on any miss
        (then `out` is untouched, or zeroed if the checksum failed)."""
        return self.read_many([(key, expect_namespace, expect_tokens, expect_spec, out)])[0]

    def read_many(self, requests: Sequence[tuple[bytes, bytes, bytes, bytes, object]],
                  threads: int | None = None) -> list[bool]:
        """Several reads (key, namespace, tokens, spec fingerprint, out); True for each page copied.

        The batch is cut into runs of 4 to 8 MiB of pages (as many as there are threads, where the
        batch is small enough), taken in turn by up to `threads` threads (default: the reader's),
        no more than there are runs: the caller's, and pool threads that join as soon as they wake,
        each in its own read transaction. A thread that starts late or copies slowly takes fewer
        runs, so all of them finish within about one run of each other. Hashing and copying
        release the GIL, so the runs go in parallel. A False leaves its target untouched, or
        zeroed when the checksum of what was copied failed.
        """
        page_bytes = self.spec.page_bytes
        targets = [read_target(req[4], page_bytes) for req in requests]
        ok = [False] * len(requests)
        threads = threads or self.threads
        smallest, largest = (max(1, bound // page_bytes) for bound in _RUN_BYTES)
        runs = _Runs(len(requests), max(smallest, min(largest, -(-len(requests) // threads))))
        futures = [self._read_pool().submit(self._read_runs, requests, targets, ok, runs)
                   for _ in range(min(threads, runs.count) - 1)]
        try:
            self._read_runs(requests, targets, ok, runs)
        finally:
            runs.close()   # after an error: a pool thread takes no more runs
            for f in futures:
                if not f.cancel():   # one that has not started is not waited for
                    f.result()       # never leave a pool thread writing into a target
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

    def _read_runs(self, requests, targets: list, ok: list[bool], runs: "_Runs") -> None:
        """Runs of `requests` taken from `runs` until none is left, in one read transaction: each
        record's header checked here, then the pages of those that pass copied and checksummed in
        one call (record.copy_payloads, which releases the GIL) while another thread checks the
        headers of its run. ok[i] set for each page copied."""
        if (run := runs.take()) is None:
            return
        with self.env.reading() as txn:
            while run is not None:
                jobs, where = [], []
                for i in run:
                    found = self._checked(txn, *requests[i][:4])
                    if found is not None:
                        jobs.append((*found, targets[i]))
                        where.append(i)
                errors, disagreed = record.copy_payloads(jobs, self._lmdb_file(), self.one_pass)
                for i, error in zip(where, errors):
                    if error is None:
                        ok[i] = True
                    else:
                        self._refused(requests[i][0], error)
                if disagreed:
                    self._stop_file_reads(disagreed)
                run = runs.take()

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

    def _checked(self, txn, key, expect_namespace, expect_tokens, expect_spec):
        """(record, header) of `key` when its header is the one expected; None (counted) if not."""
        value = txn.get(key)
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


class _Runs:
    """The runs of a read_many batch (ranges of `step` requests out of `n`), handed out in order to
    whichever thread asks next."""

    def __init__(self, n: int, step: int):
        self._lock = threading.Lock()
        self._starts = iter(range(0, n, step))
        self._n, self._step = n, step
        self.count = -(-n // step)

    def take(self) -> range | None:
        with self._lock:
            start = next(self._starts, None)
        return None if start is None else range(start, min(start + self._step, self._n))

    def close(self) -> None:
        with self._lock:
            self._starts = iter(())


def _scan_item(key: memoryview, value: memoryview) -> tuple[bytes, RecordHeader | None, int]:
    try:
        header = record.read_header(value)
    except RecordError:
        header = None
    return bytes(key), header, len(value)
