"""The cold tier on a disk that fills up (a real 4 MiB tmpfs, a small LMDB map): it evicts its own
victims instead of failing writes, counts and reports what fails (once in the log, and in the
stats), and keeps what it cannot write in warm; an empty cold tier reports its capacity."""

from __future__ import annotations

import logging
import os
import subprocess

import pytest
import torch

from conftest import unavailable
from kvstore.server.metrics import Metrics
from storeutil import RECORD_BYTES, expected_page, fill_and_commit, hold, make_store, tokens_for


@pytest.fixture
def tmpfs(tmp_path):
    """A 4 MiB tmpfs mounted for the test (needs root; see conftest.unavailable where it is not allowed)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        unavailable(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def to_cold(store, doc: int) -> list[bytes]:
    """A document of 4 pages computed, released and evicted to cold; returns its keys."""
    slots, keys = fill_and_commit(store, store.namespace(), tokens_for(doc, 4))
    store.release(slots)
    store.evict(keys, to="cold")
    return keys


def reads_back(store, keys) -> bool:
    slots = hold(store, keys)
    try:
        return len(slots) == len(keys) and all(torch.equal(store.hot.read_page(s), expected_page(k))
                                               for s, k in zip(slots, keys))
    finally:
        store.release(slots)


def fill_up(path) -> None:
    """Take every free byte of the filesystem at `path`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, bytes(64 << 10))
    except OSError:
        pass
    try:
        while True:
            os.write(fd, bytes(512))
    except OSError:
        pass
    os.close(fd)


def test_a_full_filesystem_makes_cold_evict_its_victims(tmpfs, caplog):
    caplog.set_level(logging.INFO, "kvstore.pageio")
    s = make_store(tmpfs / "data", hot=8, warm=8, cold=8192)   # cold.max_bytes ~ 70 MB on a 4 MiB disk
    try:
        for doc in range(120):                                # ~5.6 MiB of records
            keys = to_cold(s, doc)
            assert all(s.index.get(k).cold for k in keys), doc   # written, not skipped
        st = s.stats()
        assert st["cold"]["write_errors"] == 0 and st["cold"]["evicted_for_room"] > 0 and st["cold"]["disk_bound"]
        assert st["dropped_pages"] == 0 and st["tiers"]["cold"]["used_bytes"] < 4 << 20
        assert reads_back(s, keys) and s.audit()["problems"] == []
        said = [r.getMessage() for r in caplog.records if "disk's limit" in r.getMessage()]
        assert len(said) == 1 and "holds less than cold.max_bytes" in said[0]
    finally:
        s.close(persist=False)


def test_a_disk_filled_behind_its_back_is_counted_logged_once_and_loses_nothing(tmpfs, caplog):
    caplog.set_level(logging.INFO, "kvstore.pageio")
    s = make_store(tmpfs / "data", hot=8, warm=16, cold=8192)
    try:
        to_cold(s, 0)
        fill_up(tmpfs / "ballast")
        stuck = [k for doc in (1, 2, 3) for k in to_cold(s, doc)]
        for k in stuck:                                       # not written, not dropped: dirty in warm
            e = s.index.get(k)
            assert e is not None and e.warm is not None and not e.cold
        st = s.stats()
        assert st["dropped_pages"] == 0
        assert st["cold"]["write_errors"] >= 3 and st["cold"]["full"] and "full" in st["cold"]["last_error"]
        metrics = Metrics(s).render().decode()
        assert f"kvstore_cold_write_errors_total {float(st['cold']['write_errors'])}" in metrics
        failed = [r.getMessage() for r in caplog.records if "write-behind to cold failed" in r.getMessage()]
        assert len(failed) == 1 and "pages stay in memory" in failed[0]   # once, not once a batch

        os.unlink(tmpfs / "ballast")                          # room again: the next write goes through
        s.evict(stuck, to="cold")
        assert all(s.index.get(k).cold for k in stuck) and not s.stats()["cold"]["full"]
        assert any("succeed again" in r.getMessage() for r in caplog.records)
        assert reads_back(s, stuck[-4:])
    finally:
        s.close(persist=False)


def test_a_full_map_makes_cold_evict_its_victims(tmp_path):
    # the map (cold.map_size_max) is full long before cold.max_bytes: LMDB spends 12 KiB on an 8 KiB page
    s = make_store(tmp_path, hot=8, warm=8, cold=(1 << 20) // RECORD_BYTES, **{"cold.map_size_max": "1MiB"})
    try:
        assert s.config.cold.max_bytes <= 1 << 20
        for doc in range(40):
            keys = to_cold(s, doc)
            assert all(s.index.get(k).cold for k in keys), doc
        st = s.stats()
        assert st["cold"]["write_errors"] == 0 and st["cold"]["evicted_for_room"] > 0 and st["cold"]["disk_bound"]
        assert st["dropped_pages"] == 0 and st["tiers"]["cold"]["used_bytes"] < s.config.cold.max_bytes
        assert reads_back(s, keys)
    finally:
        s.close(persist=False)


def test_an_empty_cold_tier_reports_its_capacity(tmp_path):
    s = make_store(tmp_path)
    try:
        cold = s.stats()["tiers"]["cold"]
        assert len(s.cold) == 0 and cold["capacity_bytes"] == s.config.cold.max_bytes > 0 and cold["used_bytes"] == 0
        metrics = Metrics(s).render().decode()
        assert f'kvstore_tier_capacity_bytes{{tier="cold"}} {float(s.config.cold.max_bytes)}' in metrics
    finally:
        s.close()
