"""The dashboard's history: samples are rates between readings of a real store and Metrics, the
ring buffer keeps at most `size`, and GET /v1/history serves it from a sampler that runs with the
admin app."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvstore.server.history import HISTORY, History, histogram_quantile
from kvstore.server.metrics import Metrics
from storeutil import SPEC, fill_and_commit, make_store, settle, tokens_for
from test_admin import TOKEN, running_admin


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_samples_are_rates_between_readings(tmp_path):
    store = make_store(tmp_path, hot=8)
    try:
        metrics, clock = Metrics(store), Clock()
        history = History(store, None, metrics, size=3, clock=clock)
        assert history.record(history.read()) is None and not history.samples   # the first reading is a baseline

        metrics.observe_request(0.02, 0.3, True, prompt_tokens=100, generation_tokens=8,
                                cached_tokens={"hot": 48, "warm": 16, "cold": 0, "peer": 0})
        metrics.observe_request(0.08, 0.5, True, prompt_tokens=60, generation_tokens=4,
                                cached_tokens={"hot": 0, "warm": 0, "cold": 32, "peer": 16})
        slots, keys = fill_and_commit(store, store.namespace(), tokens_for(1, 4))
        store.release(slots)
        settle(store)   # 4 pages down to cold: written behind at commit
        clock.now += 2
        s = history.record(history.read())
        assert s["elapsed_s"] == 2 and s["requests_per_s"] == 1.0
        assert s["prompt_tokens_per_s"] == 80 and s["generation_tokens_per_s"] == 6
        assert s["hit_rate"] == {"hot": 48 / 160, "warm": 16 / 160, "cold": 32 / 160, "remote": 0.0, "peer": 16 / 160}
        assert s["ttft_p50_s"] == pytest.approx(0.025) and s["ttft_p99_s"] == pytest.approx(0.099)
        assert s["occupancy"]["hot"] == 0.5 and s["occupancy"]["warm"] == 0
        assert s["bytes_moved_per_s"] == {"up": 0, "down": 4 * SPEC.page_bytes / 2}
        assert (s["queue_depth"], s["running"]) == (0, 0)

        store.evict(keys, "warm")   # 4 pages down
        clock.now += 4
        s = history.record(history.read())
        assert s["elapsed_s"] == 4 and s["requests_per_s"] == 0 and s["prompt_tokens_per_s"] == 0
        assert s["hit_rate"] == dict.fromkeys(("hot", "warm", "cold", "remote", "peer"))   # no requests: no rate
        assert s["ttft_p50_s"] is None and s["ttft_p99_s"] is None
        assert s["bytes_moved_per_s"] == {"up": 0, "down": 4 * SPEC.page_bytes / 4}
        assert s["occupancy"]["hot"] == 0 and s["occupancy"]["warm"] == 0.5

        store.promote(keys, "hot")   # 4 pages up
        clock.now += 1
        s = history.record(history.read())
        assert s["bytes_moved_per_s"] == {"up": 4 * SPEC.page_bytes, "down": 0}
        assert len(history.samples) == 3
        for _ in range(4):
            clock.now += 1
            history.record(history.read())
        assert len(history.samples) == 3   # the oldest went
        assert [x["elapsed_s"] for x in history.samples] == [1, 1, 1]
    finally:
        store.close()


def test_histogram_quantile_interpolates_like_promql():
    buckets = [(0.1, 2.0), (0.5, 6.0), (1.0, 8.0), (float("inf"), 10.0)]
    assert histogram_quantile(0.1, buckets) == pytest.approx(0.05)          # rank 1 of 2 in (0, 0.1]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 3 / 4)
    assert histogram_quantile(0.99, buckets) == 1.0                          # in +Inf: the highest finite bound
    assert histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None


async def sample_every(app, interval_s: float) -> History:
    """Restart the app's sampler with a shorter interval (the baseline it took at start is kept)."""
    history = app[HISTORY]
    await history.stop()
    history.interval_s = interval_s
    history.start()
    return history


async def wait_for_samples(admin, n: int, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        status, body = await admin.get("/v1/history")
        assert status == 200
        if len(body["samples"]) >= n or time.monotonic() > deadline:
            return body
        await asyncio.sleep(0.05)


async def test_history_endpoint_serves_the_sampler(tmp_path, monkeypatch):
    async with running_admin(tmp_path, token=TOKEN) as admin:
        made = []
        namespace = type(admin.store).namespace
        monkeypatch.setattr(type(admin.store), "namespace", lambda self, *a: made.append(a) or namespace(self, *a))
        assert (await admin.get("/v1/history", token=""))[0] == 401
        history = await sample_every(admin.app, 0.05)
        body = await wait_for_samples(admin, 3)   # the answers are checked against /openapi.json too
        assert body["size"] == 300 and len(body["samples"]) >= 3 and body["interval_s"] == 0.05
        assert body["watermarks"]["hot"] == {"low": admin.config.hot.low_watermark,
                                             "high": admin.config.hot.high_watermark}
        server = body["server"]
        assert server["model"] is None and server["uptime_s"] > 0 and server["version"]
        for _ in range(3):
            assert (await admin.get("/v1/history"))[0] == 200
        assert len(made) <= 1   # the default namespace is hashed at the first GET, not at every one
        assert server["default_namespace"] == admin.store.namespace().digest.hex()
        ts = [s["t"] for s in body["samples"]]
        assert ts == sorted(ts) and ts[-1] <= time.time()
        assert body["samples"][-1]["occupancy"]["hot"] == 0.5   # the populated store: 4 of 8 hot pages
        await history.stop()
        kept = len(history.samples)
        await asyncio.sleep(0.3)
        assert len(history.samples) == kept   # stopped
    assert admin.checked >= 2
