"""What the cache-aware job runners share: the job's settings, each question's sampling, the
document loop's results, stats and progress (JobRunner). The runners: the in-process engine
(engine_runner.py, EngineRunner) or a `kvstore serve` (http_runner.py, HttpRunner).

The prompt of question q of a document is the document's token ids followed by the ids of
PROMPT_SUFFIX (encoded without BOS). The document is encoded once for all its questions, so
their prompts share the document's pages byte for byte.

Per document, in input order:
1. the lead question (the first one not finished) runs alone until its first token: the
   document's prefix is computed once and committed as cached pages;
2. the prefix pages are pinned (when they take at most half of the hot tier: pinning more
   would starve the questions themselves), and the other questions run batched together,
   each computing only its own suffix;
3. the pins are released and the document's results are handed to `on_document`.
The progress hears which step a document is at (tokenizing, prefilling, answering).

Per question the stats record how much of the document prefix (its full pages) it computed;
summed over a document's questions and divided by the prefix length, that is how many times
the prefix was prefilled: 1 on a fresh cache, 0 when it came from the cache.

`stop` (a threading.Event, set from a signal handler) ends the run between engine steps:
unfinished questions are aborted and the finished ones are still handed over.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import blake3

from engine.sampler import SamplingParams
from kvstore.errors import KVStoreError
from app.job.io import Document, Key

PROMPT_SUFFIX = "\n\nQuestion: {question}\nAnswer:"


@dataclass(frozen=True)
class Settings:
    """Job-wide sampling defaults; an input line's own fields win."""

    max_tokens: int = 64
    temperature: float = 0.0
    seed: int | None = None


def derived_seed(doc_id: str, question: int) -> int:
    """A fixed seed per item, so sampled answers (temperature > 0) repeat across runs and resumes."""
    return int.from_bytes(blake3.blake3(f"{doc_id}\0{question}".encode()).digest(8), "little") >> 1


def question_params(doc: Document, q: int, settings: Settings) -> SamplingParams:
    temperature = doc.temperature if doc.temperature is not None else settings.temperature
    seed = doc.seed if doc.seed is not None else settings.seed
    if seed is None and temperature > 0:
        seed = derived_seed(doc.id, q)
    return SamplingParams(max_tokens=doc.max_tokens or settings.max_tokens, temperature=temperature, seed=seed)


def tier_of(cached: dict) -> str:
    """Where most of a question's cached tokens came from (hot, warm, cold, peer); "none" when all
    were computed, "cached" when only their number is known (--url: the server's usage)."""
    if not sum(v for v in cached.values() if v):
        return "none"
    if "total" in cached:
        return "cached"
    return max(cached, key=lambda t: cached[t] or 0)


@dataclass
class Prepared:
    """A document tokenized (and its prefix prefetched), ready to run."""

    doc: Document
    doc_ids: list[int] = field(default_factory=list)
    suffixes: list[list[int]] = field(default_factory=list)
    error: str | None = None
    pinned: list[bytes] = field(default_factory=list)   # prefetched pages pinned until the document is done
    prefetched_pages: int = 0                           # of those, how many came up from cold


@dataclass
class Result:
    """One question's outcome: an answer and its stats, or an error."""

    key: Key
    answer: dict | None = None
    stats: dict | None = None
    error: str | None = None


@dataclass
class Outcome:
    """What a run did."""

    answered: int = 0
    failed: list[tuple[Document, str]] = field(default_factory=list)   # (document, "question i: why")
    interrupted: bool = False
    samples: list[dict] = field(default_factory=list)   # tier occupancy: {"session", "seconds", "questions",
                                                        # hot, warm, cold}, appended by a timer thread


def prepare(doc: Document, tokenizer) -> Prepared:
    try:
        text = doc.text()
    except KVStoreError as exc:
        return Prepared(doc, error=str(exc))
    ids = tokenizer.encode(text)
    suffixes = [tokenizer.encode(PROMPT_SUFFIX.format(question=q), add_bos=False) for q in doc.questions]
    if not ids:
        return Prepared(doc, error="the document is empty")
    return Prepared(doc, ids, suffixes)


class JobRunner:
    """What both targets share: the document loop, results, stats records and progress."""

    def __init__(self, settings: Settings, on_document: Callable[[Document, list[Result]], None],
                 progress=None, session: int = 1, page_size: int = 16):
        self.settings, self.on_document, self.progress = settings, on_document, progress
        self.session, self.page_size = session, page_size
        self.stop = threading.Event()
        self.outcome = Outcome()
        self.started = time.monotonic()
        self._numbers: dict[str, int] = {}    # document id -> its number among the pending ones

    def pending(self, documents: Sequence[Document], done: Callable[[Key], bool]) -> list[tuple[Document, list[int]]]:
        todo = []
        for doc in documents:
            qs = [q for q in range(len(doc.questions)) if not done((doc.id, q))]
            if qs:
                todo.append((doc, qs))
        self._numbers = {doc.id: k for k, (doc, _) in enumerate(todo, start=1)}
        return todo

    def at(self, doing: str, doc: Document) -> None:
        """Tell the progress which step a document is at: "prefilling document k/N (id)"."""
        if self.progress:
            self.progress.at_document(doing, self._numbers.get(doc.id, 0), doc.id)

    def answer(self, doc: Document, q: int, text: str, token_ids: list[int], finish_reason: str | None) -> dict:
        return {"id": doc.id, "question_index": q, "question": doc.questions[q], "answer": text,
                "token_ids": token_ids, "finish_reason": finish_reason}

    def stats(self, doc: Document, q: int, lead: bool, prompt_tokens: int, cached: dict, generated: int,
              ttft_s: float | None, seconds: float | None, doc_tokens: int) -> dict:
        cached_total = sum(v for v in cached.values() if v)
        prefix = doc_tokens // self.page_size * self.page_size
        return {"id": doc.id, "question_index": q, "session": self.session, "lead": lead,
                "tier": tier_of(cached), "prompt_tokens": prompt_tokens, "cached_tokens": cached,
                "cached_total": cached_total, "prefill_tokens": prompt_tokens - cached_total,
                "generated_tokens": generated, "ttft_s": _round(ttft_s), "seconds": _round(seconds),
                "document_prefix_tokens": prefix, "prefix_tokens_computed": max(0, prefix - cached_total),
                "finished_s": _round(time.monotonic() - self.started)}

    def finished_question(self, result: Result) -> None:
        self.outcome.answered += 1
        if self.progress:
            self.progress.question(result.stats)

    def finished_document(self, doc: Document, results: list[Result], seconds: float) -> None:
        errors = [r for r in results if r.error]
        for r in errors:
            self.outcome.failed.append((doc, f"question {r.key[1]}: {r.error}"))
        done = [r for r in results if r.answer is not None]
        self.on_document(doc, sorted(done, key=lambda r: r.key[1]))
        if self.progress:
            self.progress.document(doc.id, len(done), seconds, len(errors))
            for r in errors:
                self.progress.message(f"kvstore job: line {doc.line}: document {doc.id!r}, "
                                      f"question {r.key[1]} failed: {r.error}")


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)
