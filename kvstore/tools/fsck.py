"""kvstore fsck: check every record of a cold store, offline.

Each record in the LMDB `pages` database must parse (magic, header, payload length), match
its checksum, be stored under its own key, and have a key that is the chain hash of its
namespace, parent and tokens. A record that fails is damaged: the store never serves it
(a read treats it as a miss), and `--repair` moves it to the `quarantine` database.

Not damage: records of another page geometry (`foreign`, when a fingerprint is given)
and orphans (the parent page is not stored, e.g. it was evicted or never persisted;
recomputing the parent makes the child reachable again).

A damaged LMDB file (cut short, or a B-tree page that does not hold together) is checked
with plain reads (LmdbFile) before liblmdb opens it, so it is reported, never a crash. A
check stops there (exit 2); `--repair` rebuilds the store: every record that still reads
and verifies (found through what is left of the B-tree, or whole in the file's overflow
pages) is copied into a fresh environment, which replaces the old one; the old directory
is kept next to it as `<store>.damaged-<time>`, for the operator to delete.

Run `--repair` only while no store has the directory open: it writes to the store behind
that store's back (it refuses while a kvstore process holds the data directory's lock).
A check alone is safe next to a running store (LMDB readers see one consistent
snapshot), but not from a process that has the same store open.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
from dataclasses import asdict, dataclass, field

import lmdb

from kvstore.datadir import LOCK_FILE, DataDir
from kvstore.errors import DamagedStore, KVStoreError
from kvstore.pages import record
from kvstore.pages.keys import KEY_BYTES
from kvstore.pages.record import PREFIX_BYTES, RecordError, RecordHeader
from kvstore.tiers.buffers import MiB, round_up
from kvstore.tiers.lmdb_env import (DAMAGE_ERRORS, META_DB, PAGES_DB, QUARANTINE_DB, data_file_size, open_env,
                                    read_totals, sibling, write_totals)
from kvstore.tiers.lmdb_file import LmdbFile, check_data_file

DEFAULT_DATA_DIR = "./kvstore-data"
_SHOW_DAMAGED = 20  # damaged keys listed in the human report
_REBUILD_TXN_BYTES = 64 * MiB   # a rebuild commits at least this often


class FsckError(KVStoreError):
    """The store cannot be checked (missing, not a cold store, or its LMDB file is broken)."""


@dataclass
class FsckReport:
    path: str
    total: int = 0          # records in `pages`
    ok: int = 0             # sound records of the expected geometry (or any, without a fingerprint)
    damaged: list[tuple[str, str]] = field(default_factory=list)   # (key hex, reason)
    foreign: int = 0        # sound records of another geometry
    orphans: int = 0        # sound records whose parent page is not stored (subset of ok + foreign)
    quarantined: int = 0    # damaged records moved to `quarantine` by this run
    rebuilt: str = ""       # why the LMDB file itself was damaged and the store rebuilt ("": it was not)
    recovered: int = 0      # records copied into the rebuilt store
    set_aside: str = ""     # where the damaged store went

    @property
    def clean(self) -> bool:
        return not self.damaged and not self.rebuilt

    def to_dict(self) -> dict:
        d = asdict(self)
        d["damaged"] = [{"key": k, "reason": r} for k, r in self.damaged]
        d["clean"] = self.clean
        return d


def check(path: str, spec_fingerprint: bytes | None = None, repair: bool = False) -> FsckReport:
    """Check every record of the cold store at `path`; with repair, quarantine the damaged ones."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FsckError(f"no cold store at {path}: the directory does not exist")
    if not os.path.isfile(os.path.join(path, "data.mdb")):
        raise FsckError(f"{path} is not a cold store: it has no data.mdb")
    guard = _lock(path) if repair else None
    try:
        try:
            check_data_file(path)
            return _open_and_check(path, spec_fingerprint, repair)
        except DamagedStore as exc:
            if not repair:
                raise FsckError(f"{exc}; `kvstore fsck --repair --path {path}` copies every record that still "
                                f"reads into a fresh store") from None
            return rebuild(path, exc.reason, spec_fingerprint)
    finally:
        if guard is not None:
            guard.unlock()


def _lock(path: str) -> DataDir | None:
    """The lock of the data directory holding the store, when it has one: no repair under a running store."""
    parent = os.path.dirname(os.path.abspath(path))
    return DataDir(parent).lock() if os.path.exists(os.path.join(parent, LOCK_FILE)) else None


def _open_and_check(path: str, spec_fingerprint: bytes | None, repair: bool) -> FsckReport:
    try:
        env = open_env(path, map_size=max(data_file_size(path), MiB), readonly=not repair)
    except DAMAGE_ERRORS as exc:
        raise DamagedStore(os.path.join(path, "data.mdb"), f"LMDB cannot read it ({exc})") from None
    except lmdb.Error as exc:
        raise FsckError(f"cannot open the LMDB environment at {path}: {exc}") from None
    try:
        return _check(env, path, spec_fingerprint, repair)
    except DAMAGE_ERRORS as exc:
        raise DamagedStore(os.path.join(path, "data.mdb"), f"LMDB cannot read it ({exc})") from None
    except lmdb.Error as exc:
        raise FsckError(f"cannot check the LMDB environment at {path}: {exc}") from None
    finally:
        env.close()


def _check(env, path: str, spec_fingerprint: bytes | None, repair: bool) -> FsckReport:
    report = FsckReport(path)
    try:
        pages = env.open_db(PAGES_DB, create=False)
    except lmdb.NotFoundError:
        raise FsckError(f"{path} is not a cold store: it has no '{PAGES_DB.decode()}' database") from None

    stored: set[bytes] = set()
    links: list[tuple[bytes, bytes]] = []   # (parent, namespace) of each sound record
    bad: list[tuple[bytes, int]] = []        # (key, record length) of each damaged record
    with env.begin(db=pages, buffers=True) as txn:
        for key, value in txn.cursor():
            key = bytes(key)
            stored.add(key)
            report.total += 1
            try:
                if len(key) != KEY_BYTES:
                    raise RecordError(f"key is {len(key)} bytes, not {KEY_BYTES}")
                header, _ = record.decode(value)  # parse, length, checksum, key derivation
                if header.key != key:
                    raise RecordError("record is stored under another key")
            except RecordError as exc:
                report.damaged.append((key.hex(), str(exc)))
                bad.append((key, len(value)))
                continue
            if spec_fingerprint is not None and header.spec != spec_fingerprint:
                report.foreign += 1
            else:
                report.ok += 1
            links.append((header.parent, header.namespace))
    report.orphans = sum(1 for parent, ns in links if parent != ns and parent not in stored)

    if repair and bad:
        # pages freed by the deletes are reusable only after commit: room for the copies
        extra = 2 * sum(n for _, n in bad) + 16 * MiB
        env.set_mapsize(env.info()["map_size"] + extra)
        quarantine, meta = env.open_db(QUARANTINE_DB), env.open_db(META_DB)
        with env.begin(write=True) as txn:
            for key, _ in bad:
                txn.put(key, txn.get(key, db=pages), db=quarantine)
                txn.delete(key, db=pages)
            totals = read_totals(txn, meta)   # the store's accounting: keep it exact
            if totals is not None:
                write_totals(txn, meta, totals[0] - sum(n for _, n in bad), totals[1] - len(bad))
        report.quarantined = len(bad)
    return report


# --- rebuilding a damaged LMDB file ---------------------------------------------

def rebuild(path: str, reason: str, spec_fingerprint: bytes | None = None) -> FsckReport:
    """Copy every record of the damaged store at `path` that still reads and verifies into a fresh
    environment, then put it in the store's place; the old directory is kept as `<path>.damaged-<time>`.

    Records come from what is left of the `pages` B-tree, then from the file's other overflow
    runs (a record whose tree page is lost may still be whole there; a stale copy of a record
    is the same page, as its key names its content). Nothing is taken on trust: each record is
    decoded and verified. Damaged records that still read go to the new store's quarantine."""
    report = FsckReport(path, rebuilt=reason)
    fresh = sibling(path, "repair")
    env = open_env(fresh, map_size=round_up(2 * data_file_size(path) + 64 * MiB))
    try:
        out = _Rebuilt(env, spec_fingerprint, report)
        with LmdbFile(path) as f:
            for key, value in f.records(PAGES_DB):
                out.add(key, value)
            for pgno, run in f.overflow_runs():
                if pgno not in f.values_read:
                    out.add(None, _whole_record(f, pgno, run))
            for key, value in f.records(QUARANTINE_DB):
                if value is not None:
                    out.quarantine(key, value, count=False)
        out.finish()
    except BaseException:
        env.close()
        _remove_tree(fresh)
        raise
    env.close()
    report.set_aside = sibling(path, "damaged")
    os.rename(path, report.set_aside)
    os.rename(fresh, path)
    return report


class _Rebuilt:
    """The fresh store `rebuild` fills, in write transactions of at most _REBUILD_TXN_BYTES."""

    def __init__(self, env: lmdb.Environment, spec_fingerprint: bytes | None, report: FsckReport):
        self.env, self.fingerprint, self.report = env, spec_fingerprint, report
        self.pages, self.quarantine_db, self.meta = (env.open_db(PAGES_DB), env.open_db(QUARANTINE_DB),
                                                     env.open_db(META_DB))
        self.kept: set[bytes] = set()
        self.damaged: dict[bytes, str] = {}
        self.quarantined: set[bytes] = set()
        self.links: list[tuple[bytes, bytes]] = []
        self.nbytes = 0
        self._txn: lmdb.Transaction | None = None
        self._txn_bytes = 0

    def _put(self, key: bytes, value: bytes, db) -> None:
        if self._txn is None:
            self._txn = self.env.begin(write=True)
        self._txn.put(key, value, db=db)
        self._txn_bytes += len(value)
        if self._txn_bytes >= _REBUILD_TXN_BYTES:
            self._txn.commit()
            self._txn, self._txn_bytes = None, 0

    def add(self, key: bytes | None, value: bytes | None) -> None:
        """A record found under `key` (None: found in the file, not through the tree)."""
        try:
            if value is None:
                raise RecordError("its bytes are lost (damaged overflow pages)")
            header, _ = record.decode(value)
            if key is not None and header.key != key:
                raise RecordError("record is stored under another key")
        except RecordError as exc:
            if key is not None and key not in self.kept:
                self.damaged.setdefault(key, str(exc))
                if value is not None:
                    self.quarantine(key, value)
            return
        if header.key in self.kept:
            return
        self.kept.add(header.key)
        self.damaged.pop(header.key, None)   # a whole copy turned up
        self._put(header.key, value, self.pages)
        self.nbytes += len(value)
        if self.fingerprint is not None and header.spec != self.fingerprint:
            self.report.foreign += 1
        else:
            self.report.ok += 1
        self.links.append((header.parent, header.namespace))

    def quarantine(self, key: bytes, value: bytes, count: bool = True) -> None:
        if key not in self.quarantined:
            self._put(key, value, self.quarantine_db)
            if count:
                self.quarantined.add(key)

    def finish(self) -> None:
        if self._txn is None:
            self._txn = self.env.begin(write=True)
        write_totals(self._txn, self.meta, self.nbytes, len(self.kept))
        self._txn.commit()
        self._txn = None
        r = self.report
        r.recovered = len(self.kept)
        r.damaged = sorted((k.hex(), why) for k, why in self.damaged.items())
        r.total = r.recovered + len(r.damaged)
        r.quarantined = sum(1 for k in self.damaged if k in self.quarantined)
        r.orphans = sum(1 for parent, ns in self.links if parent != ns and parent not in self.kept)


def _whole_record(f: LmdbFile, pgno: int, pages: int) -> bytes | None:
    """The record that starts the overflow run at `pgno`, if one does (its length from its own header)."""
    prefix = f.value_at(pgno, pages, PREFIX_BYTES)
    if prefix is None or prefix[:4] != record.MAGIC:
        return None
    (hlen,) = struct.unpack_from("<I", prefix, PREFIX_BYTES - 4)
    head = f.value_at(pgno, pages, PREFIX_BYTES + hlen)
    if head is None:
        return None
    try:
        nbytes = RecordHeader.unpack(head[PREFIX_BYTES:]).nbytes
    except RecordError:
        return None
    return f.value_at(pgno, pages, PREFIX_BYTES + hlen + nbytes) if nbytes >= 0 else None


def _remove_tree(path: str) -> None:
    for name in ("data.mdb", "lock.mdb"):
        try:
            os.unlink(os.path.join(path, name))
        except OSError:
            pass
    try:
        os.rmdir(path)
    except OSError:
        pass


# --- command line ---------------------------------------------------------------

DESCRIPTION = """\
Check every page record of a cold store (LMDB), offline:
  - the record parses: magic, header, payload length;
  - its xxh3 checksum matches;
  - it is stored under its own key, and that key is the chain hash of its
    namespace, parent key and token ids.
A record that fails is damaged; the store never serves it. With --repair, damaged
records are moved to the store's quarantine database (stop the store first).
Orphans (parent page not stored) and records of another geometry are counted,
not damage. A damaged LMDB file (cut short, or a broken B-tree page) is reported
without being opened; --repair then copies every record that still reads and
verifies into a fresh store, and keeps the damaged one as <store>.damaged-<time>.

Exit status: 0 no damaged records, 1 damaged records or a damaged file found
(before any repair), 2 the store could not be checked (a damaged file, without
--repair)."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `fsck` on an argparse subparsers object."""
    p = subparsers.add_parser("fsck", help="check the cold store's records (checksums, keys, lengths)",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", metavar="DIR", default=DEFAULT_DATA_DIR,
                   help=f"kvstore data directory; the cold store is DIR/cold (default {DEFAULT_DATA_DIR})")
    p.add_argument("--path", metavar="DIR", help="the cold store directory itself (overrides --data-dir)")
    p.add_argument("--repair", action="store_true",
                   help="move damaged records to the quarantine database (only while the store is stopped)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--spec-fingerprint", metavar="HEX",
                   help="expected page geometry (KVSpec.fingerprint, 32 hex digits); "
                        "records of another geometry are counted as foreign")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    path = getattr(args, "path", None) or os.path.join(getattr(args, "data_dir", DEFAULT_DATA_DIR), "cold")
    try:
        fingerprint = _parse_fingerprint(getattr(args, "spec_fingerprint", None))
        report = check(path, fingerprint, repair=getattr(args, "repair", False))
    except KVStoreError as exc:
        print(f"kvstore fsck: error: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "json", False):
        print(json.dumps(report.to_dict()))
    else:
        print(_human(report))
    return 0 if report.clean else 1


def _parse_fingerprint(text: str | None) -> bytes | None:
    if text is None:
        return None
    try:
        fp = bytes.fromhex(text)
    except ValueError:
        fp = b""
    if len(fp) != 16:
        raise FsckError(f"--spec-fingerprint {text!r}: expected 32 hex digits (KVSpec.fingerprint)")
    return fp


def _human(r: FsckReport) -> str:
    lines = [f"kvstore fsck: {r.path}",
             f"  records      {r.total}",
             f"  ok           {r.ok}",
             f"  foreign      {r.foreign}",
             f"  orphans      {r.orphans}",
             f"  damaged      {len(r.damaged)}"]
    if r.quarantined:
        lines.append(f"  quarantined  {r.quarantined}")
    if r.rebuilt:
        lines[1:1] = [f"  the LMDB file was damaged: {r.rebuilt}",
                      f"  recovered    {r.recovered} (verified, copied into a fresh store)"]
    for key, reason in r.damaged[:_SHOW_DAMAGED]:
        lines.append(f"  damaged {key}: {reason}")
    if len(r.damaged) > _SHOW_DAMAGED:
        lines.append(f"  ... and {len(r.damaged) - _SHOW_DAMAGED} more (--json lists all)")
    if r.rebuilt:
        lines.append(f"rebuilt: {r.recovered} records kept in a fresh store, {len(r.damaged)} known lost; "
                     f"the damaged store is kept at {r.set_aside} (delete it when done)")
    elif r.clean:
        lines.append("clean")
    elif r.quarantined:
        lines.append(f"{len(r.damaged)} damaged records moved to quarantine")
    else:
        lines.append(f"{len(r.damaged)} damaged records (run with --repair to quarantine them)")
    return "\n".join(lines)
