"""Progress of a job on stderr.

On a terminal: one bar, redrawn at most ten times a second, with questions and documents done,
ETA, tokens per second (prompt and generated tokens handled, cached ones included) and the
cache hit rate (prompt tokens served from the cache). Elsewhere (a log file, a pipe): one line
per finished document, or nothing with mode "none".
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO

MODES = ("auto", "bar", "lines", "none")


def _duration(s: float) -> str:
    s = int(round(s))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    def __init__(self, questions: int, documents: int, mode: str = "auto", stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "lines"
        self.mode = mode
        self.total_q, self.total_d = questions, documents
        self.done_q = self.done_d = 0
        self.tokens = self.prompt_tokens = self.cached_tokens = 0
        self.started = time.monotonic()
        self._drawn = 0.0

    # what the runner reports
    def question(self, stats: dict) -> None:
        self.done_q += 1
        self.prompt_tokens += stats["prompt_tokens"]
        self.cached_tokens += stats["cached_total"]
        self.tokens += stats["prompt_tokens"] + stats["generated_tokens"]
        if self.mode == "bar":
            self.draw()

    def document(self, doc_id: str, questions: int, seconds: float, failed: int = 0) -> None:
        self.done_d += 1
        if self.mode == "lines":
            extra = f", {failed} failed" if failed else ""
            print(f"kvstore job: document {self.done_d}/{self.total_d} ({doc_id}): {questions} answers{extra} "
                  f"in {seconds:.1f} s; {self.summary()}", file=self.stream, flush=True)
        elif self.mode == "bar":
            self.draw(force=True)

    def message(self, text: str) -> None:
        """A line that must not be mixed into the bar."""
        if self.mode == "bar":
            self.stream.write("\r\033[K")
        print(text, file=self.stream, flush=True)
        if self.mode == "bar":
            self.draw(force=True)

    def close(self) -> None:
        if self.mode == "bar":
            self.draw(force=True)
            self.stream.write("\n")
            self.stream.flush()

    # rendering
    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def eta(self) -> float | None:
        elapsed = time.monotonic() - self.started
        if not self.done_q:
            return None
        return elapsed / self.done_q * (self.total_q - self.done_q)

    def summary(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        eta = self.eta()
        return (f"ETA {_duration(eta) if eta is not None else '?'}, {self.tokens / elapsed:,.0f} tok/s, "
                f"cache hit {self.hit_rate:.0%}")

    def line(self, width: int) -> str:
        frac = self.done_q / self.total_q if self.total_q else 1.0
        text = (f" {self.done_q}/{self.total_q} questions, {self.done_d}/{self.total_d} documents, "
                f"{self.summary()}")
        bar = max(10, min(40, width - len(text) - 3))
        filled = int(frac * bar)
        return f"[{'#' * filled}{'.' * (bar - filled)}]{text}"[:max(width - 1, 20)]

    def draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._drawn < 0.1:
            return
        self._drawn = now
        width = shutil.get_terminal_size((100, 20)).columns
        self.stream.write("\r\033[K" + self.line(width))
        self.stream.flush()
