"""LmdbReader: the cold tier's reads (DiskTier's reader half).

`read`, `read_many` and `scan` are thread-safe and block: a read verifies the record (key
derivation, namespace, tokens, geometry, then the checksum over the bytes it copied) and
returns False for anything missing or untrustworthy, never raising on bad data. `read_many`
spreads a batch over a small thread pool, each group in its own read transaction, under the
shared remap lock. The rules are DiskTier's (kvstore/tiers/disk.py); this mixin holds no state
of its own.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from typing import Callable, Iterator, Sequence, TypeVar

import lmdb
import numpy as np

from kvstore.errors import KVStoreError
from kvstore.pages import record
from kvstore.pages.record import RecordError, RecordHeader
from kvstore.tiers.buffers import MiB, as_byte_array

_SCAN_CHUNK = 4096              # records read per read transaction in scan() and sizes()
_READ_GROUP_BYTES = 4 * MiB     # read_many gives a thread at least this many page bytes
K = TypeVar("K", bound=tuple)


class LmdbReader:
    def read(self, key: bytes, expect_namespace: bytes, expect_tokens: bytes, expect_spec: bytes,
             out) -> bool:
        """Copy the verified page `key` into `out` (spec.page_bytes bytes); False on any miss
        (then `out` is untouched, or zeroed if the checksum failed)."""
        return self.read_many([(key, expect_namespace, expect_tokens, expect_spec, out)])[0]

    def read_many(self, requests: Sequence[tuple[bytes, bytes, bytes, bytes, object]],
                  threads: int | None = None) -> list[bool]:
        """Several reads (key, namespace, tokens, spec fingerprint, out); True for each page copied.

        The batch is cut into contiguous groups of at least 4 MiB of pages, one per thread,
        up to `threads` (default `read_threads`): the caller reads the first group, pool
        threads the others, each group in one read transaction. Hashing and copying release
        the GIL, so the groups run in parallel. A False leaves its target untouched, or
        zeroed when the checksum of what was copied failed.
        """
        page_bytes = self.spec.page_bytes
        targets = []
        for req in requests:
            arr = as_byte_array(req[4])
            if arr.nbytes != page_bytes:
                raise ValueError(f"read target is {arr.nbytes} bytes, a page is {page_bytes}")
            targets.append(arr)
        per_group = max(1, -(-_READ_GROUP_BYTES // page_bytes))
        groups = min(threads or self.read_threads, -(-len(requests) // per_group))
        if groups <= 1:
            return self._read_group(requests, targets)
        bounds = [len(requests) * g // groups for g in range(groups + 1)]
        futures = [self._read_pool().submit(self._read_group, requests[a:b], targets[a:b])
                   for a, b in zip(bounds[1:-1], bounds[2:])]
        try:
            first = self._read_group(requests[:bounds[1]], targets[:bounds[1]])
        finally:
            rest = [f.result() for f in futures]   # never leave a helper writing into a target
        return first + [ok for group in rest for ok in group]

    def records(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The stored record of each key as bytes (None when there is none), unverified: for a copy
        elsewhere (the remote tier), whose reader verifies it. One read transaction."""
        with self._remap.shared():
            self._check_open()
            with self._env.begin(db=self._pages, buffers=True) as txn:
                return [bytes(v) if (v := txn.get(key)) is not None else None for key in keys]

    def _read_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            self._check_open()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=max(1, self.read_threads - 1),
                                                thread_name_prefix="kvstore-cold-read")
            return self._pool

    def _read_group(self, requests, targets: list[np.ndarray]) -> list[bool]:
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
            header = record.read_header(value)
            if header.key != key:
                raise RecordError("record is stored under another key")
            if header.namespace != expect_namespace:
                raise RecordError("namespace differs")
            if header.tokens != expect_tokens:
                raise RecordError("tokens differ")
            if header.spec != expect_spec or header.nbytes != self.spec.page_bytes:
                raise RecordError("page geometry differs")
            record.copy_payload(value, header, out)   # key derivation; checksum of what it copied
        except RecordError as exc:
            with self._stats_lock:
                self.corrupt += 1
                self.last_error = f"{bytes(key).hex()}: {exc}"
            return False
        return True

    def scan(self) -> Iterator[tuple[bytes, RecordHeader | None, int]]:
        """Every record in `pages` as (key, header or None when it does not parse, length).

        Reads headers only (no checksum). Runs in short read transactions of a few thousand
        records, so writes and map growth may proceed between chunks.
        """
        return self._walk(_scan_item)

    def _walk(self, item: Callable[[memoryview, memoryview], K]) -> Iterator[K]:
        """item(key, value) of every record in key order, read in chunks of short read
        transactions; each item is a tuple that starts with the key (as bytes)."""
        last: bytes | None = None
        while True:
            with self._remap.shared():
                self._check_open()
                try:
                    with self._env.begin(db=self._pages, buffers=True) as txn:
                        cursor = txn.cursor()
                        found = cursor.first() if last is None else cursor.set_range(last)
                        if found and last is not None and cursor.key() == last:
                            found = cursor.next()
                        chunk = [item(k, v) for k, v in islice(cursor.iternext(), _SCAN_CHUNK)] if found else []
                except lmdb.Error as exc:
                    raise KVStoreError(f"cold tier at {self.path}: reading its records failed: {exc}") from None
            yield from chunk
            if len(chunk) < _SCAN_CHUNK:
                return
            last = chunk[-1][0]

    # --- lifetime ---------------------------------------------------------------


def _scan_item(key: memoryview, value: memoryview) -> tuple[bytes, RecordHeader | None, int]:
    try:
        header = record.read_header(value)
    except RecordError:
        header = None
    return bytes(key), header, len(value)
