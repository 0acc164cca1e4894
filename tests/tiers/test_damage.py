"""A damaged cold store (real LMDB files: cut in half, emptied, a B-tree page broken) is refused
with one clear error, never a crash, by the tier, fsck and `kvstore serve`; `fsck --repair`
rebuilds it from what still reads; `cold.on_damage: quarantine` sets it aside."""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

import pytest
import torch

from kvstore.errors import DamagedStore
from kvstore.pages.keys import Namespace
from kvstore.pages.spec import KVSpec
from kvstore.tiers.disk import PAGES_DB, DiskTier
from kvstore.tiers.lmdb_file import LmdbFile
from kvstore.tools import fsck
from storeutil import record_chain

SPEC = KVSpec(2, 2, 16, "float32", 16)  # 8 KiB pages
NS = Namespace.for_spec("damage-test", SPEC)
MiB = 1 << 20
N = 300                                  # enough records for a B-tree with a branch page
DAMAGE = ("truncated", "empty", "btree")


ITEMS = record_chain(N, SPEC, seed=7, model="damage-test")


def open_tier(path) -> DiskTier:
    return DiskTier(str(path), SPEC, max_bytes=64 * MiB, map_size_max=256 * MiB)


def damage(path: Path, kind: str) -> None:
    data = path / "data.mdb"
    if kind == "truncated":
        os.truncate(data, data.stat().st_size // 2)
    elif kind == "empty":
        os.truncate(data, 0)
    else:   # a leaf page of `pages` that no longer says it is one: liblmdb asserts (abort) on it
        with LmdbFile(str(path)) as f:
            leaves = [pgno for pgno, kind in f.tree_pages(PAGES_DB) if kind == "leaf"]
        assert len(leaves) > 2
        with open(data, "r+b") as fh:
            fh.seek(leaves[len(leaves) // 2] * 4096 + 10)   # the page header's flags
            fh.write(struct.pack("<H", 0))


@pytest.fixture
def store(tmp_path):
    """A cold store of N records at DATA/cold."""
    path = tmp_path / "data" / "cold"
    with open_tier(path) as tier:
        tier.put_many(ITEMS).result(timeout=30)
    return path


def read_all(tier: DiskTier) -> dict[bytes, bool]:
    """key -> whether it reads back byte-exact, for every record of the chain the tier holds."""
    out = {}
    for header, payload in ITEMS:
        if header.key in tier:
            got = torch.zeros(SPEC.page_bytes, dtype=torch.uint8)
            ok = tier.read(header.key, NS.digest, header.tokens, SPEC.fingerprint, got)
            out[header.key] = ok and torch.equal(got, payload)
    return out


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_file_is_refused_before_liblmdb_sees_it(store, kind):
    damage(store, kind)
    reason = {"truncated": "it is truncated", "empty": "it is empty (0 bytes)", "btree": "its B-tree is damaged"}
    with pytest.raises(DamagedStore) as err:
        open_tier(store)
    msg = str(err.value)
    assert f"the cold store file {store / 'data.mdb'} is damaged: {reason[kind]}" in msg
    assert f"kvstore fsck --repair --path {store}" in msg and "cold.on_damage: quarantine" in msg
    assert "\n" not in msg
    with pytest.raises(fsck.FsckError, match="--repair"):
        fsck.check(store)


@pytest.mark.parametrize("kind", DAMAGE)
def test_repair_keeps_every_record_that_still_reads(store, kind, capsys):
    damage(store, kind)
    report = fsck.check(store, SPEC.fingerprint, repair=True)
    assert report.rebuilt and not report.clean
    assert Path(report.set_aside).is_dir() and report.set_aside.startswith(f"{store}.damaged-")
    expected = {"truncated": range(1, N), "empty": range(0, 1), "btree": range(N, N + 1)}[kind]
    assert report.recovered in expected and report.ok == report.recovered
    with open_tier(store) as tier:   # the rebuilt store opens, its totals right, every record sound
        assert tier.num_pages == report.recovered and tier.used_bytes == sum(tier.sizes().values())
        reads = read_all(tier)
        assert len(reads) == report.recovered and all(reads.values())
    assert fsck.run(_args(store)) == 0 and capsys.readouterr().out.rstrip().endswith("clean")


def _args(path):
    import argparse
    return argparse.Namespace(path=str(path), data_dir=None, repair=False, json=False, spec_fingerprint=None)


def test_fsck_command_on_a_truncated_file_is_one_line(store, kvstore_cli):
    damage(store, "truncated")
    out = kvstore_cli("fsck", "--path", store)
    assert out.returncode == 2, out
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("kvstore fsck: error: the cold store file ")
    assert "truncated" in out.stderr and "Traceback" not in out.stderr
    out = kvstore_cli("fsck", "--path", store, "--repair")
    assert out.returncode == 1 and "rebuilt:" in out.stdout, out


@pytest.mark.parametrize("kind", DAMAGE)
def test_serve_refuses_a_damaged_store_with_one_line(store, kind, kvstore_cli):
    damage(store, kind)
    out = kvstore_cli("serve", "--model", "tiny", "--data-dir", store.parent, "--port", "0", "--admin-port", "0")
    assert out.returncode == 2, out
    assert out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"kvstore: error: the cold store file {store / 'data.mdb'} is damaged: ")
    assert "kvstore fsck --repair" in out.stderr and "cold.on_damage: quarantine" in out.stderr
    assert "Traceback" not in out.stderr and (store / "data.mdb").exists()   # nothing moved, nothing changed


def test_sidecar_refuses_a_damaged_store_with_one_line(store, kvstore_cli):
    damage(store, "truncated")
    out = kvstore_cli("sidecar", "--data-dir", store.parent, "--admin-port", "0", "--set", "warm.bytes=1MiB")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out
    data = store / "data.mdb"
    assert out.stderr.startswith(f"kvstore: error: the cold store file {data} is damaged: it is truncated")
    assert "Traceback" not in out.stderr


def test_quarantine_sets_the_store_aside_and_starts_empty(store, caplog):
    from storeutil import make_store

    damage(store, "btree")
    caplog.set_level(logging.ERROR, "kvstore.store")
    s = make_store(store.parent, **{"cold.on_damage": "quarantine"})
    try:
        assert s.stats()["tiers"]["cold"]["pages"] == 0 and s.cold.num_pages == 0
    finally:
        s.close()
    [aside] = store.parent.glob("cold.damaged-*")
    assert (aside / "data.mdb").stat().st_size > 0
    [line] = [r.getMessage() for r in caplog.records]
    assert f"moved to {aside} with {N} pages set aside" in line and "B-tree" in line


def test_on_damage_takes_refuse_or_quarantine():
    from kvstore.config import load_config
    from kvstore.errors import ConfigError

    assert load_config(env={}).cold.on_damage == "refuse"
    assert load_config(env={"KVSTORE_COLD_ON_DAMAGE": "quarantine"}).cold.on_damage == "quarantine"
    with pytest.raises(ConfigError, match=r"cold.on_damage = 'ignore': must be one of refuse, quarantine"):
        load_config(env={}, overrides={"cold.on_damage": "ignore"})
