"""The dashboard's recent past: a sampler that keeps the last few minutes of the server's rates.

Every interval_s (2 s) the sampler reads the tiers' occupancy and the bytes they moved (one
snapshot of the store, in a daemon worker thread), the engine's queue and the Metrics counters, and appends
one sample, computed from the deltas since the previous reading, to a ring buffer of `size` (300:
ten minutes). GET /v1/history serves the buffer as JSON:

    {"interval_s": 2.0, "size": 300,
     "server": {"model", "instance", "version", "uptime_s", "default_namespace"},
     "watermarks": {tier: {"low": f, "high": f}},
     "samples": [{"t": unix time, "elapsed_s": s,
                  "occupancy": {tier: used / capacity or null},
                  "hit_rate": {hot|warm|cold|peer: cached prompt tokens from the tier / prompt tokens, null
                               without requests},
                  "requests_per_s", "prompt_tokens_per_s", "generation_tokens_per_s",
                  "ttft_p50_s", "ttft_p99_s" (null without requests),
                  "bytes_moved_per_s": {"up": b, "down": b}, "queue_depth": n, "running": n}, ...]}

Occupancy comes from the tiers' byte counters, not store.stats(), which walks every page.
The sampler starts and stops with the admin app (its on_startup and on_cleanup), so every server
that creates one (`kvstore serve`, `kvstore sidecar`) keeps a history.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web

from kvstore import __version__
from kvstore.cluster.node import CLUSTER
from kvstore.server.metrics import CACHE_TIERS, TIERS, Metrics, engine_stats

log = logging.getLogger("kvstore.history")

INTERVAL_S = 2.0
SIZE = 300
UP = ("warm_to_hot", "cold_to_warm", "cold_to_hot", "peer_to_warm")   # other directions are down


@dataclass(frozen=True)
class Reading:
    """The cumulative counters at one moment."""

    at: float                        # monotonic seconds
    wall: float                      # unix time
    used: dict[str, tuple[int, int]]   # tier -> (used bytes, capacity bytes)
    moved: dict[str, int]            # direction -> bytes moved since the start
    queue: dict                      # the engine's stats (empty without an engine)
    totals: dict                     # Metrics.totals()


def tier_usage(store) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """(tier -> (used, capacity bytes), direction -> bytes moved): counters only, from one snapshot."""
    snap = store.snapshot()
    return dict(snap.tiers), dict(snap.bytes_moved)


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """As PromQL's: `buckets` are (upper bound, cumulative count) ending with +Inf; linear within a
    bucket; the highest finite bound when the rank falls in +Inf; None without observations."""
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below)   # below < rank <= count
        lower, below = bound, count
    return lower


def _round(x: float | None, digits: int = 6) -> float | None:
    return None if x is None else round(x, digits)


def sample(prev: Reading, now: Reading) -> dict:
    """The rates between two readings."""
    dt = max(now.at - prev.at, 1e-9)
    a, b = prev.totals, now.totals

    def per_s(key: str) -> float:
        return _round(max(0.0, b[key] - a[key]) / dt, 3)

    queries = b["prefix_cache_queries"] - a["prefix_cache_queries"]
    hits = {t: b["prefix_cache_hits"].get(t, 0) - a["prefix_cache_hits"].get(t, 0) for t in CACHE_TIERS}
    ttft = [(bound, count - before) for (bound, count), (_, before) in zip(b["ttft_buckets"], a["ttft_buckets"])]
    moved = {d: n - prev.moved.get(d, 0) for d, n in now.moved.items()}
    return {"t": round(now.wall, 3), "elapsed_s": round(dt, 3),
            "occupancy": {t: _round(used / cap) if cap else None for t, (used, cap) in now.used.items()},
            "hit_rate": {t: _round(hits[t] / queries) if queries > 0 else None for t in CACHE_TIERS},
            "requests_per_s": per_s("requests"), "prompt_tokens_per_s": per_s("prompt_tokens"),
            "generation_tokens_per_s": per_s("generation_tokens"),
            "ttft_p50_s": _round(histogram_quantile(0.5, ttft)), "ttft_p99_s": _round(histogram_quantile(0.99, ttft)),
            "bytes_moved_per_s": {"up": _round(sum(n for d, n in moved.items() if d in UP) / dt, 1),
                                  "down": _round(sum(n for d, n in moved.items() if d not in UP) / dt, 1)},
            "queue_depth": now.queue.get("waiting", 0), "running": now.queue.get("running", 0)}


class History:
    """A ring buffer of samples, one per interval_s, at most `size`.

    read() takes a snapshot of the store (a worker thread); record() and the buffer belong to the
    event loop. The first reading is only a baseline: samples start one interval after start().
    """

    def __init__(self, store, daemon, metrics: Metrics, engine: Any = None, interval_s: float = INTERVAL_S,
                 size: int = SIZE, clock: Callable[[], float] = time.monotonic):
        self.store, self.daemon, self.metrics, self.engine = store, daemon, metrics, engine
        self.interval_s, self.clock = interval_s, clock
        self.samples: deque[dict] = deque(maxlen=size)
        self._last: Reading | None = None
        self._task: asyncio.Task | None = None

    def read(self) -> Reading:
        used, moved = tier_usage(self.store)
        return Reading(self.clock(), time.time(), used, moved, engine_stats(self.engine) or {}, self.metrics.totals())

    def record(self, now: Reading) -> dict | None:
        """Append the sample since the previous reading (none for the first) and keep `now`."""
        new = sample(self._last, now) if self._last is not None else None
        if new is not None:
            self.samples.append(new)
        self._last = now
        return new

    async def _run(self) -> None:
        while True:
            try:
                self.record(await self.daemon.run(self.read))
            except Exception as exc:  # noqa: BLE001 - the next round tries again
                log.warning("history: reading the store failed (%s)", type(exc).__name__)
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kvstore-history")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


HISTORY = web.AppKey("kvstore.history", History)


def add_history(app: web.Application, state) -> History:
    """GET /v1/history over `state` (the admin app's AdminState), and a sampler that runs while the
    app does: app[HISTORY]; set its interval_s before the app starts to sample faster."""
    config = state.config
    history = History(state.store, state.daemon, state.metrics, state.engine,
                      interval_s=config.admin.history_interval_s, size=config.admin.history_samples)
    app[HISTORY] = history
    default_namespace: list[str] = []   # fixed for the store's life: hashed at the first GET only

    async def serve(request: web.Request) -> web.Response:
        if not default_namespace:
            default_namespace.append(state.store.namespace("").digest.hex())
        cluster = request.app.get(CLUSTER)
        instance = cluster.index.id if cluster is not None else config.cluster.instance_id or socket.gethostname()
        server = {"model": state.model_name, "instance": instance,
                  "version": __version__, "uptime_s": round(time.monotonic() - state.started, 3),
                  "default_namespace": default_namespace[0]}
        watermarks = {t: {"low": getattr(config, t).low_watermark, "high": getattr(config, t).high_watermark}
                      for t in TIERS}
        return web.json_response({"interval_s": history.interval_s, "size": history.samples.maxlen,
                                  "server": server, "watermarks": watermarks, "samples": list(history.samples)})

    async def start(app: web.Application) -> None:
        history.start()

    async def stop(app: web.Application) -> None:
        await history.stop()

    app.router.add_get("/v1/history", serve)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return history
