"""The cache-aware job runners: the in-process engine (EngineRunner) or a `kvstore serve` (HttpRunner).

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
While a document runs, a worker thread tokenizes the next one and prefetches its prefix from
cold into warm (store.promote, a few pages per call, never holding the store's lock long).
The progress hears which step a document is at (tokenizing, prefilling, answering); the
in-process runner also samples the store's tier occupancy on a timer (every SAMPLE_S seconds
unless told otherwise).

Per question the stats record how much of the document prefix (its full pages) it computed;
summed over a document's questions and divided by the prefix length, that is how many times
the prefix was prefilled: 1 on a fresh cache, 0 when it came from the cache.

`stop` (a threading.Event, set from a signal handler) ends the run between engine steps:
unfinished questions are aborted and the finished ones are still handed over.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

import blake3

from engine.request import Request, Status
from engine.sampler import InvalidRequest, SamplingParams
from kvstore.errors import KVStoreError
from kvstore.job.io import Document, Key

PROMPT_SUFFIX = "\n\nQuestion: {question}\nAnswer:"
PREFETCH_BATCH_PAGES = 16
PIN_TTL_S = 7 * 24 * 3600   # pins live in this process's store; they are released when a document ends
TIERS = ("hot", "warm", "cold")     # the store's own tiers, sampled for the occupancy plot
SAMPLE_S = 0.5                      # how often the in-process runner samples them


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


class EngineRunner(JobRunner):
    """Runs the job on an in-process engine (engine.LLM), stepping it on the calling thread."""

    def __init__(self, llm, settings: Settings, on_document, progress=None, session: int = 1,
                 prefetch: bool = True, sample_s: float = SAMPLE_S):
        super().__init__(settings, on_document, progress, session, llm.store.spec.page_size)
        self.llm, self.store = llm, llm.store
        self.prefetch = prefetch
        if prefetch:   # a job plans its prefetches from the cold tier's index: let it finish first
            if progress:
                progress.phase("indexing the cold tier")
            self.store.wait_indexed()
        self.sample_s = sample_s
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-job-prefetch")

    def namespace(self, tenant: str):
        return self.store.namespace("" if self.llm.config.engine.share_across_tenants else tenant)

    def pinnable(self, pages: int) -> bool:
        return pages <= self.store.hot.num_pages // 2

    # the worker thread
    def _prepare(self, doc: Document, prefetch: bool) -> Prepared:
        prep = prepare(doc, self.llm.tokenizer)
        if prep.error or not prefetch:
            return prep
        m = self.store.match(prep.doc_ids, self.namespace(doc.tenant))
        done = 0
        for i in range(0, m.num_pages, PREFETCH_BATCH_PAGES):   # the lock is free between batches
            if self.stop.is_set():
                break
            batch = m.keys[i:i + PREFETCH_BATCH_PAGES]
            n = self.store.promote(batch, "warm")
            done += n
            if n < len(batch):
                break
        prep.prefetched_pages = sum(1 for t in m.tiers[:done] if t == "cold")
        below_hot = [k for k, t in zip(m.keys[:done], m.tiers[:done]) if t != "hot"]
        if below_hot and self.pinnable(m.num_pages):
            # kept in warm until the document has run; its pages in hot stay evictable, or the
            # current document's questions could find no room
            prep.pinned = below_hot
            self.store.pin(prep.pinned, PIN_TTL_S)
        return prep

    # the loop
    def run(self, documents: Sequence[Document], done: Callable[[Key], bool]) -> Outcome:
        todo = self.pending(documents, done)
        self.sample()
        stop_sampling = threading.Event()
        sampler = threading.Thread(target=self._sampling, args=(stop_sampling,), name="kvstore-job-sampler",
                                   daemon=True)
        sampler.start()
        try:
            nxt: Future | None = self._worker.submit(self._prepare, todo[0][0], self.prefetch) if todo else None
            for i, (doc, qs) in enumerate(todo):
                if not nxt.done():
                    self.at("tokenizing", doc)
                prep = nxt.result()
                nxt = self._worker.submit(self._prepare, todo[i + 1][0], self.prefetch) if i + 1 < len(todo) else None
                if self.stop.is_set():
                    self.store.unpin(prep.pinned)
                    break
                self.run_document(prep, qs)
            if nxt is not None:
                self.store.unpin(nxt.result().pinned)
        finally:
            self._worker.shutdown(wait=True)
            stop_sampling.set()
            sampler.join()
        self.sample()
        self.outcome.interrupted = self.stop.is_set()
        return self.outcome

    def sample(self) -> None:
        """Append the pages in each tier now to the outcome's samples."""
        tiers = self.store.stats()["tiers"]
        self.outcome.samples.append({"session": self.session, "seconds": _round(time.monotonic() - self.started),
                                     "questions": self.outcome.answered, **{t: tiers[t]["pages"] for t in TIERS}})

    def _sampling(self, stop: threading.Event) -> None:
        """Sample at every multiple of sample_s from now (a late sample does not shift the next ones)."""
        start, k = time.monotonic(), 1
        while not stop.wait(max(0.0, start + k * self.sample_s - time.monotonic())):
            self.sample()
            k = max(k + 1, int((time.monotonic() - start) / self.sample_s) + 1)

    def run_document(self, prep: Prepared, qs: list[int]) -> None:
        doc, started = prep.doc, time.monotonic()
        if prep.error:
            self.finished_document(doc, [Result((doc.id, q), error=prep.error) for q in qs], 0.0)
            return
        results: dict[int, Result] = {}
        live: dict[int, Request] = {}
        pinned = list(prep.pinned)
        queue = list(qs)

        def submit(q: int) -> None:
            try:
                req = self.llm.make_request(prep.doc_ids + prep.suffixes[q], question_params(doc, q, self.settings),
                                            doc.tenant, request_id=f"job-{doc.id}-{q}-s{self.session}")
                self.llm.submit(req)
            except InvalidRequest as exc:
                results[q] = Result((doc.id, q), error=str(exc))
                return
            live[q] = req

        try:
            lead = queue.pop(0)
            self.at("prefilling", doc)
            submit(lead)
            if lead in live:      # the prefix is computed once, by the lead alone
                self._step(doc, prep, live, results, lead,
                           until=lambda: live[lead].first_token_at is not None or live[lead].status is Status.FINISHED)
            self.at("answering", doc)
            m = self.store.match(prep.doc_ids, self.namespace(doc.tenant))
            if m.keys and self.pinnable(m.num_pages) and not self.stop.is_set():
                self.store.pin(m.keys, PIN_TTL_S)
                pinned += m.keys
            limit = max(1, self.llm.config.scheduler.max_queue_depth - 1)
            while (queue or any(r.status is not Status.FINISHED for r in live.values())) and not self.stop.is_set():
                while queue and len(self.llm.scheduler.waiting) + len(self.llm.inbox) < limit:
                    submit(queue.pop(0))
                self._step(doc, prep, live, results, lead, until=None)
            if self.stop.is_set():
                self._abort(live)
        finally:
            if pinned:
                self.store.unpin(pinned)
        self.finished_document(doc, [results[q] for q in qs if q in results], time.monotonic() - started)

    def _step(self, doc, prep, live, results, lead, until) -> None:
        """Step the engine once (until=None), or until `until()` holds or the job is stopped."""
        ids = {r.id: q for q, r in live.items()}
        while True:
            if until is not None and (until() or self.stop.is_set()):
                return
            for req in self.llm.step():
                q = ids.get(req.id)
                if q is None or req.status is not Status.FINISHED or q in results:
                    continue
                results[q] = self._result(doc, q, req, q == lead, prep)
                if results[q].answer is not None:
                    self.finished_question(results[q])
            if until is None:
                return

    def _result(self, doc: Document, q: int, req: Request, lead: bool, prep: Prepared) -> Result:
        out = req.output()
        if out.finish_reason == "abort":
            return Result((doc.id, q), error="the engine could not fit the request in the hot tier")
        stats = self.stats(doc, q, lead, len(out.prompt_token_ids), dict(out.cached_tokens), len(out.token_ids),
                           out.ttft_s, out.latency_s, len(prep.doc_ids))
        if lead:
            stats["prefetched_pages"] = prep.prefetched_pages   # brought from cold to warm ahead of time
        return Result((doc.id, q), self.answer(doc, q, out.text, out.token_ids, out.finish_reason), stats)

    def _abort(self, live: dict[int, Request]) -> None:
        """Abort the unfinished requests and step until the engine let go of their pages."""
        for req in live.values():
            if req.status is not Status.FINISHED:
                self.llm.abort(req.id)
        while any(r.status is not Status.FINISHED for r in live.values()):
            self.llm.step()


class QuestionFailed(KVStoreError):
    """The server refused a question (HTTP 4xx/5xx other than 429)."""


class ServerGone(KVStoreError):
    """The server cannot be reached: the job stops."""


class HttpRunner(JobRunner):
    """Runs the job against a running `kvstore serve` through its OpenAI-compatible completions API:
    prompts as token ids, streamed (TTFT measured by the client), `concurrency` requests at a time.
    The server's own store caches, pins and prefetches; cached tokens come from the usage's
    prompt_tokens_details (a total, not per tier). Its tier occupancy is not sampled: the
    completions API does not report it."""

    def __init__(self, url: str, tokenizer, settings: Settings, on_document, progress=None, session: int = 1,
                 concurrency: int = 4, model: str | None = None, page_size: int = 16, retries: int = 20):
        super().__init__(settings, on_document, progress, session, page_size)
        self.url, self.tokenizer = url.rstrip("/"), tokenizer
        self.concurrency, self.model, self.retries = max(1, concurrency), model, retries

    def run(self, documents: Sequence[Document], done: Callable[[Key], bool]) -> Outcome:
        todo = self.pending(documents, done)
        asyncio.run(self._run(todo))
        self.outcome.interrupted = self.stop.is_set()
        return self.outcome

    async def _run(self, todo) -> None:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for doc, qs in todo:
                if self.stop.is_set():
                    break
                task = asyncio.create_task(self._document(session, doc, qs))
                while not task.done():
                    await asyncio.wait([task], timeout=0.1)
                    if self.stop.is_set() and not task.done():
                        task.cancel()
                        await asyncio.gather(task, return_exceptions=True)
                if not task.cancelled():
                    task.result()   # ServerGone ends the job

    async def _document(self, session, doc: Document, qs: list[int]) -> None:
        started = time.monotonic()
        self.at("tokenizing", doc)
        prep = await asyncio.to_thread(prepare, doc, self.tokenizer)
        if prep.error:
            self.finished_document(doc, [Result((doc.id, q), error=prep.error) for q in qs], 0.0)
            return
        results: dict[int, Result] = {}
        gate = asyncio.Semaphore(self.concurrency)

        async def ask(q: int, lead: bool, first: asyncio.Event | None = None) -> None:
            async with gate:
                try:
                    results[q] = await self._ask(session, doc, prep, q, lead, first)
                except QuestionFailed as exc:
                    results[q] = Result((doc.id, q), error=str(exc))
                finally:
                    if first is not None:
                        first.set()
            if results[q].answer is not None:
                self.finished_question(results[q])

        tasks = []
        try:
            first = asyncio.Event()
            self.at("prefilling", doc)
            tasks.append(asyncio.create_task(ask(qs[0], True, first)))
            await first.wait()     # the lead's first token: the prefix is cached on the server
            self.at("answering", doc)
            tasks += [asyncio.create_task(ask(q, False)) for q in qs[1:]]
            await asyncio.gather(*tasks)
        finally:   # also when cancelled (stop): hand over what finished
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.finished_document(doc, [results[q] for q in qs if q in results], time.monotonic() - started)

    async def _ask(self, session, doc: Document, prep: Prepared, q: int, lead: bool,
                   first: asyncio.Event | None) -> Result:
        import aiohttp

        params = question_params(doc, q, self.settings)
        prompt = prep.doc_ids + prep.suffixes[q]
        body = {"prompt": prompt, "max_tokens": params.max_tokens, "temperature": params.temperature,
                "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
        if params.seed is not None:
            body["seed"] = params.seed
        if self.model:
            body["model"] = self.model
        headers = {"X-Tenant": doc.tenant} if doc.tenant else {}
        for attempt in range(self.retries + 1):
            t0 = time.monotonic()
            ttft, text, ids, finish, usage = None, "", [], None, None
            try:
                async with session.post(self.url + "/v1/completions", json=body, headers=headers) as r:
                    if r.status == 429 and attempt < self.retries:
                        await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
                        continue
                    if r.status != 200:
                        raise QuestionFailed(f"HTTP {r.status}: {await _error_message(r)}")
                    async for raw in r.content:
                        line = raw.decode().strip()
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            break
                        chunk = json.loads(line[len("data: "):])
                        if "error" in chunk:
                            raise QuestionFailed(chunk["error"].get("message", "server error"))
                        for c in chunk.get("choices") or []:
                            if ttft is None:
                                ttft = time.monotonic() - t0
                                if first is not None:
                                    first.set()
                            text += c.get("text", "")
                            ids += c.get("token_ids") or []
                            finish = c.get("finish_reason") or finish
                        usage = chunk.get("usage") or usage
            except aiohttp.ClientConnectionError as exc:
                raise ServerGone(f"cannot reach {self.url} ({exc})") from None
            if finish is None:
                raise QuestionFailed("the response stream ended before the answer did")
            break
        seconds = time.monotonic() - t0
        prompt_tokens = (usage or {}).get("prompt_tokens", len(prompt))
        cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        stats = self.stats(doc, q, lead, prompt_tokens, {"total": cached}, len(ids), ttft, seconds,
                           len(prep.doc_ids))
        return Result((doc.id, q), self.answer(doc, q, text, ids, finish), stats)


async def _error_message(r) -> str:
    try:
        return (await r.json())["error"]["message"]
    except Exception:  # noqa: BLE001 - any non-OpenAI error body
        return (await r.text())[:200]


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)
