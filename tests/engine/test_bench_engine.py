"""scripts/bench_engine on the tiny preset with tiny sizes: the JSON fields, the token checks and the
command line. No timing asserts."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from conftest import REPO, clean_env, import_or_unavailable

SCRIPT = REPO / "scripts" / "bench_engine"


def bench(*args: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args, "--model", "tiny", "--dir", str(tmp_path), "--json"],
                          capture_output=True, text=True, env=clean_env(HF_HUB_OFFLINE="1"), cwd=tmp_path,
                          timeout=240)


def positive(x) -> bool:
    return isinstance(x, (int, float)) and x > 0 and math.isfinite(x)


def test_long_doc_qa_report(tmp_path):
    import_or_unavailable("transformers")
    r = bench("long-doc-qa", "--doc-tokens", "64", "--questions", "3", "--question-tokens", "8",
              "--max-tokens", "4", "--recompute-questions", "2", "--hf-questions", "1", tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""                        # not a TTY: no progress lines
    report = json.loads(r.stdout)                # the whole of stdout is one JSON object
    assert report["benchmark"] == "long-doc-qa" and report["model"] == "tiny" and report["dtype"] == "float32"
    assert (report["doc_tokens"], report["docs"], report["questions"]) == (64, 1, 3)
    assert report["recompute"]["runs"] == 2
    for mode in ("recompute", "hot", "warm", "cold"):
        m = report[mode]
        assert mode == "recompute" or m["runs"] == 3
        assert len(m["ttfts"]) == len(m["wall_s"]) == m["runs"]
        assert all(positive(t) for t in m["ttfts"]) and positive(m["mean_ttft_s"])
        assert m["mean_ttft_s"] == pytest.approx(sum(m["ttfts"]) / m["runs"], rel=1e-2)
    # what each mode served from where: the whole prompt computed, or only the question
    assert report["recompute"]["mean_prefill_tokens"] == 72
    assert report["recompute"]["mean_cached_tokens"] == {"hot": 0, "warm": 0, "cold": 0}
    for tier in ("hot", "warm", "cold"):
        assert report[tier]["mean_prefill_tokens"] == 8
        assert report[tier]["mean_cached_tokens"][tier] == 64
    assert report["exact"] is True and report["mismatches"] == []
    assert report["exact_checked"] == {"against_recompute": 6, "against_hot": 2}
    hf = report["transformers"]
    assert hf["runs"] == 1 and positive(hf["mean_ttft_s"]) and hf["first_token_checked"] == 1
    assert report["hf_ttft_s"] == hf["mean_ttft_s"]
    for key in ("warm_speedup", "cold_speedup", "hot_speedup", "warm_vs_hf", "recompute_vs_hf"):
        assert positive(report[key]), key
    assert report["warm_speedup"] == pytest.approx(report["recompute"]["mean_ttft_s"]
                                                   / report["warm"]["mean_ttft_s"], rel=1e-2)
    assert report["goals"] == {"warm_speedup": 10, "cold_speedup": 5}
    assert report["meets_goals"] == (report["warm_speedup"] >= 10 and report["cold_speedup"] >= 5)
    assert list(tmp_path.iterdir()) == []        # the data directory is gone


def test_long_doc_qa_skip_hf(tmp_path):
    r = bench("long-doc-qa", "--doc-tokens", "48", "--questions", "2", "--question-tokens", "5",
              "--max-tokens", "2", "--recompute-questions", "1", "--skip-hf", tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["transformers"] is None and report["hf_ttft_s"] is None and report["warm_vs_hf"] is None
    # one recomputed question: the second is checked against the hot run instead
    assert report["exact"] is True and report["exact_checked"] == {"against_recompute": 3, "against_hot": 2}


def test_decode_report(tmp_path):
    import_or_unavailable("transformers")
    r = bench("decode", "--batch", "3", "--prompt-tokens", "10", "--new-tokens", "12", "--repeat", "2",
              "--profile", "5", tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    report = json.loads(r.stdout)
    assert report["benchmark"] == "decode" and report["model"] == "tiny"
    assert (report["batch"], report["prompt_tokens"], report["new_tokens"], report["repeat"]) == (3, 10, 12, 2)
    for side in ("engine", "transformers"):
        s = report[side]
        assert positive(s["tokens_per_s"]) and len(s["repeats_seconds"]) == 2
        assert s["seconds"] == min(s["repeats_seconds"])
        assert s["tokens_per_s"] == pytest.approx(3 * 12 / s["seconds"], rel=1e-2)
    assert report["ratio"] == pytest.approx(report["engine"]["tokens_per_s"] / report["transformers"]["tokens_per_s"],
                                            rel=1e-2)
    assert report["tokens_checked"] == 8 and report["tokens_match"] is True
    assert report["sequences_fully_equal"] == 3 and report["engine_repeats_identical"] is True
    assert report["goal"] == 1.5 and report["meets_goal"] == (report["ratio"] >= 1.5)
    assert len(report["profile"]) == 5 and all(positive(p["cumulative_s"]) for p in report["profile"])
    assert list(tmp_path.iterdir()) == []


def test_decode_on_an_engine_thread(tmp_path):
    r = bench("decode", "--batch", "2", "--prompt-tokens", "8", "--new-tokens", "6", "--repeat", "2", "--skip-hf",
              "--engine-thread", "--profile", "3", tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["engine_thread"] is True and report["engine_repeats_identical"] is True
    assert positive(report["engine"]["tokens_per_s"]) and report["transformers"] is None
    # the engine thread's own work was profiled, not the main thread waiting for it
    assert len(report["profile"]) == 3 and all("wait" not in p["function"] for p in report["profile"])
    assert any(p["function"].startswith(("model.py", "native.py", "runner.py", "layer_ops.py"))
               for p in report["profile"])


def test_bad_option_exits_2(tmp_path):
    r = bench("decode", "--batch", "0", "--skip-hf", tmp_path=tmp_path)
    assert r.returncode == 2 and "--batch" in r.stderr and r.stdout == ""


def test_attention_benchmark_report(tmp_path):
    """scripts/bench_attention.py: every shape, every backend's time and its difference from the reference."""
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_attention.py"), "--repeat", "1", "--layers", "1"],
                       capture_output=True, text=True, env=clean_env(), cwd=tmp_path, timeout=240)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["benchmark"] == "attention" and report["layers"] == 1 and report["repeat"] == 1
    assert set(report["shapes"]) == {"hit", "question", "chunk", "late", "prefill", "decode"}
    for name, row in report["shapes"].items():
        for backend in ("native", "sdpa") + (() if name == "prefill" else ("torch",)):
            assert positive(row[backend]["ms"]) and row[backend]["max_abs_diff"] < 1e-4, (name, backend)
        assert positive(row["native"]["x_vs_sdpa"])
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_attention.py"), "--repeat", "0"],
                         capture_output=True, text=True, env=clean_env(), cwd=tmp_path, timeout=60)
    assert bad.returncode == 2 and "--repeat must be an integer >= 1" in bad.stderr
    some = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_attention.py"), "--repeat", "1", "--layers", "1",
                           "--shapes", "decode,hit"], capture_output=True, text=True, env=clean_env(), cwd=tmp_path,
                          timeout=120)
    assert some.returncode == 0, some.stderr
    assert list(json.loads(some.stdout)["shapes"]) == ["decode", "hit"]
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_attention.py"), "--shapes", "hit,huge"],
                         capture_output=True, text=True, env=clean_env(), cwd=tmp_path, timeout=60)
    assert bad.returncode == 2 and "--shapes: unknown shape huge" in bad.stderr and bad.stdout == ""
