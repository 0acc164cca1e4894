"""kvstore fsck against real cold stores: clean, damaged, repaired, orphans, foreign, missing."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from kvstore.pages.spec import KVSpec
from kvstore.tiers.disk import PAGES_DB, QUARANTINE_DB, DiskTier
from kvstore.tools import fsck
from storeutil import record_chain

REPO = Path(__file__).resolve().parent.parent
SPEC = KVSpec(2, 2, 16, "float32", 16)  # 8 KiB pages
MiB = 1 << 20


def write(path, items, spec: KVSpec = SPEC) -> None:
    with DiskTier(str(path), spec, max_bytes=64 * MiB, map_size_max=256 * MiB) as tier:
        tier.put_many(items).result(timeout=10)


def flip_payload_byte(path, key: bytes) -> None:
    env = lmdb.open(str(path), max_dbs=2, map_size=256 * MiB)
    try:
        with env.begin(write=True, db=env.open_db(PAGES_DB)) as txn:
            value = bytearray(txn.get(key))
            value[-17] ^= 0x01
            txn.put(key, bytes(value))
    finally:
        env.close()


def run(path=None, data_dir=None, repair=False, as_json=False, fingerprint=None) -> int:
    args = argparse.Namespace(path=str(path) if path else None, data_dir=str(data_dir or "./kvstore-data"),
                              repair=repair, json=as_json, spec_fingerprint=fingerprint)
    return fsck.run(args)


@pytest.fixture
def store(tmp_path):
    items = record_chain(12, SPEC)
    path = tmp_path / "data" / "cold"
    write(path, items)
    return path, items


def test_clean_store_exits_0(store, capsys):
    path, _ = store
    assert run(data_dir=path.parent) == 0                     # DATA_DIR/cold
    out = capsys.readouterr().out
    assert "records      12" in out and out.rstrip().endswith("clean")
    report = fsck.check(path, SPEC.fingerprint)
    assert (report.total, report.ok, report.damaged, report.foreign, report.orphans) == (12, 12, [], 0, 0)


def test_flipped_byte_is_damage_and_repair_quarantines_it(store, capsys):
    path, items = store
    bad = items[5][0].key
    flip_payload_byte(path, bad)

    report = fsck.check(path)
    assert report.damaged == [(bad.hex(), "checksum mismatch")] and report.ok == 11
    assert run(path=path) == 1
    out = capsys.readouterr().out
    assert f"damaged {bad.hex()}: checksum mismatch" in out and "--repair" in out

    assert run(path=path, repair=True, as_json=True) == 1     # damage found (before repair)
    rep = json.loads(capsys.readouterr().out)
    assert rep["quarantined"] == 1 and rep["damaged"] == [{"key": bad.hex(), "reason": "checksum mismatch"}]

    assert run(path=path) == 0                                # clean now
    report = fsck.check(path)
    assert report.total == 11 and report.orphans == 1         # page 6 lost its parent: not damage
    env = lmdb.open(str(path), max_dbs=2, readonly=True)
    try:
        with env.begin() as txn:
            assert txn.get(bad, db=env.open_db(QUARANTINE_DB, txn=txn)) is not None
            assert txn.get(bad, db=env.open_db(PAGES_DB, txn=txn)) is None
    finally:
        env.close()
    with DiskTier(str(path), SPEC, 64 * MiB, 256 * MiB) as tier:   # the store opens without it
        assert tier.counted                                   # repair kept its totals exact: no recount
        assert bad not in tier and tier.num_pages == 11
        assert tier.used_bytes == sum(tier.sizes().values())


def test_record_under_another_key_is_damage(store):
    path, items = store
    env = lmdb.open(str(path), max_dbs=2, map_size=256 * MiB)
    with env.begin(write=True, db=env.open_db(PAGES_DB)) as txn:
        txn.put(items[0][0].key, txn.get(items[1][0].key))
    env.close()
    report = fsck.check(path)
    assert report.damaged == [(items[0][0].key.hex(), "record is stored under another key")]


def test_orphans_and_foreign_are_counted_not_damage(tmp_path, capsys):
    path = tmp_path / "cold"
    write(path, record_chain(6, SPEC)[2:])                          # pages 2..5: page 2's parent is missing
    other = KVSpec(2, 2, 8, "float32", 16)
    write(path, record_chain(3, other, seed=9, model="other"), spec=other)
    report = fsck.check(path, SPEC.fingerprint)
    assert (report.total, report.ok, report.foreign, report.orphans, report.damaged) == (7, 4, 3, 1, [])
    assert fsck.check(path).foreign == 0                      # without a fingerprint nothing is foreign
    assert run(path=path, as_json=True, fingerprint=SPEC.fingerprint.hex()) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["foreign"] == 3 and rep["orphans"] == 1 and rep["clean"]


def test_empty_store_is_clean(tmp_path, capsys):
    path = tmp_path / "cold"
    DiskTier(str(path), SPEC, 64 * MiB, 256 * MiB).close()
    assert fsck.check(path).total == 0
    assert run(path=path) == 0
    assert "records      0" in capsys.readouterr().out


def test_user_errors_exit_2_with_one_line(tmp_path, capsys):
    assert run(path=tmp_path / "nope") == 2
    err = capsys.readouterr().err
    assert err.startswith("kvstore fsck: error: ") and err.count("\n") == 1 and "does not exist" in err
    (tmp_path / "empty").mkdir()
    assert run(path=tmp_path / "empty") == 2
    assert "no data.mdb" in capsys.readouterr().err
    assert run(path=tmp_path / "empty", fingerprint="xyz") == 2


def test_check_refuses_a_store_open_in_this_process(store):
    path, _ = store
    with DiskTier(str(path), SPEC, 64 * MiB, 256 * MiB):
        with pytest.raises(fsck.FsckError):
            fsck.check(path)


def _module(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "kvstore", "fsck", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=120)


def test_python_dash_m(store, tmp_path):
    path, items = store
    proc = _module("--data-dir", str(path.parent), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ok"] == 12
    flip_payload_byte(path, items[0][0].key)
    assert _module("--path", str(path), cwd=tmp_path).returncode == 1
    proc = _module(cwd=tmp_path)                              # ./kvstore-data/cold does not exist here
    assert proc.returncode == 2
    assert proc.stderr.startswith("kvstore fsck: error: ") and proc.stderr.count("\n") == 1
    assert "Traceback" not in proc.stderr
