"""scripts/bench_remote.py with tiny sizes (8 pages, one repetition) on its own servers: redis-server
processes (one, and a 3-master cluster) and a mooncake_master: the JSON fields and sane numbers. No
timing asserts. Where Mooncake is hidden (a package named mooncake that fails to import, first on
PYTHONPATH), the default (all) skips it with a note, and --backend mooncake is a one-line error."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mooncakeutil
from conftest import REPO, clean_env, requires
from kvstore.remote.tier import READ_CHUNK

SCRIPT = REPO / "scripts" / "bench_remote.py"
PAGES_ARGS = ["--pages", "8", "--repeat", "1"]


def positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 and math.isfinite(x)


def requires_redis() -> None:
    requires(shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None,
             "redis-server and redis-cli are not installed (scripts/bootstrap installs them)")


@pytest.fixture
def hidden_mooncake(tmp_path_factory) -> dict[str, str]:
    """An environment in which `import mooncake` fails (as where it is not installed)."""
    shadow = tmp_path_factory.mktemp("hide-mooncake")
    (shadow / "mooncake").mkdir()
    (shadow / "mooncake" / "__init__.py").write_text('raise ImportError("hidden by the test")\n')
    env = clean_env()
    env["PYTHONPATH"] = f"{shadow}:{env['PYTHONPATH']}"
    return env


def run(args: list[str], env: dict[str, str], cwd, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout)


def check_report(report: dict, kinds: set[str]) -> None:
    assert report["benchmark"] == "remote" and report["pages"] == 8 and report["repeat"] == 1
    assert report["busy"] in (0, 1)
    assert report["page_bytes"] == 737_280 and report["tokens"] == 8 * 16
    assert report["read_chunk"] == READ_CHUNK and positive(report["socket_read_size"])
    assert set(report["backends"]) == kinds
    for kind, b in report["backends"].items():
        assert b["servers"] == (3 if kind == "cluster" else 1), kind
        assert b["client"] == ("MooncakeDistributedStore" if kind == "mooncake" else "redis-py"), kind
        assert b["store_a_open"] == (kind == "mooncake"), kind
        assert b["pages"] == 8 and b["page_bytes"] == 737_280
        assert 8 * 737_280 < b["record_bytes"] < 8 * (737_280 + 4096), kind   # pages and their headers
        for key in ("kvstore_gbps", "client_gbps", "ratio", "memcpy_gbps", "kvstore_first_touch_gbps",
                    "client_then_copy_gbps", "ratio_to_client_then_copy", "setup_write_s", "elapsed_s"):
            assert positive(b[key]), (kind, key)
        assert len(b["kvstore_s"]) == len(b["client_s"]) == 1
        assert all(positive(s) for s in b["kvstore_s"] + b["client_s"])
        assert b["ratio"] == pytest.approx(b["kvstore_gbps"] / b["client_gbps"], rel=0.02, abs=0.005)
        assert b["client_then_copy_gbps"] < b["client_gbps"] and b["client_then_copy_gbps"] < b["memcpy_gbps"]
        assert b["goal_ratio"] == 0.8 and b["goal_met"] == (b["ratio"] >= 0.8)
    assert report["goal_met"] == all(b["goal_met"] for b in report["backends"].values())
    assert positive(report["elapsed_s"])


def test_report_of_both_redis_backends_mooncake_skipped(tmp_path, hidden_mooncake):
    requires_redis()
    r = run(PAGES_ARGS, hidden_mooncake, tmp_path)           # the default: all
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)                            # the whole of stdout is one JSON object
    check_report(report, {"single", "cluster"})
    assert "hidden by the test" in report["skipped"]["mooncake"]
    assert list(tmp_path.iterdir()) == []                    # nothing left in the working directory


def test_a_negative_busy_count_is_a_one_line_error(tmp_path):
    r = run(["--busy", "-1"], clean_env(), tmp_path, timeout=60)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.strip().endswith("--busy must be an integer >= 0")


def test_mooncake_alone_without_mooncake_is_a_one_line_error(tmp_path, hidden_mooncake):
    r = run(["--backend", "mooncake", *PAGES_ARGS], hidden_mooncake, tmp_path, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_remote: Mooncake is not available:"), r.stderr
    assert "hidden by the test" in lines[0]


def busy_loops() -> list[str]:
    """The processes on this machine running BusyCores' loop (read from /proc: Linux)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"while True: pass" in cmdline.read_bytes():
                found.append(cmdline.parent.name)
        except OSError:
            pass
    return found


def ratio_of_rounded(ratio: float, num: float, den: float, half: float = 0.0005) -> bool:
    """Whether `ratio` (rounded to 3 decimals) is num / den where all three were rounded to 3
    decimals from the exact figures: the exact quotient lies between the extremes the rounding
    allows, however small the speeds are."""
    return (num - half) / (den + half) - half <= ratio <= (num + half) / (den - half) + half


def test_report_of_mooncake(tmp_path):
    requires(not mooncakeutil.missing(), mooncakeutil.missing())
    r = run(["--backend", "mooncake", "--busy", "1", *PAGES_ARGS], clean_env(), tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    check_report(report, {"mooncake"})
    assert report["busy"] == 1   # measured beside a process that keeps a core busy, stopped at the end
    assert not busy_loops()
    assert "skipped" not in report and report["mooncake"]
    b = report["backends"]["mooncake"]
    assert b["url"].startswith("mooncake://127.0.0.1:") and b["url"].endswith(f"&segment={b['segment_bytes']}")
    assert b["reader_url"].endswith("&segment=0") and b["segment_bytes"] >= 1 << 30
    assert b["client_kept_gbps"] > 0 and len(b["client_kept_s"]) == len(b["client_s"])
    assert ratio_of_rounded(b["ratio_to_client_kept"], b["kvstore_gbps"], b["client_kept_gbps"])
    assert list(tmp_path.iterdir()) == []
