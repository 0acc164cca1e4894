"""scripts/bench_engine compare with tiny sizes: the report's fields, the token checks, vLLM left out with a
note, the command line; and the vLLM worker itself when vLLM's venv is built. No timing asserts."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, clean_env, import_or_unavailable, unavailable

SCRIPT = REPO / "scripts" / "bench_engine"
TINY_SIZES = ("--rounds", "3", "--prefill-tokens", "40", "--batch", "3", "--prompt-tokens", "10",
              "--new-tokens", "12", "--doc-tokens", "64", "--question-tokens", "8")


def compare(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "compare", *args, "--dir", str(tmp_path), "--json"],
                          capture_output=True, text=True, env=clean_env(HF_HUB_OFFLINE="1"), cwd=tmp_path,
                          timeout=240)


def positive(x) -> bool:
    return isinstance(x, (int, float)) and x > 0 and math.isfinite(x)


def hf_model_dir(path: Path) -> Path:
    """A random Llama with head dim 64 (vLLM's CPU attention has no kernel for hfutil's 16) and hfutil's tokenizer."""
    import torch
    import transformers

    from hfutil import write_tokenizer

    config = transformers.LlamaConfig(vocab_size=320, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=64, intermediate_size=256,
                                      max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=0,
                                      eos_token_id=1, pad_token_id=2)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).float()
        with torch.no_grad():   # clear-cut greedy choices
            for p in model.parameters():
                p.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return path


def test_compare_report(tmp_path):
    import_or_unavailable("transformers")
    r = compare("--model", "tiny", *TINY_SIZES, tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""                        # not a TTY: no progress lines
    report = json.loads(r.stdout)                # the whole of stdout is one JSON object
    assert report["benchmark"] == "compare" and report["model"] == "tiny" and report["dtype"] == "float32"
    assert (report["threads"], report["rounds"], report["statistic"]) == (2, 3, "median")
    assert report["round_orders"] == [["engine", "transformers"], ["transformers", "engine"],
                                      ["engine", "transformers"]]
    assert report["vllm"] is None and "preset" in report["vllm_note"]   # vLLM needs a model directory
    assert report["transformers"]["version"]

    sides = {"prefill": ("engine", "transformers"), "decode": ("engine", "transformers"),
             "cached_prefix": ("engine", "engine_hot", "engine_cold", "engine_disk", "transformers")}
    for test, names in sides.items():
        t = report[test]
        for name in names:
            s = t[name]
            assert len(s["seconds"]) == 3 and all(positive(x) for x in s["seconds"])
            assert s["median_s"] == pytest.approx(statistics.median(s["seconds"]), rel=1e-3)
        assert t["engine_speedup_vs_transformers"] == pytest.approx(
            t["transformers"]["median_s"] / t["engine"]["median_s"], rel=1e-2)
        assert t["engine_speedup_vs_vllm"] is None
    assert (report["prefill"]["prompt_tokens"], report["decode"]["batch"], report["cached_prefix"]["doc_tokens"]) \
        == (40, 3, 64)
    d = report["decode"]["engine"]
    assert d["tokens_per_s"] == pytest.approx(3 * 12 / d["median_s"], rel=1e-2)
    assert len(d["tokens_per_s_rounds"]) == 3
    # nothing cached in prefill and decode; the whole document (4 pages) in the cached-prefix test
    assert report["prefill"]["engine"]["cached_tokens"] == report["decode"]["engine"]["cached_tokens"] == [0, 0, 0]
    c = report["cached_prefix"]
    assert c["engine"]["cached_tokens"] == c["engine_hot"]["cached_tokens"] == c["engine_cold"]["cached_tokens"] \
        == c["engine_disk"]["cached_tokens"] == [64, 64, 64]
    assert c["engine_tier"] == "warm" and positive(c["engine_hot_speedup_vs_transformers"])
    assert positive(c["engine_cold_speedup_vs_transformers"]) and positive(c["engine_disk_speedup_vs_transformers"])

    # greedy tokens: every pair equal in every sequence (tiny's random weights: no near-ties)
    counts = {"prefill": (3, 3), "decode": (9, 108), "cached_prefix": (3, 3)}
    for test, (sequences, tokens) in counts.items():
        agreement = report[test]["agreement"]
        assert "engine_vs_transformers" in agreement
        for pair in agreement.values():
            assert pair == {"sequences": sequences, "equal_sequences": sequences, "tokens": tokens,
                            "equal_leading_tokens": tokens}
    assert report["tokens_agree"] is True and report["tokens_checked"] == 8

    goals = {(g["test"], g["key"]): g for g in report["goals"]}
    assert {k: g["at_least"] for k, g in goals.items()} == {
        ("prefill", "engine_speedup_vs_transformers"): 1.0, ("prefill", "engine_speedup_vs_vllm"): 0.8,
        ("decode", "engine_speedup_vs_transformers"): 1.5, ("decode", "engine_speedup_vs_vllm"): 1.0,
        ("cached_prefix", "engine_speedup_vs_vllm"): 0.9, ("cached_prefix", "engine_hot_speedup_vs_vllm"): 1.0,
        ("cached_prefix", "engine_cold_speedup_vs_vllm"): 0.7}
    for (test, key), g in goals.items():
        assert g["value"] == report[test][key]
        assert g["met"] == (None if g["value"] is None else g["value"] >= g["at_least"])
    met = [g["met"] for g in report["goals"]]
    assert report["meets_goals"] == (False if False in met else None)   # the vLLM goals are not measured
    assert list(tmp_path.iterdir()) == []        # the data directory is gone


def test_table_output(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "compare", "--model", "tiny", "--skip-hf", "--skip-vllm",
                        "--rounds", "1", "--prefill-tokens", "20", "--batch", "2", "--prompt-tokens", "5",
                        "--new-tokens", "3", "--doc-tokens", "32", "--question-tokens", "4", "--dir", str(tmp_path)],
                       capture_output=True, text=True, env=clean_env(HF_HUB_OFFLINE="1"), cwd=tmp_path, timeout=240)
    assert r.returncode == 0, r.stderr
    assert "prefill 20 TTFT s" in r.stdout and "decode 2x5+3 tok/s" in r.stdout
    assert "vLLM skipped: --skip-vllm" in r.stdout and "not measured" in r.stdout


def test_vllm_venv_absent_is_a_note(tmp_path):
    import_or_unavailable("transformers")
    model = hf_model_dir(tmp_path / "model")
    work = tmp_path / "work"
    work.mkdir()
    r = compare("--model", str(model), "--skip-hf", "--vllm-venv", str(tmp_path / "no-venv"), *TINY_SIZES,
                "--rounds", "1", tmp_path=work)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["vllm"] is None and report["transformers"] is None
    assert report["vllm_note"].startswith("skipped: no vLLM venv at ") and "bootstrap_vllm" in report["vllm_note"]
    assert report["prefill"]["engine_speedup_vs_vllm"] is None and report["tokens_agree"] is None
    assert report["prefill"]["agreement"] == {} and report["meets_goals"] is None
    assert list(work.iterdir()) == []


@pytest.mark.parametrize("flag, value", [("--rounds", "0"), ("--threads", "0"), ("--prefill-tokens", "-3"),
                                         ("--doc-tokens", "0")])
def test_bad_option_exits_2(tmp_path, flag, value):
    r = compare("--model", "tiny", "--skip-vllm", flag, value, tmp_path=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and flag in r.stderr and value in r.stderr


# the worker in vLLM's venv, which ./scripts/test builds before the suite unless KVSTORE_TEST_VLLM=0
# (about 30 s: vLLM's start-up, eager mode)
@pytest.mark.slow
def test_vllm_worker(tmp_path):
    from app.bench.compare import default_vllm_venv
    from app.bench.contenders import VLLMWorker, WorkerError

    venv = Path(default_vllm_venv())
    if not (venv / "bin" / "python").exists():
        unavailable(f"no vLLM venv at {venv} (scripts/bootstrap_vllm)")
    transformers = import_or_unavailable("transformers")
    import torch

    model = hf_model_dir(tmp_path / "model")
    prompt = [(7 * i) % 300 + 3 for i in range(200)]   # a full 128-token block, then 72 tokens
    with torch.inference_mode():
        hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        ids = torch.tensor([prompt])
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                               min_new_tokens=6, eos_token_id=None, pad_token_id=2)[0, 200:].tolist()

    worker = VLLMWorker(str(venv), tmp_path / "vllm.log", threads=2)
    try:
        loaded = worker.call("load", model=str(model), max_model_len=512, enforce_eager=True)
        assert loaded["threads"] == 2 and loaded["vllm"]
        first = worker.call("generate", prompts=[prompt], max_tokens=6)
        assert first["tokens"] == [expected] and first["cached_tokens"] == [0] and positive(first["seconds"])
        assert worker.call("generate", prompts=[prompt], max_tokens=6)["cached_tokens"] == [128]
        assert worker.call("reset_prefix_cache") == {"reset": True}
        assert worker.call("generate", prompts=[prompt, prompt[:50]], max_tokens=2)["cached_tokens"] == [0, 0]
        with pytest.raises(WorkerError, match="unknown command 'nope'"):
            worker.call("nope")
        cpu = worker.cpu_seconds()
        time.sleep(1.0)
        assert worker.cpu_seconds() - cpu < 0.2   # idle, its threads sleep
        assert (tmp_path / "vllm.log").stat().st_size > 0   # its logs, kept off the answers
    finally:
        worker.close()
    assert worker.proc.returncode == 0
