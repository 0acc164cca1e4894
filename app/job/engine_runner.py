"""EngineRunner: the job on an in-process engine (engine.LLM), stepped on the calling thread.

While a document runs, a worker thread tokenizes the next one and prefetches its prefix from
cold into warm (store.promote, a few pages per call, never holding the store's lock long).
The runner also samples the store's tier occupancy on a timer (every SAMPLE_S seconds unless
told otherwise).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

from engine.request import Request, Status
from engine.sampler import InvalidRequest
from app.job.io import Document, Key
from app.job.runner import (JobRunner, Outcome, Prepared, Result, Settings, _round, prepare,
                            question_params)

PREFETCH_BATCH_PAGES = 16
PIN_TTL_S = 7 * 24 * 3600   # pins live in this process's store; they are released when a document ends
TIERS = ("hot", "warm", "cold")     # the store's own tiers, sampled for the occupancy plot
SAMPLE_S = 0.5                      # how often the in-process runner samples them


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
        return self.llm.namespace(tenant)

    def pinnable(self, pages: int) -> bool:
        return pages <= self.store.hot.num_pages // 2

    # the worker thread
    def _prepare(self, doc: Document, prefetch: bool) -> Prepared:
        prep = prepare(doc, self.llm.tokenizer)
        if not prep.error and self.store.remote is not None:   # what the remote tier holds beyond the cache, to warm
            self.store.fetch_remote(prep.doc_ids, self.namespace(doc.tenant))
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
        pages = self.store.tier_pages()   # counts, not store.stats(): that walks every page under the lock
        self.outcome.samples.append({"session": self.session, "seconds": _round(time.monotonic() - self.started),
                                     "questions": self.outcome.answered, **{t: pages[t] for t in TIERS}})

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
                while queue and self.llm.scheduler.depth < limit:
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
