"""The cold tier's LMDB environment on disk: its sub-databases, their totals, opening it, and
what a damaged one means (the message, setting it aside).

DiskTier (disk.py) does its reads and writes through this environment; `kvstore fsck` opens the
same one directly. Sub-databases: `pages` (the records), `quarantine` (what fsck --repair set
aside), `meta` (the totals of `pages`: bytes and records, rewritten by every write transaction).
"""

from __future__ import annotations

import os
import struct
import time

import lmdb

from kvstore.datadir import DIR_MODE
from kvstore.errors import DamagedStore, KVStoreError
from kvstore.tiers.lmdb_file import LmdbFile

PAGES_DB = b"pages"
QUARANTINE_DB = b"quarantine"
META_DB = b"meta"
TOTALS_KEY = b"totals"          # in `meta`: bytes and count of the records in `pages`
_TOTALS = struct.Struct("<QQ")  # u64 LE bytes, u64 LE records

# errors liblmdb raises for a file it finds inconsistent (others: permissions, locks, resources)
DAMAGE_ERRORS = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.VersionMismatchError,
                 lmdb.PanicError, lmdb.IncompatibleError, lmdb.BadDbiError)


class ColdFull(KVStoreError):
    """A write found no room: cold.max_bytes, the map at cold.map_size_max, or the filesystem is
    full. Nothing of it was written; deleting records makes room."""


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
