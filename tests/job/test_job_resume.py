"""Resuming `kvstore job run`: interrupted by SIGINT, SIGTERM and SIGKILL (and a torn last line),
then run again, the answers file ends byte-identical to an uninterrupted run's, and no finished
question is computed again. CPU, the tiny preset."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from app.job.cli import main
from app.job.io import AnswerLog

REPO = Path(__file__).resolve().parents[2]
WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega".split()
OPTIONS = ["--max-tokens", "12", "--set", "hot.device=cpu", "--set", "hot.pool=1MiB", "--set", "warm.bytes=4MiB",
           "--progress", "lines"]


@pytest.fixture(autouse=True)
def one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def write_input(path: Path, docs: int, questions: int) -> list[tuple[str, int]]:
    lines = []
    for i in range(docs):
        text = f"Report {i}. " + " ".join(WORDS[(i * 7 + j * j) % len(WORDS)] for j in range(40 + i % 4 * 9))
        lines.append(json.dumps({"id": f"r{i}", "document": text,
                                 "questions": [f"Question {j} about report {i}?" for j in range(questions)]}))
    path.write_text("\n".join(lines) + "\n")
    return [(f"r{i}", j) for i in range(docs) for j in range(questions)]


def start(inp: Path, out: Path, data: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen([sys.executable, "-m", "app.job.cli", "run", str(inp), "--out", str(out),
                             "--data-dir", str(data), *OPTIONS], cwd=REPO, env=env, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def interrupt(proc: subprocess.Popen, out: Path, after_lines: int, sig: int) -> tuple[int, str]:
    """Send `sig` once the answers file has at least `after_lines` lines; returns (exit code, stderr)."""
    deadline = time.monotonic() + 120
    while lines(out) < after_lines and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def test_interrupted_job_resumes_to_the_same_answers_without_recomputing(tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    keys = write_input(inp, docs=10, questions=4)
    ref = tmp_path / "ref" / "ANSWERS.jsonl"
    assert main(["run", str(inp), "--out", str(ref), "--data-dir", str(tmp_path / "ref-data"), *OPTIONS]) == 0
    assert len(ref.read_text().splitlines()) == 40

    out, data = tmp_path / "run" / "ANSWERS.jsonl", tmp_path / "run-data"
    stats = out.with_name("ANSWERS.stats.jsonl")
    rc, err = interrupt(start(inp, out, data), out, 1, signal.SIGINT)     # after the first document
    assert rc == 130, err
    assert "interrupted by SIGINT" in err and "run the same command again to resume" in err
    first = lines(out)
    assert 4 <= first < 40, first
    assert "Traceback" not in err

    rc, err = interrupt(start(inp, out, data), out, first + 4, signal.SIGTERM)
    assert rc == 143, err
    assert f"resuming: {first} of 40 answers are in" in err and "interrupted by SIGTERM" in err
    second = lines(out)
    assert first < second < 40

    rc, _ = interrupt(start(inp, out, data), out, second + 4, signal.SIGKILL)
    assert rc == -signal.SIGKILL
    third = lines(out)
    assert second < third < 40
    done = {(a["id"], a["question_index"]) for a in map(json.loads, out.read_text().splitlines())}
    torn = next(k for k in keys if k not in done)
    with open(out, "a") as f:          # a crash in the middle of a write
        f.write(json.dumps({"id": torn[0], "question_index": torn[1], "question": "?", "answer": "half"})[:40])

    rc = main(["run", str(inp), "--out", str(out), "--data-dir", str(data), *OPTIONS])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "cut off a partly written last line" in err and f"resuming: {third} of 40 answers" in err
    assert out.read_bytes() == ref.read_bytes()

    # every question was computed by exactly one run: the stats hold each one once
    counts = Counter((s["id"], s["question_index"]) for s in map(json.loads, stats.read_text().splitlines()))
    assert max(counts.values()) == 1
    assert set(counts) <= set(keys)
    assert len({s["session"] for s in map(json.loads, stats.read_text().splitlines())}) >= 3
    # the tier occupancy of every run that answered something, sampled from its start
    samples = [json.loads(line) for line in out.with_name("ANSWERS.occupancy.jsonl").read_text().splitlines()]
    for session in {s["session"] for s in map(json.loads, stats.read_text().splitlines())}:
        rows = [s for s in samples if s["session"] == session]
        assert rows and rows[0]["seconds"] < 0.5 and rows[0]["questions"] == 0, (session, rows)

    # run again: nothing left to do, nothing changes
    before = (out.read_bytes(), stats.read_bytes())
    assert main(["run", str(inp), "--out", str(out), "--data-dir", str(data), *OPTIONS]) == 0
    assert "answered already" in capsys.readouterr().err
    assert (out.read_bytes(), stats.read_bytes()) == before


def test_partly_written_last_line_is_cut_off(tmp_path):
    out = tmp_path / "ANSWERS.jsonl"
    full = [json.dumps({"id": "a", "question_index": q, "answer": "x"}) + "\n" for q in range(2)]
    out.write_text("".join(full) + '{"id": "a", "question_index": 2, "ans')
    log = AnswerLog(out).open()
    assert log.dropped_partial == len('{"id": "a", "question_index": 2, "ans')
    assert out.read_text() == "".join(full)
    assert log.done(("a", 0)) and log.done(("a", 1)) and not log.done(("a", 2))


def test_answers_are_put_back_in_input_order_when_all_are_done(tmp_path):
    out = tmp_path / "ANSWERS.jsonl"
    log = AnswerLog(out).open()
    order = [("a", 0), ("a", 1), ("b", 0)]
    answer = lambda k: {"id": k[0], "question_index": k[1], "answer": f"{k}"}   # noqa: E731
    log.write([answer(("a", 0)), answer(("b", 0))], [])
    assert not log.finalize(order)                 # ("a", 1) is missing: left as it is
    log.write([answer(("a", 1))], [])
    assert log.finalize(order)
    assert [(a["id"], a["question_index"]) for a in map(json.loads, out.read_text().splitlines())] == order
    assert not log.finalize(order)                 # in order already


def test_an_output_that_is_not_a_job_output_is_refused(tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    write_input(inp, docs=1, questions=1)
    out = tmp_path / "ANSWERS.jsonl"
    out.write_text("hello\n")
    assert main(["run", str(inp), "--out", str(out), "--data-dir", str(tmp_path / "data"), *OPTIONS]) == 2
    assert "line 1 is not an answer of a job" in capsys.readouterr().err
    assert out.read_text() == "hello\n"
