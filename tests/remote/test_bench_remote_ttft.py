"""scripts/bench_remote_ttft.py with the tiny preset (a 320-token document, one repetition) on its
own redis-server and `kvstore serve` processes: the JSON fields, and that each way's cached tokens
came from where they should (recompute: nowhere; remote; peer) with A's answer. No timing asserts."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, clean_env, requires

SCRIPT = REPO / "scripts" / "bench_remote_ttft.py"
WAYS = {"recompute", "remote", "peer"}


def positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 and math.isfinite(x)


@pytest.mark.slow
def test_report_of_the_three_ways(tmp_path):
    requires(shutil.which("redis-server") is not None,
             "redis-server is not installed (scripts/bootstrap installs it)")
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--tokens", "320", "--repeat", "1"],
                       capture_output=True, text=True, env=clean_env(), cwd=tmp_path, timeout=150)
    assert r.returncode == 0, r.stderr[-4000:]
    report = json.loads(r.stdout)                 # the whole of stdout is one JSON object
    assert report["benchmark"] == "remote_ttft" and report["model"] == "tiny"
    assert report["tokens"] == 320 and report["repeat"] == 1
    assert report["page_size"] == 16 and report["page_bytes"] == 8192     # tiny, float32 KV
    assert report["full_pages"] == 20 and report["reusable_tokens"] == 304
    assert report["kv_bytes"] == 20 * 8192 and report["kv_bytes_per_token"] == 512
    assert "max_tokens=1" in report["ttft_measure"]

    # the sources check passed, and each way's samples say so on their own
    assert report["checks_passed"] is True and report["problems"] == []
    samples = report["samples"]
    assert sorted(s["way"] for s in samples) == sorted(WAYS)
    for s in samples:
        assert s["problems"] == [] and s["rep"] == 0 and positive(s["ttft_s"]), s
        cached = s["cached_tokens"]
        assert set(cached) == {"hot", "warm", "cold", "remote", "peer"}
        if s["way"] == "recompute":
            assert sum(cached.values()) == 0 and s["prefill_tokens"] == 320
        else:
            assert cached[s["way"]] >= 0.95 * 304, s
            assert sum(cached.values()) == cached[s["way"]]
            assert s["prefill_tokens"] == 320 - cached[s["way"]]
    remote = next(s for s in samples if s["way"] == "remote")
    assert remote["remote_hit_pages"] >= 19 * 0.95 and remote["corrupt_pages"] == 0
    assert remote["remote_read_bytes"] >= remote["remote_hit_pages"] * 8192   # records: pages and headers
    peer = next(s for s in samples if s["way"] == "peer")
    assert peer["peer_fetched_pages"] >= 19 * 0.95 and peer["peer_failed"] == 0

    # medians and ratios, from the samples of the same run
    med = report["median_ttft_s"]
    assert set(med) == WAYS and all(positive(med[w]) for w in WAYS)
    assert all(report["ttft_s"][w] == [s["ttft_s"] for s in samples if s["way"] == w] for w in WAYS)
    assert report["speedup"]["recompute_over_remote"] == pytest.approx(med["recompute"] / med["remote"], rel=0.01)
    assert report["speedup"]["peer_over_remote"] == pytest.approx(med["peer"] / med["remote"], rel=0.01)
    assert report["a"]["remote"]["queued_pages"] == 0
    assert report["a"]["remote"]["written_pages"] + report["a"]["remote"]["already_present_pages"] >= 20

    # every instance was stopped with SIGTERM and exited cleanly; nothing left behind
    assert report["clean_exits"] is True
    assert set(report["instance_exits"]) == {"A", "recompute-0", "remote-0", "peer-0"}
    assert positive(report["elapsed_s"])
    assert list(tmp_path.iterdir()) == []


def test_a_missing_default_model_is_a_one_line_error(tmp_path):
    env = clean_env(HOME=str(tmp_path), XDG_CACHE_HOME=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, str(SCRIPT), "--repeat", "1"], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "SmolLM2-135M-Instruct does not exist" in lines[0] and "scripts/real_model" in lines[0]
