"""DiskTier: the cold tier, page records in LMDB on local disk.

This module holds its opening, accounting, room and the tier interface; its writer thread is
LmdbWriter (lmdb_writer.py), its reads LmdbReader (lmdb_reader.py), its LMDB environment
lmdb_env.py. The rules below are the whole tier's.

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
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable, Sequence

import lmdb

from kvstore.datadir import make_private_dirs
from kvstore.errors import DamagedStore, KVStoreError
from kvstore.pages import record
from kvstore.pages.record import RecordHeader
from kvstore.pages.spec import KVSpec
from kvstore.tiers.base import TIER_BACKENDS, Tier, done
from kvstore.tiers.buffers import MiB, RemapLock, keep_write_buffers, round_up
from kvstore.tiers.lmdb_env import (META_DB, PAGES_DB, QUARANTINE_DB, ColdFull,  # noqa: F401 (re-exported)
                                    count_totals, damage_remedy, data_file_size, open_env, open_error, read_totals,
                                    set_aside, write_totals)
from kvstore.tiers.lmdb_file import check_data_file
from kvstore.tiers.lmdb_reader import LmdbReader
from kvstore.tiers.lmdb_writer import STOP, LmdbWriter

log = logging.getLogger("kvstore.store")

_RESERVE_PAGES = 64     # LMDB pages kept free on disk for the copies a delete transaction makes


class DiskTier(LmdbWriter, LmdbReader, Tier):
    name = "cold"
    keyed = True
    io = True

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
        self.map_size = max(round_up(min(self.map_size_max, map_size_initial)),
                            round_up(data_file_size(self.path)))
        try:
            self._env = open_env(self.path, self.map_size)
        except lmdb.Error as exc:
            raise open_error(self.path, exc) from None
        try:
            self._env.reader_check()  # free reader slots left by a crashed process
            self._pages = self._env.open_db(PAGES_DB)
            self._quarantine = self._env.open_db(QUARANTINE_DB)
            self._meta = self._env.open_db(META_DB)
            with self._env.begin(buffers=True) as txn:
                totals = read_totals(txn, self._meta)
                records = txn.stat(self._pages)["entries"]
        except lmdb.Error as exc:
            self._env.close()
            raise open_error(self.path, exc) from None
        self._record_bytes = record.PREFIX_BYTES + 256 + 4 * spec.page_size + spec.page_bytes
        keep_write_buffers(self._record_bytes, self._record_bytes * self.write_batch)

        # stats
        self.disk_bound = False  # room_bytes found the disk (or map) fuller than cold.max_bytes
        self.corrupt = 0        # reads refused: damaged record or header mismatch
        self.missing = 0        # reads of keys not stored
        self.map_grows = 0
        self.last_error = ""
        self._stats_lock = threading.Lock()

        # accounting: committed totals (as in `meta`), plus bytes reserved by queued puts
        self._lock = threading.Lock()
        self._used = 0
        self._count = 0
        self._reserved = 0
        self._closed = False
        self._counted = threading.Event()    # set once _used and _count are exact
        self._count_error: BaseException | None = None
        if totals is None and records == 0:   # a new store: nothing to count
            totals = (0, 0)
        if totals is not None and totals[1] == records:
            self._used, self._count = totals
            self._counted.set()

        self._remap = RemapLock()
        self._pool: ThreadPoolExecutor | None = None   # read_many's helpers, started on first use
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
        """Bytes of records committed to `pages` (waits for the first count of an old store)."""
        self._wait_counted()
        return self._used

    @property
    def pending_bytes(self) -> int:
        """Bytes queued puts will add (at most) once they commit."""
        return self._reserved

    def room_bytes(self) -> int:
        """Record bytes more puts may add: what cold.max_bytes leaves, or less when the disk holds
        less (`disk_bound` then says so); queued puts count. A read transaction and a statvfs."""
        self._wait_counted()
        with self._lock:
            by_limit = self.max_bytes - self._used - self._reserved
            reserved = self._reserved
        by_disk = self._disk_room() - reserved
        self.disk_bound = by_disk < by_limit
        return max(0, min(by_limit, by_disk))

    def _disk_room(self) -> int:
        """Record bytes the disk can still take, in whole records (one record is a run of LMDB pages)."""
        with self._remap.shared():
            self._check_open()
            info, main = self._env.info(), self._env.stat()
            with self._env.begin(buffers=True) as txn:
                stats = [txn.stat(db) for db in (self._pages, self._quarantine, self._meta)]
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

    @property
    def num_pages(self) -> int:
        """Records committed to `pages` (waits for the first count of an old store)."""
        self._wait_counted()
        return self._count

    @property
    def counted(self) -> bool:
        """Whether the totals are known (always, except while an old store is first counted)."""
        return self._counted.is_set()

    def _wait_counted(self) -> None:
        self._counted.wait()
        if self._count_error is not None:
            raise KVStoreError(f"cold tier at {self.path}: counting its records failed: {self._count_error}")

    def sizes(self) -> dict[bytes, int]:
        """key -> record length of every committed record: O(records), read from LMDB now.

        For audits, fsck-like checks and tests; it walks the whole store in short read
        transactions (like `scan`), so writes committing meanwhile may or may not show.
        """
        return dict(self._walk(lambda key, value: (bytes(key), len(value))))

    def __contains__(self, key: bytes) -> bool:
        """Whether a record is committed under `key` (one LMDB lookup; the record is not verified)."""
        with self._remap.shared():
            self._check_open()
            with self._env.begin(db=self._pages, buffers=True) as txn:
                return txn.get(key) is not None

    def __len__(self) -> int:
        return self.num_pages

    def _stored_sizes(self, keys: Iterable[bytes]) -> dict[bytes, int]:
        """key -> length of its committed record (0 when none), for the keys given."""
        with self._remap.shared():
            self._check_open()
            with self._env.begin(db=self._pages, buffers=True) as txn:
                return {key: len(v) if (v := txn.get(key)) is not None else 0 for key in keys}

    def _count_totals(self) -> None:
        """Count `pages` and record the totals in `meta` (writer thread, before any write)."""
        try:
            with self._env.begin(write=True, buffers=True) as txn:
                used, count = count_totals(txn, self._pages)
                write_totals(txn, self._meta, used, count)
        except BaseException as exc:  # reported by every accounting call
            self._count_error = exc
        else:
            with self._lock:
                self._used, self._count = used, count
        self._counted.set()

    # --- writes -----------------------------------------------------------------

    def contains(self, handles: Sequence[bytes]) -> list[bool]:
        return [size > 0 for size in self._stored_sizes(handles).values()]

    def read_into(self, handles: Sequence[RecordHeader], dst, dst_slots: Sequence[int]) -> Future:
        """read_many into dst's slots, on the caller's thread: the future is done on return."""
        return done(self.read_many([(h.key, h.namespace, h.tokens, h.spec, out)
                                    for h, out in zip(handles, dst.targets(dst_slots))]))

    def write_from(self, src, src_slots: Sequence[int], handles: Sequence[RecordHeader]) -> Future:
        """put_many of src's slots: they must stay unchanged until the future resolves."""
        return self.put_many(zip(handles, src.payloads(src_slots)))

    def evict(self, handles: Sequence[bytes]) -> Future:
        return self.delete_many(handles)

    # --- reads ------------------------------------------------------------------

    def close(self) -> None:
        """Commit everything queued, stop the writer and read threads and close LMDB. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(STOP)
            pool = self._pool
        self._writer.join()
        if pool is not None:
            pool.shutdown(wait=True)
        with self._remap.exclusive():
            self._env.close()

    def __enter__(self) -> "DiskTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"DiskTier({self.path!r}, {self._count} pages, {self._used}/{self.max_bytes} bytes, "
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
