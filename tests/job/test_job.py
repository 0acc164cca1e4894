"""`kvstore job run`: answers equal to uncached ones, each document's prefix computed once, bad
lines reported, a document longer than the hot tier, and the same job through `kvstore serve`.
CPU, the tiny preset (random weights, byte tokenizer)."""

from __future__ import annotations

import gc
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from app.job.cli import main
from app.job.runner import PROMPT_SUFFIX

REPO = Path(__file__).resolve().parents[2]
WORDS = ("cache page token prefix tier warm cold hot memory disk model layer head value key query "
         "batch queue document question answer report revenue region growth quarter").split()
FAST = ["--set", "hot.device=cpu", "--set", "warm.bytes=4MiB", "--progress", "lines"]


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The tiny model runs several times faster on one thread, above all on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def document(i: int, words: int) -> str:
    rng = random.Random(i)
    return f"Document {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def questions(i: int, n: int) -> list[str]:
    return [f"What does document {i} say about the {WORDS[(i + j) % len(WORDS)]} (#{j})?" for j in range(n)]


def write_input(path: Path, docs: list[dict], extra_lines: dict[int, str] | None = None) -> Path:
    lines = [json.dumps(d) for d in docs]
    for at, text in sorted((extra_lines or {}).items()):
        lines.insert(at - 1, text)     # lands on line `at`
    path.write_text("\n".join(lines) + "\n")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def uncached_answers(tmp_path: Path, docs: list[dict], max_tokens: int, **options) -> dict:
    """(id, question index) -> the output of that question run alone, nothing cached: a fresh
    engine, and a tenant of its own per question (no two prompts share a cached page)."""
    opts = dict(dtype="float32", attention_backend="torch", data_dir=str(tmp_path / "alone"), hot__device="cpu",
                hot__pool="4MiB", warm__bytes="4MiB")
    opts.update(options)
    llm = LLM("tiny", **opts)
    try:
        out = {}
        for d in docs:
            for q, question in enumerate(d["questions"]):
                prompt = d["document"] + PROMPT_SUFFIX.format(question=question)
                [res] = llm.generate(prompt, SamplingParams(max_tokens=max_tokens), tenant=f"alone-{d['id']}-{q}")
                assert sum(res.cached_tokens.values()) == 0
                out[(d["id"], q)] = res
        return out
    finally:
        llm.close()


def test_twenty_documents_answers_match_uncached_and_each_prefix_is_prefilled_once(tmp_path, capsys):
    docs = [{"id": f"doc-{i}", "document": document(i, 30 + 7 * (i % 5)), "questions": questions(i, 5)}
            for i in range(20)]
    inp = write_input(tmp_path / "in.jsonl", docs)
    out = tmp_path / "out" / "ANSWERS.jsonl"
    # a hot tier of 256 pages: earlier documents are pushed down to warm as the job goes
    rc = main(["run", str(inp), "--out", str(out), "--max-tokens", "12", "--data-dir", str(tmp_path / "data"),
               "--set", "hot.pool=1MiB", *FAST])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "document 20/20 (doc-19): 5 answers" in err and "done: 100 answers" in err

    answers = read_jsonl(out)
    assert [(a["id"], a["question_index"]) for a in answers] == [(d["id"], q) for d in docs for q in range(5)]
    alone = uncached_answers(tmp_path, docs, 12)
    for a in answers:
        ref = alone[(a["id"], a["question_index"])]
        assert a["token_ids"] == ref.token_ids and len(ref.token_ids) == 12
        assert a["answer"] == ref.text
        assert a["finish_reason"] == "length"

    stats = read_jsonl(out.with_name("ANSWERS.stats.jsonl"))
    assert len(stats) == 100
    for d in docs:
        rows = [s for s in stats if s["id"] == d["id"]]
        prefix = rows[0]["document_prefix_tokens"]
        assert prefix == (1 + len(d["document"].encode())) // 16 * 16 > 0    # BOS + bytes, full pages
        assert sum(s["prefix_tokens_computed"] for s in rows) == prefix, rows   # exactly once
        [lead] = [s for s in rows if s["lead"]]
        assert lead["question_index"] == 0 and lead["cached_total"] == 0 and lead["tier"] == "none"
        for s in rows:
            assert s["prompt_tokens"] == len(alone[(d["id"], s["question_index"])].prompt_token_ids)
            assert s["generated_tokens"] == 12 and s["ttft_s"] > 0 and s["seconds"] >= s["ttft_s"]
            if not s["lead"]:
                assert s["cached_total"] >= prefix and s["tier"] == "hot"
                assert s["prefill_tokens"] == s["prompt_tokens"] - s["cached_total"] < s["prompt_tokens"] - prefix + 16


def test_bad_lines_are_reported_with_their_line_numbers_and_skipped(tmp_path, capsys):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.txt").write_text(document(2, 40))
    docs = [{"id": "a", "document": document(1, 30), "questions": questions(1, 2)},
            {"id": "b", "document": "@docs/b.txt", "questions": questions(2, 2), "max_tokens": 5},
            {"id": "c", "document": document(3, 30), "questions": questions(3, 2)}]
    inp = write_input(tmp_path / "in.jsonl", docs, {2: '{"id": "x", "document": "no closing brace"',
                                                    4: json.dumps({"id": "y", "document": "text"}),
                                                    6: json.dumps({"id": "z", "document": "@docs/missing.txt",
                                                                   "questions": ["?"]})})
    out, report = tmp_path / "ANSWERS.jsonl", tmp_path / "report"
    rc = main(["run", str(inp), "--out", str(out), "--max-tokens", "4", "--data-dir", str(tmp_path / "data"),
               "--report", str(report), *FAST])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert f"{inp}:2: bad line, skipped: not valid JSON" in err
    assert f"{inp}:4: bad line, skipped: questions must be a non-empty list" in err
    assert f"{inp}:6: bad line, skipped: document '@docs/missing.txt': no such file" in err
    assert "3 bad line(s) skipped, 0 question(s) failed; 6 of 6 answers" in err
    answers = read_jsonl(out)
    assert [(a["id"], a["question_index"]) for a in answers] == [(i, q) for i in "abc" for q in range(2)]
    assert [len(a["token_ids"]) for a in answers] == [4, 4, 5, 5, 4, 4]
    stats = read_jsonl(tmp_path / "ANSWERS.stats.jsonl")
    b_prompt = 1 + len(document(2, 40).encode()) + len(PROMPT_SUFFIX.format(question=questions(2, 2)[0]).encode())
    assert [s["prompt_tokens"] for s in stats if s["id"] == "b"][0] == b_prompt   # read from the file
    text = (report / "report.md").read_text()
    assert "3 bad input line(s), skipped" in text and "- line 2: not valid JSON" in text and "- line 6:" in text
    assert gc.get_freeze_count() == 0   # the job froze its startup heap while it ran, and thawed it after


def test_fail_fast_stops_at_the_first_bad_line(tmp_path, capsys):
    docs = [{"id": "a", "document": document(1, 30), "questions": questions(1, 2)},
            {"id": "b", "document": document(2, 30), "questions": questions(2, 2)}]
    inp = write_input(tmp_path / "in.jsonl", docs, {2: json.dumps({"id": "a", "document": "dup", "questions": ["?"]})})
    out = tmp_path / "ANSWERS.jsonl"
    rc = main(["run", str(inp), "--out", str(out), "--fail-fast", "--data-dir", str(tmp_path / "data"), *FAST])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"{inp}:2: bad line, skipped: id 'a' is used already on line 1" in err
    assert "stopped at the first bad line (--fail-fast)" in err
    assert not out.exists() or out.read_text() == ""


def test_document_longer_than_the_hot_tier_completes_with_pages_in_warm_and_cold(tmp_path, capsys):
    # the hot tier holds 16 pages (256 tokens); the document takes 38
    docs = [{"id": "long", "document": document(7, 110), "questions": questions(7, 3)}]
    assert (1 + len(docs[0]["document"].encode())) // 16 > 32
    inp = write_input(tmp_path / "in.jsonl", docs)
    out = tmp_path / "ANSWERS.jsonl"
    rc = main(["run", str(inp), "--out", str(out), "--max-tokens", "6", "--data-dir", str(tmp_path / "data"),
               "--set", "hot.pool=64KiB", "--set", "warm.bytes=64KiB", *FAST])
    assert rc == 0, capsys.readouterr().err
    alone = uncached_answers(tmp_path, docs, 6)
    answers = read_jsonl(out)
    assert len(answers) == 3
    for a in answers:
        assert a["token_ids"] == alone[(a["id"], a["question_index"])].token_ids
    stats = read_jsonl(tmp_path / "ANSWERS.stats.jsonl")
    prefix = stats[0]["document_prefix_tokens"]
    assert sum(s["prefix_tokens_computed"] for s in stats) == prefix
    for s in stats:
        if not s["lead"]:
            assert s["cached_tokens"]["warm"] + s["cached_tokens"]["cold"] > 0, s


def _serve(tmp_path: Path) -> tuple[subprocess.Popen, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen([sys.executable, "-m", "app", "serve", "--model", "tiny", "--port", "0",
                             "--data-dir", str(tmp_path / "serve-data"), "--set", "hot.pool=4MiB",
                             "--set", "warm.bytes=4MiB", "--set", "server.trust_tenant_header=true"],
                            cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    line = proc.stdout.readline()
    if " ready on " not in line:
        proc.kill()
        pytest.fail(f"kvstore serve did not start: {line!r}")
    return proc, line.split(" ready on ", 1)[1].split()[0]


def test_url_target_gives_the_same_answers_as_in_process(tmp_path, capsys):
    docs = [{"id": f"d{i}", "document": document(40 + i, 35), "questions": questions(40 + i, 4)} for i in range(4)]
    docs[1]["tenant"] = "acme"
    docs[2].update(temperature=0.8, seed=11)
    docs[3]["temperature"] = 0.7          # seeded per question: repeats exactly
    inp = write_input(tmp_path / "in.jsonl", docs)
    local = tmp_path / "local" / "ANSWERS.jsonl"
    assert main(["run", str(inp), "--out", str(local), "--max-tokens", "10", "--data-dir", str(tmp_path / "data"),
                 "--set", "hot.pool=4MiB", *FAST]) == 0
    proc, url = _serve(tmp_path)
    try:
        remote = tmp_path / "remote" / "ANSWERS.jsonl"
        capsys.readouterr()
        rc = main(["run", str(inp), "--out", str(remote), "--max-tokens", "10", "--url", url,
                   "--concurrency", "3", "--report", str(tmp_path / "report"), *FAST, "--progress", "bar"])
        err = capsys.readouterr().err
        assert rc == 0, err
    finally:
        proc.terminate()
        proc.wait(30)
    assert remote.read_bytes() == local.read_bytes()
    stats = read_jsonl(remote.with_name("ANSWERS.stats.jsonl"))
    assert len(stats) == 16
    for s in stats:
        assert set(s["cached_tokens"]) == {"total"} and s["ttft_s"] > 0 and 1 <= s["generated_tokens"] <= 10
        if s["lead"]:
            assert s["cached_total"] == 0 and s["tier"] == "none"
        else:
            assert s["cached_total"] >= s["document_prefix_tokens"] and s["tier"] == "cached"
    report = (tmp_path / "report" / "report.md").read_text()
    assert "cached (tier not reported)" in report
    assert "Tier occupancy is only sampled with the in-process engine" in report
    # the bar says what the job does against the server too
    for step in ("loading the tokenizer", "tokenizing document 1/4 (d0)", "prefilling document 1/4 (d0)",
                 "answering document 1/4 (d0)", "prefilling document 4/4 (d3)", "done"):
        assert f"\r{step}: " in err, step
    assert "16/16 questions" in err


def test_a_bad_sample_interval_is_refused_before_anything_runs(tmp_path, capsys):
    inp = write_input(tmp_path / "in.jsonl", [{"id": "a", "document": document(1, 20), "questions": questions(1, 1)}])
    out = tmp_path / "ANSWERS.jsonl"
    assert main(["run", str(inp), "--out", str(out), "--sample-interval", "0", *FAST]) == 2
    assert "--sample-interval = 0.0: must be a number of seconds in [0.01, 3600]" in capsys.readouterr().err
    assert not out.exists()


def test_the_occupancy_sampler_counts_pages_without_walking_the_store(tmp_path, capsys, monkeypatch):
    """Samples every 0.01 s come from the index's counts (store.tier_pages), never store.stats(),
    which walks every page under the store's lock; they still say how many pages each tier holds."""
    from kvstore.store.tiered import TieredStore
    walked = []
    stats = TieredStore.stats
    monkeypatch.setattr(TieredStore, "stats", lambda self: walked.append(1) or stats(self))
    docs = [{"id": f"d{i}", "document": document(i, 60), "questions": questions(i, 2)} for i in range(3)]
    inp = write_input(tmp_path / "in.jsonl", docs)
    out = tmp_path / "ANSWERS.jsonl"
    rc = main(["run", str(inp), "--out", str(out), "--max-tokens", "4", "--data-dir", str(tmp_path / "data"),
               "--sample-interval", "0.01", *FAST])
    assert rc == 0, capsys.readouterr().err
    samples = read_jsonl(tmp_path / "ANSWERS.occupancy.jsonl")
    assert len(samples) >= 2 and walked == []
    assert samples[-1]["hot"] + samples[-1]["warm"] + samples[-1]["cold"] > 0
