"""Daemon: the store's background work as asyncio tasks, and the async door to the store.

- watermarks: every `daemon.interval_s` (or when woken), tiers above their high watermark are
  brought down to their low watermark (hot -> warm -> cold -> out), and under `write_through`
  committed pages are copied down so that evicting them later is only a free;
- prefetch: a queue of prefix chains to bring up (cold -> warm, or -> hot), under the
  `best_effort`, `wait` or `timeout` policy;
- allocation that waits (bounded) for released pages instead of failing at once.

Every store call runs in the daemon's worker threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from kvstore.errors import KVStoreError, OutOfCapacity
from kvstore.store import Match, TieredStore

log = logging.getLogger("kvstore.daemon")


class Daemon:
    def __init__(self, store: TieredStore, workers: int = 4):
        self.store = store
        self.config = store.config
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvstore")
        self._tasks: list[asyncio.Task] = []
        self._wake = asyncio.Event()
        self._prefetch_q: asyncio.Queue = asyncio.Queue()
        self.errors = 0

    async def run(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run a store method in a worker thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    # lifecycle
    async def start(self) -> "Daemon":
        self._tasks = [asyncio.create_task(self._watermarks(), name="kvstore-watermarks"),
                       asyncio.create_task(self._prefetcher(), name="kvstore-prefetch")]
        return self

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []
        self._pool.shutdown(wait=True)

    async def __aenter__(self) -> "Daemon":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def wake(self) -> None:
        self._wake.set()

    async def _watermarks(self) -> None:
        while True:
            try:
                await self.run(self.store.rebalance)
                if self.config.write_policy == "write_through" and self.store.write_through_pending:
                    await self.run(self.store.write_through)
            except KVStoreError as exc:  # keep the daemon alive; the next round retries
                self.errors += 1
                log.warning("rebalance failed: %s", exc)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.daemon.interval_s)
            self._wake.clear()

    async def _prefetcher(self) -> None:
        while True:
            keys, to, fut = await self._prefetch_q.get()
            try:
                done = await self.run(self.store.promote, keys, to)
                if not fut.done():
                    fut.set_result(done)
            except Exception as exc:  # noqa: BLE001 - handed to the waiter
                if not fut.done():
                    fut.set_exception(exc)

    # the async door
    async def match(self, tokens: Sequence[int], namespace) -> Match:
        return await self.run(self.store.match, tokens, namespace)

    async def acquire(self, keys: Sequence[bytes]) -> list[int]:
        """Hot slots of a cached chain; its cold pages are loaded first (store.acquire never reads disk)."""
        await self.run(self.store.promote, keys, "warm")
        return await self.run(self.store.acquire, keys)

    async def release(self, slots: Sequence[int]) -> None:
        await self.run(self.store.release, slots)

    async def commit(self, namespace, tokens: Sequence[int], slots: Sequence[int]) -> list[bytes]:
        keys = await self.run(self.store.commit, namespace, tokens, slots)
        if self.config.write_policy == "write_through":
            self.wake()
        return keys

    async def allocate(self, n: int, timeout: float | None = None) -> list[int]:
        """n hot slots; waits up to `timeout` (hot.allocate_timeout_s) for releases, then raises OutOfCapacity."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.config.hot.allocate_timeout_s if timeout is None else timeout)
        while True:
            released = asyncio.Event()
            self.store.on_release(functools.partial(_set_threadsafe, loop, released))
            try:
                return await self.run(self.store.allocate, n)
            except OutOfCapacity:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise
                self.wake()
                try:
                    await asyncio.wait_for(released.wait(), remaining)
                except asyncio.TimeoutError:
                    raise OutOfCapacity(f"out of KV capacity: no {n} hot pages became free within "
                                        f"{self.config.hot.allocate_timeout_s if timeout is None else timeout} s") from None

    async def prefetch(self, keys: Sequence[bytes], to: str = "hot", policy: str | None = None,
                       timeout: float | None = None) -> int | None:
        """Queue a prefix chain to bring up to `to`. best_effort: return None at once; wait: the
        number of pages brought up; timeout: that number, or None if not done within the bound."""
        policy = policy or self.config.prefetch.policy
        fut = asyncio.get_running_loop().create_future()
        self._prefetch_q.put_nowait((list(keys), to, fut))
        if policy == "best_effort":
            return None
        if policy == "wait":
            return await fut
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.config.prefetch.timeout_s
                                          if timeout is None else timeout)
        except asyncio.TimeoutError:
            return None


def _set_threadsafe(loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
    with contextlib.suppress(RuntimeError):  # the loop may be closed already
        loop.call_soon_threadsafe(event.set)
