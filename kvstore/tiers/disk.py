"""DiskTier: the cold tier, page records in LMDB on local disk.

DiskTier opens the store (an LmdbEnv, lmdb_env.py), keeps its room and the tier interface, and
holds the two parts that share the environment and the tier's Totals: its `writer` (LmdbWriter,
lmdb_writer.py: the writer thread) and its `reader` (LmdbReader, lmdb_reader.py). The rules
below are the whole tier's.

Rules:
- It stores and deletes whole records under their page key, in the LMDB sub-database
  `pages` (`quarantine` holds what `kvstore fsck --repair` set aside). Values are
  kvstore.pages.record records: header, checksum, page bytes. It never decides what to evict.
- Its accounting (bytes and count of the records in `pages`) lives in the sub-database
  `meta`, rewritten by every write transaction, so opening a store reads two numbers,
  whatever its size. The size of a stored record is looked up in LMDB when a write needs
  it; nothing keeps a list of all keys in memory (`sizes()` and `scan()` walk the store).
- A store without `meta` (written before it existed), or whose record count disagrees
  with LMDB's (records added or removed behind its back), has its totals counted once by
  the writer thread before its first write (one pass over LMDB's leaf pages, not over the
  records' bytes); `used_bytes`, `num_pages` and `put_many` wait for that count, so the
  byte limit is never checked against a guess. Tools that change `pages` directly must
  keep `meta` right, or delete its totals to have them counted again.
- It never holds more than `max_bytes` of records: `put_many` refuses, before writing
  anything, a batch that would go above it (pending writes count). Making room is the
  caller's job.
- One writer thread owns every write transaction. `put_many` / `delete_many` return a
  concurrent.futures.Future that resolves only after the batch's transaction has
  committed durably (sync + metasync); up to `write_batch` queued requests share one
  transaction. A failed transaction fails its futures; nothing of it is visible.
  `put_many` checksums a payload at once but the writer copies it later: the payload
  must stay alive and unchanged until its future resolves. During a large commit a helper
  thread starts the kernel's writeback early (`early_writeback`), so the disk works while
  LMDB still copies; durability and its order stay LMDB's.
- The map grows on demand (doubling, up to `map_size_max`). Resizing needs every
  transaction of this process closed, so reads and scans hold a shared lock and the
  writer takes it exclusively to resize.
- Reads (`read`, `read_many`, `scan`, `sizes`, `in`) are thread-safe and block: call them
  from worker threads, never on an event loop. A read verifies the record (key derivation,
  namespace, tokens and geometry before it copies; the checksum over the bytes it copied,
  chunk by chunk while they are in cache) and returns False for anything missing or
  untrustworthy; it never raises on bad data and never serves it. After False the target
  holds none of the record's bytes: it is untouched, or zeroed when the checksum failed.
  `read_many` spreads a batch over up to `read_threads` threads (the caller's and a small
  pool), each group in its own read transaction.
- Any page may be missing: a write may not have happened yet, or fsck may have
  quarantined it. Only pages whose put future resolved survive a crash.
- One DiskTier per store directory per process (LMDB forbids opening it twice).
- Opening one raises glibc's malloc thresholds for the whole process (see
  `keep_write_buffers`), so LMDB's write buffers are reused, not faulted in anew.
- Private: the directory is created 0700 (missing parents too) and LMDB creates its files
  0600; nothing is chmod-ed afterwards.
- Damage is refused before liblmdb sees it: opening checks data.mdb with LmdbFile (meta
  pages, length, every B-tree page; O(tree pages), not the values), because liblmdb faults
  (SIGBUS) on a file cut short and aborts on a malformed page. A damaged file, or any LMDB
  error while opening, raises DamagedStore naming the file and the remedies; nothing of
  the store is changed.
- Full: `room_bytes()` is what more records may take: the least of what cold.max_bytes
  leaves and what the disk can still hold (the map up to map_size_max, the filesystem's free
  space and LMDB's free pages, less a reserve of pages that deletes need for their copies).
  Callers evict down to it before they write, so the disk does not fill up (a delete
  needs room too). A write refused for lack of room fails with ColdFull: at once for
  cold.max_bytes, through its future for the map at map_size_max or a full filesystem.
  Deleting makes room.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future
from typing import Iterable, Iterator, Sequence

from kvstore.datadir import make_private_dirs
from kvstore.errors import DamagedStore, KVStoreError
from kvstore.pages import record
from kvstore.pages.record import RecordHeader
from kvstore.pages.spec import KVSpec
from kvstore.tiers.base import TIER_BACKENDS, Tier, done
from kvstore.tiers.buffers import MiB, keep_write_buffers, round_up
from kvstore.tiers.lmdb_env import (META_DB, PAGES_DB, QUARANTINE_DB, ColdFull, LmdbEnv,  # noqa: F401 (re-exported)
                                    Totals, damage_remedy, data_file_size, read_totals, set_aside)
from kvstore.tiers.lmdb_file import check_data_file
from kvstore.tiers.lmdb_reader import LmdbReader
from kvstore.tiers.lmdb_writer import LmdbWriter

log = logging.getLogger("kvstore.store")

_RESERVE_PAGES = 64     # LMDB pages kept free on disk for the copies a delete transaction makes


def _part_stat(part: str, name: str, doc: str | None = None) -> property:
    """A read-only stat of the tier that one of its parts keeps (env, totals, reader or writer)."""
    return property(lambda tier: getattr(getattr(tier, part), name), doc=doc)


class DiskTier(Tier):
    name = "cold"
    keyed = True
    io = True
    writer_type: type[LmdbWriter] = LmdbWriter   # what writes; a subclass may wrap its commits

    def __init__(self, path: str, spec: KVSpec, max_bytes: int, map_size_max: int,
                 write_batch: int = 64, map_size_initial: int = 64 * MiB, read_threads: int = 0):
        """`read_threads`: threads a `read_many` batch may use, the caller's included
        (0: min(4, CPUs); 1: the caller's thread only)."""
        super().__init__(spec)
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        if read_threads < 0:
            raise ValueError("read_threads must be 0 (auto) or positive")
        self.path = os.fspath(path)
        self.max_bytes = max_bytes
        self.map_size_max = round_up(map_size_max or 2 * max_bytes)
        self.write_batch = max(1, write_batch)
        self.read_threads = read_threads or min(4, os.cpu_count() or 1)
        try:
            make_private_dirs(self.path)
        except OSError as exc:
            raise KVStoreError(f"cannot create the cold tier directory {self.path}: {exc}") from None
        try:
            check_data_file(self.path)   # before liblmdb maps it
        except DamagedStore as exc:
            raise DamagedStore(exc.file, exc.reason, damage_remedy(self.path)) from None
        map_size = max(round_up(min(self.map_size_max, map_size_initial)), round_up(data_file_size(self.path)))
        self.env = LmdbEnv(self.path, map_size)
        self.totals = Totals(self.path, max_bytes, self.env.recorded, self.env.records)
        self._record_bytes = record.PREFIX_BYTES + 256 + 4 * spec.page_size + spec.page_bytes
        keep_write_buffers(self._record_bytes, self._record_bytes * self.write_batch)
        self.disk_bound = False  # room_bytes found the disk (or map) fuller than cold.max_bytes
        self._closing = threading.Lock()
        self.reader = LmdbReader(self.env, spec, self.read_threads)
        self.writer = self.writer_type(self.env, self.totals, self.write_batch, self._record_bytes,
                                       self.map_size_max)

    # --- accounting -------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self.max_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of records committed to `pages` (waits for the first count of an old store)."""
        return self.totals.wait().used

    @property
    def num_pages(self) -> int:
        """Records committed to `pages` (waits for the first count of an old store)."""
        return self.totals.wait().count

    pending_bytes = _part_stat("totals", "reserved", "Bytes queued puts will add (at most) once they commit.")
    counted = _part_stat("totals", "counted",
                         "Whether the totals are known (always, except while an old store is first counted).")

    def __len__(self) -> int:
        return self.num_pages

    # --- stats ------------------------------------------------------------------

    map_size = _part_stat("env", "map_size")
    map_grows = _part_stat("writer", "map_grows")
    corrupt = _part_stat("reader", "corrupt", "Reads refused: damaged record or header mismatch.")
    missing = _part_stat("reader", "missing", "Reads of keys not stored.")
    last_error = _part_stat("reader", "last_error")

    # --- room -------------------------------------------------------------------

    def room_bytes(self) -> int:
        """Record bytes more puts may add: what cold.max_bytes leaves, or less when the disk holds
        less (`disk_bound` then says so); queued puts count. A read transaction and a statvfs."""
        self.totals.wait()
        by_limit, reserved = self.totals.room()
        by_disk = self._disk_room() - reserved
        self.disk_bound = by_disk < by_limit
        return max(0, min(by_limit, by_disk))

    def _disk_room(self) -> int:
        """Record bytes the disk can still take, in whole records (one record is a run of LMDB pages)."""
        with self.env.shared() as env:
            info, main = env.info(), env.stat()
            with env.begin(buffers=True) as txn:
                stats = [txn.stat(db) for db in (self.env.pages, self.env.quarantine, self.env.meta)]
        psize = main["psize"]
        live = 2 + sum(st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"] for st in (main, *stats))
        try:
            st = os.statvfs(self.path)
            fs_free = st.f_bavail * st.f_frsize
        except OSError:
            fs_free = self.map_size_max
        file_pages = max(data_file_size(self.path) // psize, info["last_pgno"] + 1)
        usable = min(self.map_size_max // psize, file_pages + fs_free // psize)
        free_pages = usable - live - _RESERVE_PAGES
        record_pages = -(-(self._record_bytes + 16) // psize)
        return max(0, free_pages // record_pages) * self._record_bytes

    # --- reads (the reader's) ---------------------------------------------------

    def read(self, key: bytes, expect_namespace: bytes, expect_tokens: bytes, expect_spec: bytes,
             out) -> bool:
        """The verified page `key` into `out`; False on any miss (LmdbReader.read)."""
        return self.reader.read(key, expect_namespace, expect_tokens, expect_spec, out)

    def read_many(self, requests: Sequence[tuple[bytes, bytes, bytes, bytes, object]],
                  threads: int | None = None) -> list[bool]:
        """Verified reads (key, namespace, tokens, spec fingerprint, out), on up to `threads`
        threads (default `read_threads`); True for each page copied (LmdbReader.read_many)."""
        return self.reader.read_many(requests, threads)

    def records(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The stored record of each key as bytes, unverified (LmdbReader.records)."""
        return self.reader.records(keys)

    def scan(self) -> Iterator[tuple[bytes, RecordHeader | None, int]]:
        """Every record as (key, header or None, length), headers only (LmdbReader.scan)."""
        return self.reader.scan()

    def sizes(self) -> dict[bytes, int]:
        """key -> record length of every committed record: O(records), read from LMDB now.

        For audits, fsck-like checks and tests; it walks the whole store in short read
        transactions (like `scan`), so writes committing meanwhile may or may not show.
        """
        return self.reader.sizes()

    def __contains__(self, key: bytes) -> bool:
        """Whether a record is committed under `key` (one LMDB lookup; the record is not verified)."""
        return self.reader.has(key)

    # --- writes (the writer's) --------------------------------------------------

    def put_many(self, items: Iterable[tuple[RecordHeader, object]]) -> Future:
        """Queue records (header, payload) for one durable write; the payloads must stay unchanged
        until the future resolves. ColdFull, writing nothing, above max_bytes (LmdbWriter.put_many)."""
        return self.writer.put_many(items)

    def delete_many(self, keys: Iterable[bytes]) -> Future:
        """Queue deletes (missing keys are ignored); the future resolves after commit."""
        return self.writer.delete_many(keys)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every write queued before this call has committed (or failed)."""
        self.writer.flush(timeout)

    def drop_page_cache(self) -> bool:
        """Evict the tier's file from the OS page cache, so that the next reads come from the disk
        (LmdbEnv.drop_page_cache: benchmarks of a cold read). False where the OS gives no way."""
        return self.env.drop_page_cache()

    # --- the tier interface (handles: keys; reads and writes take RecordHeaders) --

    def contains(self, handles: Sequence[bytes]) -> list[bool]:
        return [size > 0 for size in self.env.lengths(handles).values()]

    def read_into(self, handles: Sequence[RecordHeader], dst, dst_slots: Sequence[int]) -> Future:
        """read_many into dst's slots, on the caller's thread: the future is done on return."""
        return done(self.read_many([(h.key, h.namespace, h.tokens, h.spec, out)
                                    for h, out in zip(handles, dst.targets(dst_slots))]))

    def write_from(self, src, src_slots: Sequence[int], handles: Sequence[RecordHeader]) -> Future:
        """put_many of src's slots: they must stay unchanged until the future resolves."""
        return self.put_many(zip(handles, src.payloads(src_slots)))

    def evict(self, handles: Sequence[bytes]) -> Future:
        return self.delete_many(handles)

    # --- lifetime ---------------------------------------------------------------

    def close(self) -> None:
        """Commit everything queued, stop the writer and read threads and close LMDB. Idempotent."""
        with self._closing:
            if self.env.closed:
                return
            self.env.closed = True   # from here on, reads and new writes raise
        self.writer.close()
        self.reader.close()
        self.env.close()

    def __enter__(self) -> "DiskTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"DiskTier({self.path!r}, {self.totals.count} pages, {self.totals.used}/{self.max_bytes} bytes, "
                f"map {self.map_size}/{self.map_size_max})")


@TIER_BACKENDS.register("lmdb")
def lmdb_tier(role: str, spec: KVSpec, path: str, max_bytes: int, map_size_max: int, write_batch: int = 64,
              on_damage: str = "refuse", **_) -> DiskTier:
    """The cold tier; a damaged store is refused, or set aside under on_damage = quarantine."""
    try:
        tier = DiskTier(path, spec, max_bytes, map_size_max, write_batch)
    except DamagedStore as exc:
        if on_damage != "quarantine":
            raise
        aside, pages = set_aside(str(path))
        log.error("the cold store at %s is damaged (%s): cold.on_damage is quarantine, so it was moved to %s "
                  "with %s pages set aside; the cold tier starts empty", path, exc.reason, aside,
                  "its" if pages is None else pages)
        tier = DiskTier(path, spec, max_bytes, map_size_max, write_batch)
    tier.name = role
    return tier
