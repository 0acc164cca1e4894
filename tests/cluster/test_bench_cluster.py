"""scripts/bench_cluster at tiny sizes: each sub-command's JSON fields and its own checks. No timing asserts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, clean_env

SCRIPT = str(REPO / "scripts" / "bench_cluster")


def bench(*args: str, timeout: int = 300) -> dict:
    r = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=clean_env(),
                       cwd=REPO, timeout=timeout)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""            # not a terminal: no progress lines
    return json.loads(r.stdout)      # the whole of stdout is one JSON object


def test_lookup_reports_one_round_trip_per_prompt_and_the_per_page_baseline():
    report = bench("lookup", "--sizes", "4,32", "--baseline-sizes", "4", "--repeats", "3", "--warmup", "1")
    assert report["benchmark"] == "cluster-lookup" and report["page_size"] == 16 and report["repeats"] == 3
    assert report["published_pages"] == 36
    assert [s["pages"] for s in report["sizes"]] == [4, 32]
    for s in report["sizes"]:
        n = s["pages"]
        assert s["tokens"] == 16 * n and s["found_pages"] == n
        assert s["round_trips"] == 1 and s["redis_commands"] == s["hgetall_calls"] == n + 1
        assert 0 < s["median_ms"] <= s["p99_ms"]
        assert s["per_page_us"] == pytest.approx(s["median_ms"] * 1e3 / n, rel=0.01, abs=0.002)
        assert s["redis_server_us"] >= 0
    [base] = report["baseline"]["sizes"]
    assert base["pages"] == 4 and base["round_trips"] == 5
    assert 0 < base["median_ms"] <= base["p99_ms"]
    pipelined = report["sizes"][0]["median_ms"]
    assert base["ratio_vs_pipelined"] == pytest.approx(base["median_ms"] / pipelined, rel=0.02, abs=0.01)
    assert report["machine"]["cpus"] >= 1 and report["machine"]["redis_server"]


def test_lookup_rejects_a_baseline_size_it_does_not_measure():
    r = subprocess.run([sys.executable, SCRIPT, "lookup", "--sizes", "4", "--baseline-sizes", "8"],
                       capture_output=True, text=True, env=clean_env(), cwd=REPO, timeout=60)
    assert r.returncode == 2 and "--baseline-sizes must be among --sizes" in r.stderr


@pytest.mark.slow
def test_peer_ttft_fetches_the_document_and_matches_the_recompute():
    report = bench("peer-ttft", "--model", "tiny", "--doc-tokens", "64", "--question-tokens", "8",
                   "--questions", "2", "--max-tokens", "2")
    assert report["benchmark"] == "cluster-peer-ttft" and report["model"] == "tiny"
    assert report["doc_tokens"] == 64 and report["questions"] == 2 and report["doc_pages"] == 4
    assert "stream" in report["ttft"]
    assert report["tokens_identical"] is True
    assert report["pages_fetched_by_b"] == 2 * 4
    assert len(report["rows"]) == 2 and len(report["doc_served_by_a_ttft_s"]) == 2
    for row in report["rows"]:
        assert row["prompt_tokens"] == 72 and row["tokens_identical"] is True
        assert row["peer"]["cached_tokens"]["peer"] == 64 and row["peer"]["prefill_tokens"] == 8
        assert sum(row["recompute"]["cached_tokens"].values()) == 0 and row["recompute"]["prefill_tokens"] == 72
        assert row["peer_ttft_s"] > 0 and row["recompute_ttft_s"] > 0
    means = report["mean_peer_ttft_s"], report["mean_recompute_ttft_s"]
    assert all(m > 0 for m in means)
    assert report["ratio_recompute_vs_peer"] == pytest.approx(means[1] / means[0], rel=0.02, abs=0.01)
    assert report["goal"] == 3.0
    assert report["meets_goal"] == (report["ratio_recompute_vs_peer"] >= 3.0)
