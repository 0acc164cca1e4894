"""HttpRunner: the job against a running `kvstore serve` through its OpenAI-compatible completions
API. A question the server refuses fails alone (QuestionFailed); a server that cannot be reached
ends the job (ServerGone).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Callable, Sequence

from kvstore.errors import KVStoreError
from app.job.io import Document, Key
from app.job.runner import JobRunner, Outcome, Prepared, Result, Settings, prepare, question_params

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

