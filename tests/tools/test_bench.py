"""`kvstore bench tiers`: the report's fields, byte verification, and the command line. No timing asserts."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from concurrent.futures import Future

import pytest

from conftest import REPO, clean_env
from kvstore.tools import bench
from kvstore.tiers.device import DeviceTier
from kvstore.tiers.disk import DiskTier

TINY = ("--model", "tiny", "--pages", "8", "--repeat", "1", "--device", "cpu")
TINY_PAGE_BYTES = 2 * 2 * 16 * 2 * 16 * 2   # K,V x layers x page_size x kv_heads x head_dim x bf16


def tiers_args(tmp_path, **changes) -> argparse.Namespace:
    args = dict(model="tiny", dtype="bfloat16", page_size=16, pages=8, repeat=1, device="cpu",
                dir=str(tmp_path), drop_caches=False, json=True)
    args.update(changes)
    return argparse.Namespace(**args)


def test_json_report_has_every_field(kvstore_cli, tmp_path):
    r = kvstore_cli("bench", "tiers", *TINY, "--json", "--dir", tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""                       # not a TTY: no progress lines
    report = json.loads(r.stdout)               # the whole of stdout is one JSON object
    assert report["model"] == "tiny" and report["dtype"] == "bfloat16" and report["device"] == "cpu"
    assert report["pages"] == 8 and report["page_bytes"] == TINY_PAGE_BYTES
    assert report["bytes"] == 8 * TINY_PAGE_BYTES
    assert report["statistic"] in ("best", "median") and report["page_cache"] == "warm"
    assert report["verified"] is True
    assert report["targets"] == {"hot_to_warm": 0.8, "warm_to_hot": 0.8, "warm_to_cold": 0.5, "cold_to_warm": 0.7}
    assert set(report["baselines"]) == {"memcpy_gbps", "memcpy_reverse_gbps", "file_write_fsync_gbps",
                                        "file_read_gbps"}   # on CUDA: memcpy_h2d_gbps
    assert all(v > 0 and math.isfinite(v) for v in report["baselines"].values())
    expected_baseline = {"hot_to_warm": "memcpy", "warm_to_hot": "memcpy",
                         "warm_to_cold": "file_write_fsync", "cold_to_warm": "file_read"}
    for direction, baseline in expected_baseline.items():
        d = report[direction]
        assert d["baseline"] == baseline
        for field in ("gbps", "seconds", "ratio", "baseline_gbps"):
            assert isinstance(d[field], (int, float)) and d[field] > 0 and math.isfinite(d[field]), (direction, field)
        assert d["ratio"] == pytest.approx(d["gbps"] / d["baseline_gbps"], rel=0.01, abs=0.002)
        target = report["targets"][direction]
        if abs(d["ratio"] - target) > 0.01:     # the printed numbers are rounded
            assert d["meets_target"] == (d["ratio"] >= target)
        assert len(d["repeats_seconds"]) == len(d["baseline_repeats_seconds"]) == 1
        assert d["seconds"] == min(d["repeats_seconds"])
    assert report["meets_targets"] == all(report[d]["meets_target"] for d in expected_baseline)
    assert list(tmp_path.iterdir()) == []       # the LMDB and the raw file are gone


def test_module_entry_point_prints_a_table(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvstore", "bench", "tiers", *TINY, "--dir", str(tmp_path)],
                       capture_output=True, text=True, env=clean_env(), cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    for word in ("hot_to_warm", "warm_to_hot", "warm_to_cold", "cold_to_warm", "memcpy", "file_write_fsync",
                 "all bytes verified"):
        assert word in r.stdout


def _skip_save(self, slots, warm, warm_slots):
    pass


def _skip_load(self, slots, warm, warm_slots):
    pass


def _skip_put(self, items):
    done = Future()
    done.set_result(None)
    return done


def _skip_read(self, requests, threads=None):
    return [True] * len(requests)   # claims hits, copies nothing


@pytest.mark.parametrize("cls, name, fake, direction", [
    (DeviceTier, "save_to", _skip_save, "hot_to_warm"),
    (DeviceTier, "load_from", _skip_load, "warm_to_hot"),
    (DiskTier, "put_many", _skip_put, "warm_to_cold"),
    (DiskTier, "read_many", _skip_read, "cold_to_warm"),
])
def test_a_copy_that_moves_nothing_fails_the_run(monkeypatch, capsys, tmp_path, cls, name, fake, direction):
    monkeypatch.setattr(cls, name, fake)
    assert bench.run_tiers(tiers_args(tmp_path)) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert f"error: {direction}:" in err


@pytest.mark.parametrize("flag, value", [("--pages", "0"), ("--repeat", "0"), ("--dtype", "int4"),
                                         ("--model", "no-such-model")])
def test_bad_options_name_the_flag(kvstore_cli, flag, value):
    r = kvstore_cli("bench", "tiers", flag, value)
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr.startswith("kvstore: error:") and flag.lstrip("-") in r.stderr


def test_help_explains_the_baselines(kvstore_cli):
    r = kvstore_cli("bench", "tiers", "--help")
    assert r.returncode == 0
    for word in ("memcpy", "fsync", "--drop-caches", "--repeat", "--dir"):
        assert word in r.stdout
