"""The cold tier's LMDB environment on disk: its sub-databases, their totals, opening it, and
what a damaged one means (the message, setting it aside).

DiskTier (disk.py) opens it as an LmdbEnv, which its writer and its reader share with the tier's
Totals; `kvstore fsck` opens the same environment directly. Sub-databases: `pages` (the records),
`quarantine` (what fsck --repair set aside), `meta` (the totals of `pages`: bytes and records,
rewritten by every write transaction).
"""

from __future__ import annotations

import os
import struct
import threading
import time
from contextlib import contextmanager
from typing import Iterable, Iterator

import lmdb

from kvstore.datadir import DIR_MODE
from kvstore.errors import DamagedStore, KVStoreError
from kvstore.tiers import buffers
from kvstore.tiers.buffers import RemapLock
from kvstore.tiers.lmdb_file import LmdbFile

PAGES_DB = b"pages"
QUARANTINE_DB = b"quarantine"
META_DB = b"meta"
TOTALS_KEY = b"totals"          # in `meta`: bytes and count of the records in `pages`
_TOTALS = struct.Struct("<QQ")  # u64 LE bytes, u64 LE records
_MADV_DONTNEED = 4              # madvise: drop the mapping's pages (they are read again on access)

# errors liblmdb raises for a file it finds inconsistent (others: permissions, locks, resources)
DAMAGE_ERRORS = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.VersionMismatchError,
                 lmdb.PanicError, lmdb.IncompatibleError, lmdb.BadDbiError)


class ColdFull(KVStoreError):
    """A write found no room: cold.max_bytes, the map at cold.map_size_max, or the filesystem is
    full. Nothing of it was written; deleting records makes room."""


class LmdbEnv:
    """A cold store opened for DiskTier: LMDB's environment (`lmdb`), its sub-databases, the map's
    size and the remap lock. Reads run under the lock shared (`shared`, `reading`); resizing the map
    takes it exclusively, as set_mapsize needs every transaction of this process closed. Write
    transactions run on the writer thread alone, the one that resizes, so they take no lock.
    Opening also reads the totals `meta` records (`recorded`, None when it has none) and LMDB's
    count of `pages` (`records`), and opens data.mdb read-only (`data_fd`, None if it cannot be)
    for reads that copy with pread. Once `closed` is set, every read raises KVStoreError.
    """

    def __init__(self, path: str, map_size: int):
        self.path = path
        self.map_size = map_size
        try:
            self.lmdb = open_env(path, map_size)
        except lmdb.Error as exc:
            raise open_error(path, exc) from None
        try:
            self.lmdb.reader_check()  # free reader slots left by a crashed process
            self.pages = self.lmdb.open_db(PAGES_DB)
            self.quarantine = self.lmdb.open_db(QUARANTINE_DB)
            self.meta = self.lmdb.open_db(META_DB)
            with self.lmdb.begin(buffers=True) as txn:
                self.recorded = read_totals(txn, self.meta)
                self.records: int = txn.stat(self.pages)["entries"]
        except lmdb.Error as exc:
            self.lmdb.close()
            raise open_error(path, exc) from None
        self.closed = False
        self._remap = RemapLock()
        self.psize: int = self.lmdb.stat()["psize"]
        try:   # for reads of large pages with pread (LmdbReader), beside the map
            self.data_fd: int | None = os.open(os.path.join(path, "data.mdb"), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self.data_fd = None

    def check_open(self) -> None:
        if self.closed:
            raise KVStoreError(f"cold tier at {self.path} is closed")

    @contextmanager
    def shared(self) -> Iterator[lmdb.Environment]:
        """The environment, while it is open, under the shared remap lock (for read transactions)."""
        with self._remap.shared():
            self.check_open()
            yield self.lmdb

    @contextmanager
    def reading(self) -> Iterator[lmdb.Transaction]:
        """A read transaction on `pages`; its values are views into the map, valid inside the block."""
        with self.shared() as env, env.begin(db=self.pages, buffers=True) as txn:
            yield txn

    def lengths(self, keys: Iterable[bytes]) -> dict[bytes, int]:
        """key -> length of its committed record (0 when none), for the keys given."""
        with self.reading() as txn:
            return {key: len(v) if (v := txn.get(key)) is not None else 0 for key in keys}

    def resize(self, map_size: int) -> None:
        """Set the map's size, once every read transaction of this process has closed."""
        with self._remap.exclusive():
            self.lmdb.set_mapsize(map_size)
        self.map_size = map_size

    def drop_page_cache(self) -> bool:
        """Evict data.mdb from the OS page cache, so that the next reads come from the disk (a cold
        read, for benchmarks): the file's pages are first unmapped from this process (a mapped page
        stays cached), then written back and dropped. Reads wait meanwhile. False where the OS gives
        no way (no posix_fadvise, madvise or /proc/self/maps). A disk that a hypervisor caches may
        still answer from the host's memory."""
        madvise = buffers.libc_madvise()
        if madvise is None or self.data_fd is None or not hasattr(os, "posix_fadvise"):
            return False
        with self._remap.exclusive():
            ranges = _mapped_ranges(os.fstat(self.data_fd))
            if ranges is None:
                return False
            for start, end in ranges:
                madvise(start, end - start, _MADV_DONTNEED)
            os.fdatasync(self.data_fd)
            os.posix_fadvise(self.data_fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True

    def close(self) -> None:
        with self._remap.exclusive():
            self.lmdb.close()
            if self.data_fd is not None:
                os.close(self.data_fd)
                self.data_fd = None


def _mapped_ranges(st: os.stat_result) -> list[tuple[int, int]] | None:
    """The address ranges of this process's mappings of the file `st` describes (/proc/self/maps;
    None where there is none to read)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) >= 5 and fields[4] == str(st.st_ino):
            major, minor = (int(x, 16) for x in fields[3].split(":"))
            if os.makedev(major, minor) == st.st_dev:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                out.append((start, end))
    return out


class Totals:
    """The cold tier's accounting: bytes (`used`) and count of the records committed to `pages`, as
    `meta` records them, and the bytes queued puts hold against `max_bytes` until they commit
    (`reserved`); `lock` guards all three. Only the writer thread commits, so it reads `used` and
    `count` without the lock. A store whose recorded totals are missing, or whose count is not
    LMDB's, is counted once by the writer thread (`set_counted`); `wait` blocks until then.
    """

    def __init__(self, path: str, max_bytes: int, recorded: tuple[int, int] | None, records: int):
        self.path = path
        self.max_bytes = max_bytes
        self.lock = threading.Lock()
        self.used = self.count = self.reserved = 0
        self._counted = threading.Event()    # set once used and count are exact
        self._error: BaseException | None = None
        if recorded is None and records == 0:   # a new store: nothing to count
            recorded = (0, 0)
        if recorded is not None and recorded[1] == records:
            self.used, self.count = recorded
            self._counted.set()

    @property
    def counted(self) -> bool:
        return self._counted.is_set()

    def wait(self) -> "Totals":
        """These totals, once they are exact; KVStoreError when counting them failed."""
        self._counted.wait()
        if self._error is not None:
            raise KVStoreError(f"cold tier at {self.path}: counting its records failed: {self._error}")
        return self

    def set_counted(self, totals: tuple[int, int] | None, error: BaseException | None = None) -> None:
        """The totals the writer thread counted, or the error counting them raised."""
        if totals is not None:
            with self.lock:
                self.used, self.count = totals
        self._error = error
        self._counted.set()

    def reserve(self, nbytes: int) -> None:
        """Hold `nbytes` against max_bytes; ColdFull, holding nothing, when they do not fit."""
        with self.lock:
            if self.used + self.reserved + nbytes > self.max_bytes:
                raise ColdFull(
                    f"cold tier is full: {nbytes} more bytes would take it above cold.max_bytes "
                    f"= {self.max_bytes} (used {self.used}, pending {self.reserved}); evict first")
            self.reserved += nbytes

    def release(self, nbytes: int) -> None:
        with self.lock:
            self.reserved -= nbytes

    def commit(self, used: int, count: int, released: int) -> None:
        """A write transaction committed: the new totals, and the reservations it used up."""
        with self.lock:
            self.used, self.count = used, count
            self.reserved -= released

    def room(self) -> tuple[int, int]:
        """(bytes max_bytes still leaves, bytes reserved), read together."""
        with self.lock:
            return self.max_bytes - self.used - self.reserved, self.reserved


def open_env(path: str, map_size: int, readonly: bool = False) -> lmdb.Environment:
    """The LMDB environment of a cold store: durable commits, no writable map, private files
    (the directory 0700, data.mdb and lock.mdb 0600: LMDB drops the execute bits)."""
    return lmdb.open(path, map_size=map_size, subdir=True, readonly=readonly, create=not readonly,
                     max_dbs=3, sync=True, metasync=True, writemap=False, lock=True,
                     map_async=False, readahead=True, mode=DIR_MODE)


def damage_remedy(path: str) -> str:
    return (f"run `kvstore fsck --repair --path {path}` (it keeps every record that still reads), or set "
            f"cold.on_damage: quarantine (the store is set aside and the tier starts empty)")


def open_error(path: str, exc: lmdb.Error) -> KVStoreError:
    """What an LMDB error while opening the store at `path` means to the user."""
    if isinstance(exc, DAMAGE_ERRORS):
        return DamagedStore(os.path.join(path, "data.mdb"), f"LMDB cannot read it ({exc})", damage_remedy(path))
    return KVStoreError(f"cannot open cold tier at {path}: {exc}")


def set_aside(path: str) -> tuple[str, int | None]:
    """Move the (damaged) store at `path` to `<path>.damaged-<time>` and return that path and the
    pages it held: as its committed state counts them, else the values still found in the file
    (None: no file). A new store can then open at `path`."""
    try:
        with LmdbFile(path) as f:
            pages = f.entries(PAGES_DB)
            if pages is None:
                pages = sum(1 for _ in f.overflow_runs(skip=True))
    except OSError:
        pages = None
    aside = sibling(path, "damaged")
    try:
        os.rename(path, aside)
    except OSError as exc:
        raise KVStoreError(f"cannot move the damaged cold store {path} aside: {exc.strerror}") from None
    return aside, pages


def sibling(path: str, what: str) -> str:
    """A free name next to `path`: `<path>.<what>-<time>` (and a number, if that is taken)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name, n = f"{path}.{what}-{stamp}", 1
    while os.path.lexists(name):
        n += 1
        name = f"{path}.{what}-{stamp}-{n}"
    return name


def data_file_size(path: str) -> int:
    try:
        return os.path.getsize(os.path.join(path, "data.mdb"))
    except OSError:
        return 0


def read_totals(txn: lmdb.Transaction, meta) -> tuple[int, int] | None:
    """(bytes, records) of `pages` as `meta` records them; None when it does not."""
    value = txn.get(TOTALS_KEY, db=meta)
    if value is None or len(value) != _TOTALS.size:
        return None
    return _TOTALS.unpack(value)


def write_totals(txn: lmdb.Transaction, meta, nbytes: int, records: int) -> None:
    txn.put(TOTALS_KEY, _TOTALS.pack(nbytes, records), db=meta)


def count_totals(txn: lmdb.Transaction, pages) -> tuple[int, int]:
    """(bytes, records) of `pages`, counted: O(records), but reads only LMDB's leaf pages."""
    nbytes = records = 0
    for value in txn.cursor(db=pages).iternext(keys=False, values=True):
        nbytes += len(value)
        records += 1
    return nbytes, records
