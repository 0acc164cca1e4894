"""kvstore fsck: check every record of a cold store, offline.

Each record in the LMDB `pages` database must parse (magic, header, payload length), match
its checksum, be stored under its own key, and have a key that is the chain hash of its
namespace, parent and tokens. A record that fails is damaged: the store never serves it
(a read treats it as a miss), and `--repair` moves it to the `quarantine` database.

Not damage: records of another page geometry (`foreign`, when a fingerprint is given)
and orphans (the parent page is not stored, e.g. it was evicted or never persisted;
recomputing the parent makes the child reachable again).

Run `--repair` only while no store has the directory open: it writes to the store behind
that store's back. A check alone is safe next to a running store (LMDB readers see one
consistent snapshot), but not from a process that has the same store open.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field

import lmdb

from kvstore import record
from kvstore.errors import KVStoreError
from kvstore.keys import KEY_BYTES
from kvstore.record import RecordError
from kvstore.tiers.disk import (META_DB, MiB, PAGES_DB, QUARANTINE_DB, data_file_size, open_env, read_totals,
                                write_totals)

DEFAULT_DATA_DIR = "./kvstore-data"
_SHOW_DAMAGED = 20  # damaged keys listed in the human report


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

    @property
    def clean(self) -> bool:
        return not self.damaged

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
    try:
        env = open_env(path, map_size=max(data_file_size(path), MiB), readonly=not repair)
    except lmdb.Error as exc:
        raise FsckError(f"cannot open the LMDB environment at {path}: {exc}") from None
    try:
        return _check(env, path, spec_fingerprint, repair)
    except lmdb.Error as exc:
        raise FsckError(f"the LMDB file at {path} is damaged beyond its records ({exc}); "
                        f"restore it or delete the cold store") from None
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
not damage.

Exit status: 0 no damaged records, 1 damaged records found (before any repair),
2 the store could not be checked."""


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
    for key, reason in r.damaged[:_SHOW_DAMAGED]:
        lines.append(f"  damaged {key}: {reason}")
    if len(r.damaged) > _SHOW_DAMAGED:
        lines.append(f"  ... and {len(r.damaged) - _SHOW_DAMAGED} more (--json lists all)")
    if r.clean:
        lines.append("clean")
    elif r.quarantined:
        lines.append(f"{len(r.damaged)} damaged records moved to quarantine")
    else:
        lines.append(f"{len(r.damaged)} damaged records (run with --repair to quarantine them)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore")
    add_parser(parser.add_subparsers(dest="command", required=True))
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] != "fsck":
        argv = ["fsck", *argv]
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
