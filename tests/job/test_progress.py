"""The job's progress: on a terminal a bar that says what the job does from the start and whose
elapsed time ticks while no question finishes; elsewhere plain lines, one per document. Driven
through a terminal stream (tqdm writes to any file), and end to end through a real pseudo-terminal
and a pipe."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from app.job.progress import Progress

REPO = Path(__file__).resolve().parents[2]


class Terminal(io.StringIO):
    """What a terminal receives: a text stream that says it is one."""

    def isatty(self) -> bool:
        return True


def frames(text: str) -> list[str]:
    """The successive states of the bar (each redraw starts with a carriage return)."""
    return [f.strip() for f in re.split(r"[\r\n]", text) if f.strip()]


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def stats(prompt: int, cached: int, generated: int) -> dict:
    return {"prompt_tokens": prompt, "cached_total": cached, "generated_tokens": generated}


def test_bar_says_what_the_job_does_at_once_and_its_clock_ticks_without_questions():
    term = Terminal()
    started = time.monotonic()
    progress = Progress(6, 2, "auto", stream=term)
    try:
        assert progress.mode == "bar"
        progress.phase("loading the model (tiny)", announce=True)
        assert time.monotonic() - started < 1.0
        assert "loading the model (tiny)" in frames(term.getvalue())[-1]
        assert "0/6 questions [00:00" in frames(term.getvalue())[-1]

        progress.at_document("prefilling", 1, "report-7")
        # a long prefill: no question finishes, yet the bar is redrawn and its elapsed time moves
        assert wait_for(lambda: "[00:02" in frames(term.getvalue())[-1], timeout=4.0), frames(term.getvalue())[-3:]
        last = frames(term.getvalue())[-1]
        assert last.startswith("prefilling document 1/2 (report-7):") and "0/6 questions" in last
        assert "ETA ?" in last
        ticks = [f for f in frames(term.getvalue()) if f.startswith("prefilling document 1/2")]
        assert len({re.search(r"\[(\d\d:\d\d)", f).group(1) for f in ticks}) >= 3    # 00:00, 00:01, 00:02

        progress.at_document("answering", 1, "report-7")
        progress.question(stats(1000, 0, 8))
        progress.question(stats(1000, 960, 8))
        progress.message("kvstore job: line 3: document 'x', question 1 failed: too long")
        progress.document("report-7", 2, 2.5)
        text = term.getvalue()
        last = frames(text)[-1]
        assert last.startswith("answering document 1/2 (report-7):") and "2/6 questions" in last
        assert "1/2 documents" in last and "cache hit 48%" in last and "ETA " in last and "ETA ?" not in last
        assert "\rkvstore job: line 3: document 'x', question 1 failed: too long\n" in text   # bar cleared first
    finally:
        progress.close()
    assert frames(term.getvalue())[-1].startswith("done:") and term.getvalue().endswith("\n")
    size = len(term.getvalue())
    time.sleep(0.8)
    assert len(term.getvalue()) == size       # closed: the timer stopped


def test_a_long_document_id_is_cut_in_the_bar():
    term = Terminal()
    progress = Progress(1, 1, "bar", stream=term)
    progress.at_document("prefilling", 1, "x" * 200)
    progress.close()
    assert "(" + "x" * 23 + "…)" in term.getvalue() and "x" * 24 not in term.getvalue()


def test_without_a_terminal_a_plain_line_per_document_and_no_bar():
    out = io.StringIO()
    progress = Progress(3, 2, "auto", stream=out)
    assert progress.mode == "lines"
    progress.phase("loading the model (tiny)", announce=True)
    progress.at_document("prefilling", 1, "a")
    progress.question(stats(100, 0, 4))
    progress.at_document("answering", 1, "a")
    progress.question(stats(100, 96, 4))
    progress.document("a", 2, 1.25)
    progress.at_document("prefilling", 2, "b")
    time.sleep(1.2)          # no timer: nothing is written while nothing happens
    progress.question(stats(100, 0, 4))
    progress.document("b", 1, 0.5, failed=1)
    progress.message("kvstore job: line 2: document 'b', question 1 failed: too long")
    progress.close()
    text = out.getvalue()
    assert "\r" not in text and "\033" not in text and "|" not in text
    lines = text.splitlines()
    assert lines[0] == "kvstore job: loading the model (tiny)"
    assert lines[1].startswith("kvstore job: document 1/2 (a): 2 answers in 1.2 s; ETA ")
    assert lines[1].endswith("cache hit 48%")
    assert lines[2].startswith("kvstore job: document 2/2 (b): 1 answers, 1 failed in 0.5 s; ETA 0s")
    assert lines[3] == "kvstore job: line 2: document 'b', question 1 failed: too long"
    assert len(lines) == 4


def test_none_writes_only_problems():
    out = Terminal()
    progress = Progress(1, 1, "none", stream=out)
    progress.phase("loading the model (tiny)", announce=True)
    progress.at_document("prefilling", 1, "a")
    progress.question(stats(100, 0, 4))
    progress.document("a", 1, 0.1)
    progress.message("kvstore job: a problem")
    progress.close()
    assert out.getvalue() == "kvstore job: a problem\n"


# end to end: `kvstore job run` on a pseudo-terminal, and on a pipe
def write_job(path: Path) -> None:
    words = "alpha beta gamma delta epsilon zeta theta kappa".split()
    path.write_text("".join(json.dumps({"id": f"doc-{i}", "document": " ".join(words[(i + j) % 8] for j in range(60)),
                                        "questions": [f"Question {q}?" for q in range(3)]}) + "\n" for i in range(2)))


def job_command(tmp_path: Path, name: str) -> list[str]:
    return [sys.executable, "-m", "app.job.cli", "run", str(tmp_path / "in.jsonl"),
            "--out", str(tmp_path / name / "ANSWERS.jsonl"), "--data-dir", str(tmp_path / f"{name}-data"),
            "--max-tokens", "8", "--set", "hot.device=cpu", "--set", "warm.bytes=4MiB"]


def job_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "COLUMNS"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_on_terminal(cmd: list[str], timeout: float = 240) -> tuple[int, list[tuple[float, str]]]:
    """Run cmd with stdout and stderr on a pseudo-terminal; returns its exit code and every frame it
    drew, with the seconds since the first one."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))    # rows, columns
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=job_env(), cwd=REPO)
    os.close(slave)
    out: list[tuple[float, str]] = []
    first, pending, deadline = None, "", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.1)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536).decode(errors="replace")
            except OSError:       # the child closed the terminal
                break
            if not data:
                break
            now = time.monotonic()
            first = first if first is not None else now
            pieces = re.split(r"[\r\n]", pending + data)
            pending = pieces.pop()
            out += [(now - first, p.strip()) for p in pieces if p.strip()]
        if pending.strip():
            out.append((time.monotonic() - (first or 0), pending.strip()))
        return proc.wait(timeout=60), out
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


def test_job_on_a_terminal_shows_its_steps_and_on_a_pipe_a_line_per_document(tmp_path):
    write_job(tmp_path / "in.jsonl")
    rc, drawn = run_on_terminal(job_command(tmp_path, "tty"))
    texts = [t for _, t in drawn]
    assert rc == 0, texts[-10:]
    # the first thing on screen is the bar, before anything slow (torch, the model) is loaded
    assert texts[0].startswith("starting:") and "0/6 questions" in texts[0]
    steps = []
    for t in texts:
        step = t.split(":", 1)[0]
        if "%|" in t and (not steps or steps[-1] != step):
            steps.append(step)
    order = ["starting", "loading the engine", "loading the model (tiny)", "prefilling document 1/2 (doc-0)", "answering document 1/2 (doc-0)",
             "prefilling document 2/2 (doc-1)", "answering document 2/2 (doc-1)", "done"]
    assert [s for s in steps if s in order] == order, steps
    assert any(t.startswith("done: 100%") and "6/6 questions" in t and "2/2 documents" in t for t in texts), texts[-5:]
    assert texts[-1] == f"kvstore job: done: 6 answers in {tmp_path / 'tty' / 'ANSWERS.jsonl'}"

    piped = subprocess.run(job_command(tmp_path, "pipe"), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           env=job_env(), cwd=REPO, timeout=240)
    assert piped.returncode == 0, piped.stderr
    assert "\r" not in piped.stderr and "%|" not in piped.stderr
    lines = piped.stderr.splitlines()
    assert lines[0] == "kvstore job: loading the model (tiny)"
    assert lines[1].startswith("kvstore job: document 1/2 (doc-0): 3 answers in ")
    assert lines[2].startswith("kvstore job: document 2/2 (doc-1): 3 answers in ")
    assert lines[3].startswith("kvstore job: done: 6 answers in ") and len(lines) == 4
    assert (tmp_path / "pipe" / "ANSWERS.jsonl").read_bytes() == (tmp_path / "tty" / "ANSWERS.jsonl").read_bytes()
