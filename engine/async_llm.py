"""AsyncLLM: LLM.step() in a background thread, each request streaming its outputs to an asyncio queue."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import AsyncIterator, Awaitable, Callable

from engine.llm import LLM
from engine.request import RequestOutput, Status, StepFailed
from engine.sampler import SamplingParams

log = logging.getLogger("kvstore.engine")


class AsyncLLM:
    """Runs LLM.step() in a background thread; each request streams its outputs to an asyncio queue.

    Hooks: `on_finish(output)` is called (in the engine thread) for every finished request, before
    its final output reaches its caller;
    `prefetch(tokens, namespace) -> (local_pages, {source: pages})` is awaited before a request
    is queued (fetching the pages beyond its cached prefix from the remote tier, then a peer
    instance: kvstore.cluster.node.make_prefetch)."""

    def __init__(self, llm: LLM, on_finish: Callable[[RequestOutput], None] | None = None,
                 prefetch: Callable[..., Awaitable[tuple[int, dict[str, int]]]] | None = None):
        self.llm = llm
        self.on_finish, self.prefetch = on_finish, prefetch
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    async def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kvstore-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread:
            await asyncio.to_thread(self._thread.join)

    def _loop(self) -> None:
        while not self._stop:
            if not self.llm.has_work():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                changed = self.llm.step()
            except BaseException as exc:  # noqa: BLE001 - reported to every waiter, loop stops
                self.error = exc
                for loop, q in list(self._queues.values()):
                    loop.call_soon_threadsafe(q.put_nowait, exc)
                return
            for req in changed:
                out = req.output()
                # the hook first: a client that has its answer finds it counted (metrics)
                if out.finish_reason is not None and self.on_finish is not None:
                    try:
                        self.on_finish(out)
                    except Exception:  # noqa: BLE001 - a hook's failure must not stop the engine
                        log.exception("on_finish hook failed")
                entry = self._queues.get(req.id)
                if entry:
                    entry[0].call_soon_threadsafe(entry[1].put_nowait, out)

    async def generate(self, prompt, params: SamplingParams, tenant: str = "", request_id: str | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        if self.error is not None:
            raise RuntimeError("the engine stopped after an internal error") from self.error
        req = self.llm.make_request(prompt, params, tenant, request_id, priority)
        if self.prefetch is not None:
            start, fetched = await self.prefetch(req.tokens, req.namespace)
            for source, n in fetched.items():
                req.fetched_pages[source] = range(start, start + n)
                start += n
        q: asyncio.Queue = asyncio.Queue()
        self._queues[req.id] = (asyncio.get_running_loop(), q)
        try:
            self.llm.submit(req)
            self._wake.set()
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise RuntimeError("the engine stopped after an internal error") from item
                if item.finish_reason == "error":
                    raise StepFailed(item.error or "internal error in the engine step")
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if self._queues.pop(req.id, None) is not None and req.status is not Status.FINISHED:
                self.llm.abort(req.id)   # the caller went away: free its pages
                self._wake.set()
