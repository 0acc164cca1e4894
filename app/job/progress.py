"""Progress of a job on stderr.

On a terminal ("bar"): one tqdm bar, shown from the start, that says what the job is doing
("loading the model", "tokenizing document 2/9 (id)", "prefilling document 2/9 (id)", "answering
document 2/9 (id)") and counts questions, with documents done, elapsed time and ETA, tokens per
second (prompt and generated tokens handled, cached ones included; ETA and speed count from
the first document, not the model load) and the cache hit rate (prompt tokens served from
the cache). A timer thread redraws it every REFRESH_S, so the
elapsed time ticks while a long prefill runs and no question finishes.

Elsewhere, a log file or a pipe ("lines"): no bar and no carriage returns; a line when the job
starts a step of its own (loading the model) and one per finished document. "none": nothing.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from tqdm import tqdm

MODES = ("auto", "bar", "lines", "none")
REFRESH_S = 0.5
MAX_ID_CHARS = 24      # of a document id in the bar (the lines show it whole)
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} questions [{elapsed}{postfix}]"


def _duration(s: float) -> str:
    s = int(round(s))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _short(text: str, n: int = MAX_ID_CHARS) -> str:
    return text if len(text) <= n else text[:n - 1] + "…"


class Progress:
    """What the runners and the command report; safe to call from any thread."""

    def __init__(self, questions: int, documents: int, mode: str = "auto", stream: TextIO | None = None,
                 refresh_s: float = REFRESH_S):
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "lines"
        self.mode = mode
        self.total_q, self.total_d = questions, documents
        self.done_q = self.done_d = 0
        self.tokens = self.prompt_tokens = self.cached_tokens = 0
        self.started = time.monotonic()
        self.running: float | None = None     # when the first document started: rates count from there
        self.doing = "starting"
        self._lock = threading.RLock()
        self._bar: tqdm | None = None
        self._closed = threading.Event()
        if mode == "bar":
            self._bar = tqdm(total=questions, file=self.stream, desc=self.doing, postfix=self._postfix(),
                             bar_format=BAR_FORMAT, dynamic_ncols=True, mininterval=0.1, leave=True)
            threading.Thread(target=self._tick, args=(refresh_s,), name="kvstore-job-progress", daemon=True).start()

    # what the command and the runners report
    def phase(self, text: str, announce: bool = False) -> None:
        """What the job does now. `announce`: a step of the whole job (not of one document), also
        written as a line when there is no bar."""
        with self._lock:
            self.doing = text
            if self._bar is not None:
                self._draw()
            elif announce and self.mode == "lines":
                print(f"kvstore job: {text}", file=self.stream, flush=True)

    def at_document(self, doing: str, k: int, doc_id: str) -> None:
        """A document's step: "prefilling document k/N (id)"."""
        with self._lock:
            if self.running is None:
                self.running = time.monotonic()
            self.phase(f"{doing} document {k}/{self.total_d} ({_short(doc_id)})")

    def question(self, stats: dict) -> None:
        with self._lock:
            if self.running is None:
                self.running = time.monotonic()
            self.done_q += 1
            self.prompt_tokens += stats["prompt_tokens"]
            self.cached_tokens += stats["cached_total"]
            self.tokens += stats["prompt_tokens"] + stats["generated_tokens"]
            if self._bar is not None:
                self._bar.set_postfix_str(self._postfix(), refresh=False)
                self._bar.update(1)       # redraws at most every mininterval

    def document(self, doc_id: str, questions: int, seconds: float, failed: int = 0) -> None:
        with self._lock:
            self.done_d += 1
            if self.mode == "lines":
                extra = f", {failed} failed" if failed else ""
                print(f"kvstore job: document {self.done_d}/{self.total_d} ({doc_id}): {questions} answers{extra} "
                      f"in {seconds:.1f} s; {self.summary()}", file=self.stream, flush=True)
            elif self._bar is not None:
                self._draw()

    def message(self, text: str) -> None:
        """A line of its own, above the bar."""
        with self._lock:
            if self._bar is not None:
                self._bar.write(text, file=self.stream)
            else:
                print(text, file=self.stream, flush=True)

    def close(self, outcome: str = "done") -> None:
        """Stop the timer and leave the bar on its line, saying `outcome` ("done", "stopped").
        Idempotent."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            if self._bar is not None:
                self.doing = outcome
                self._draw()
                self._bar.close()

    # rendering
    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def running_s(self) -> float:
        """Seconds since the first document started (the model load and the like left out)."""
        return time.monotonic() - (self.running if self.running is not None else self.started)

    def eta(self) -> float | None:
        if not self.done_q:
            return None
        return self.running_s / self.done_q * (self.total_q - self.done_q)

    def rates(self) -> str:
        return f"{self.tokens / max(self.running_s, 1e-9):,.0f} tok/s, cache hit {self.hit_rate:.0%}"

    def summary(self) -> str:
        eta = self.eta()
        return f"ETA {_duration(eta) if eta is not None else '?'}, {self.rates()}"

    def _postfix(self) -> str:
        return f"{self.done_d}/{self.total_d} documents, {self.summary()}"

    def _draw(self) -> None:
        """Redraw the bar now (the caller holds the lock)."""
        self._bar.set_description_str(self.doing, refresh=False)
        self._bar.set_postfix_str(self._postfix(), refresh=False)
        self._bar.refresh()

    def _tick(self, every: float) -> None:
        while not self._closed.wait(every):
            with self._lock:
                if self._closed.is_set():
                    return
                self._draw()
