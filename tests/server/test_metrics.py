"""/metrics: the Prometheus text format, the kvstore_ families, values equal to /v1/stats, token
counters fed by `kvstore serve`'s engine. The alert rules and the Grafana dashboard over them are in
test_metrics_rules."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import time

import aiohttp
import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.placement.index import CACHE_TIERS
from kvstore.server.admin import STATE
from kvstore.server.metrics import Metrics
from conftest import clean_env
from storeutil import QUIET, fill_and_commit, make_store, settle, stall_writes, tokens_for
from test_admin import TOKEN, running_admin

FAMILIES = {  # name as the parser reports it -> type
    "kvstore_tier_capacity_bytes": "gauge", "kvstore_tier_used_bytes": "gauge", "kvstore_tier_pages": "gauge",
    "kvstore_tier_hits": "counter", "kvstore_tier_misses": "counter", "kvstore_tier_evictions": "counter",
    "kvstore_tier_promotions": "counter", "kvstore_bytes_moved": "counter", "kvstore_corrupt_pages": "counter",
    "kvstore_queue_depth": "gauge", "kvstore_running_requests": "gauge", "kvstore_prefetch_seconds": "histogram",
    "kvstore_request_latency_seconds": "histogram", "kvstore_ttft_seconds": "histogram",
    "kvstore_requests": "counter", "kvstore_dropped_pages": "counter", "kvstore_cold_write_errors": "counter",
    "kvstore_cold_index_done": "gauge", "kvstore_loading_requests": "gauge",
    "kvstore_prompt_tokens": "counter", "kvstore_generation_tokens": "counter",
    "kvstore_prefix_cache_queries": "counter", "kvstore_prefix_cache_hits": "counter",
    "kvstore_write_behind_dirty_pages": "gauge", "kvstore_write_behind_max_dirty_pages": "gauge",
    "kvstore_write_behind_lag_seconds": "gauge", "kvstore_write_behind_written_pages": "counter",
    "kvstore_write_behind_batches": "counter", "kvstore_write_behind_stranded_pages": "gauge",
    "kvstore_backpressure_waits": "counter", "kvstore_backpressure_wait_seconds": "counter",
    "kvstore_backpressure_refused_pages": "counter",
    "kvstore_gc_collections": "counter", "kvstore_gc_pause_seconds": "counter",
    "kvstore_gc_longest_pause_seconds": "gauge", "kvstore_gc_frozen_objects": "gauge",
}
DROP_REASONS = ("no_cold_tier", "cold_full", "write_error")
WRITE_BEHIND = {  # sample -> store.stats()["write_behind"] field
    "kvstore_write_behind_dirty_pages": "dirty_pages", "kvstore_write_behind_max_dirty_pages": "max_dirty_pages",
    "kvstore_write_behind_lag_seconds": "lag_s", "kvstore_write_behind_written_pages_total": "written_pages",
    "kvstore_write_behind_batches_total": "write_batches", "kvstore_write_behind_stranded_pages": "stranded_pages",
    "kvstore_backpressure_waits_total": "backpressure_waits",
    "kvstore_backpressure_wait_seconds_total": "backpressure_wait_s",
    "kvstore_backpressure_refused_pages_total": "refused_pages",
}


def parse(text: str) -> dict[str, dict[tuple, float]]:
    """{sample name: {label items: value}} of a /metrics answer; checks the families' names and types."""
    assert "_created" not in text   # no creation-time series next to the counters and histograms
    samples: dict[str, dict[tuple, float]] = {}
    families = list(text_string_to_metric_families(text))
    types = {f.name: f.type for f in families}
    for name, kind in FAMILIES.items():
        assert types.get(name) == kind, name
    for family in families:
        assert family.name.startswith("kvstore_") and family.documentation
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


async def scrape(admin) -> dict[str, dict[tuple, float]]:
    """{sample name: {label items: value}}"""
    status, text, headers = await admin.request("GET", "/metrics")
    assert status == 200 and headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    return parse(text)


def tier(samples, name: str, t: str) -> float:
    return samples[name][(("tier", t),)]


def drops(samples) -> dict[str, float]:
    return {dict(k)["reason"]: v for k, v in samples["kvstore_dropped_pages_total"].items()}


def read_together(store) -> tuple[dict, dict]:
    """(the samples of /metrics, store.stats()) read under the store's lock, so that they agree. The
    write-behind lag, the one value that moves with the clock, is checked here: the rendered lag lies
    between the lags stats() gives just before and just after the render (to the 0.01 s it is rounded to)."""
    with store.core.lock:
        before = store.stats()["write_behind"]["lag_s"]
        samples = parse(Metrics(store).render().decode())
        stats = store.stats()
    assert before - 0.01 <= samples["kvstore_write_behind_lag_seconds"][()] <= stats["write_behind"]["lag_s"] + 0.01
    return samples, stats


def check_write_behind(samples, stats) -> dict:
    """Every write-behind and backpressure family equals store.stats(), every drop reason is
    present and they add up to dropped_pages; returns the write-behind stats."""
    wb = stats["write_behind"]
    for name, field in WRITE_BEHIND.items():
        if field != "lag_s":   # the lag: checked by read_together, against stats() read on either side
            assert samples[name][()] == pytest.approx(wb[field], abs=0.01), name
    assert drops(samples) == stats["dropped_by_reason"] and set(drops(samples)) == set(DROP_REASONS)
    assert sum(drops(samples).values()) == stats["dropped_pages"]
    return wb


async def test_metrics_match_stats(tmp_path):
    async with running_admin(tmp_path, token=TOKEN) as admin:
        # move things around first, so that every counter has something to show
        await admin.post("/v1/lookup", {"tokens": [1] * 40})
        await admin.post("/v1/flush", {"tier": "hot"})
        samples = await scrape(admin)
        _, stats = await admin.get("/v1/stats")
        for t in ("hot", "warm", "cold"):
            ts = stats["tiers"][t]
            assert tier(samples, "kvstore_tier_capacity_bytes", t) == ts["capacity_bytes"] > 0
            assert tier(samples, "kvstore_tier_used_bytes", t) == ts["used_bytes"]
            assert tier(samples, "kvstore_tier_pages", t) == ts["pages"]
            assert tier(samples, "kvstore_tier_pinned_pages", t) == ts["pinned_pages"]
            assert tier(samples, "kvstore_tier_high_watermark", t) == ts["high_watermark"]
            for field in ("hits", "misses", "evictions", "promotions"):
                assert tier(samples, f"kvstore_tier_{field}_total", t) == ts[field], (t, field)
        assert tier(samples, "kvstore_tier_pages", "warm") == 5 and tier(samples, "kvstore_tier_pages", "hot") == 0
        assert tier(samples, "kvstore_tier_evictions_total", "hot") == stats["tiers"]["hot"]["evictions"] > 0
        moved = {dict(k)["direction"]: v for k, v in samples["kvstore_bytes_moved_total"].items()}
        assert moved == stats["bytes_moved"] and moved["hot_to_warm"] > 0
        assert samples["kvstore_corrupt_pages_total"][()] == stats["corrupt_pages"] == 0
        assert samples["kvstore_mismatched_pages_total"][()] == stats["mismatched_pages"]
        assert samples["kvstore_index_entries"][()] == stats["entries"] == 7
        assert drops(samples) == dict.fromkeys(DROP_REASONS, 0) == stats["dropped_by_reason"]
        assert samples["kvstore_write_behind_written_pages_total"][()] == stats["write_behind"]["written_pages"] == 7
        assert samples["kvstore_write_behind_dirty_pages"][()] == stats["write_behind"]["dirty_pages"] == 0
        assert samples["kvstore_queue_depth"][()] == stats["queue_depth"] == 0
        assert samples["kvstore_running_requests"][()] == stats["running"] == 0
        assert samples["kvstore_requests_total"] == {(("status", "ok"),): 0, (("status", "error"),): 0}
        for name in ("kvstore_prompt_tokens_total", "kvstore_generation_tokens_total",
                     "kvstore_prefix_cache_queries_total"):
            assert samples[name] == {(): 0}, name
        # every tier's series exists from the start, so sums and ratios over tiers are defined
        assert samples["kvstore_prefix_cache_hits_total"] == {(("tier", t),): 0 for t in CACHE_TIERS}


def test_write_behind_and_backpressure_match_stats(tmp_path):
    """A disk that stalls: dirty pages reach their bound (half the warm tier) and age, a producer
    waits and stores nothing; once the disk moves, the pages are written."""
    store = make_store(tmp_path, warm=8, **{"daemon.backpressure_timeout_s": 0.3})
    gate = stall_writes(store)
    try:
        store.commit_warm(store.namespace(), tokens_for(1, 4), store.allocate_warm(4))
        assert store.allocate_warm(2, partial=True) == []   # waited its bound, then refused both pages
        time.sleep(0.05)
        wb = check_write_behind(*read_together(store))
        assert wb["dirty_pages"] == wb["max_dirty_pages"] == 4 and wb["lag_s"] > 0.3
        assert (wb["backpressure_waits"], wb["refused_pages"]) == (1, 2) and wb["backpressure_wait_s"] >= 0.3
        assert wb["written_pages"] == 0
        gate.set()
        settle(store)
        samples, stats = read_together(store)
        wb = check_write_behind(samples, stats)
        assert (wb["dirty_pages"], wb["lag_s"], wb["written_pages"]) == (0, 0, 4) and wb["write_batches"] >= 1
        assert samples["kvstore_write_behind_lag_seconds"][()] == 0
    finally:
        gate.set()
        store.close(persist=False)


def fill(store, docs: range, pages: int = 2) -> None:
    """Commit and release `docs` documents of `pages` pages each, giving the writer a moment each."""
    for doc in docs:
        slots, _ = fill_and_commit(store, store.namespace(), tokens_for(doc, pages))
        store.release(slots)
        store.daemon.wait_progress(0.2)


def test_drops_are_counted_by_reason(tmp_path):
    # no cold tier: memory's victims leave the store
    store = make_store(tmp_path / "a", hot=4, warm=4, **{**QUIET, "cold.enabled": "false"})
    try:
        fill(store, range(6))   # 12 pages, room for 8
        samples, stats = read_together(store)
        wb = check_write_behind(samples, stats)
        assert drops(samples)["no_cold_tier"] > 0 and drops(samples)["cold_full"] == drops(samples)["write_error"] == 0
        assert wb["max_dirty_pages"] == wb["dirty_pages"] == wb["written_pages"] == 0
    finally:
        store.close(persist=False)
    # cold at its limit with pinned pages only: it cannot evict for new ones, which strand and drop
    store = make_store(tmp_path / "b", hot=4, warm=4, cold=2)
    try:
        slots, keys = fill_and_commit(store, store.namespace(), tokens_for(0, 2))
        store.release(slots)
        settle(store)
        assert store.pin(keys, 600) == 2
        fill(store, range(1, 5))
        samples, stats = read_together(store)
        wb = check_write_behind(samples, stats)
        assert wb["stranded_pages"] > 0 and stats["dropped_by_reason"]["cold_full"] > 0
        assert drops(samples)["no_cold_tier"] == drops(samples)["write_error"] == 0
    finally:
        store.close(persist=False)
    # a disk that fails every write: pages strand after a few tries, then drop
    store = make_store(tmp_path / "c", hot=4, warm=4)
    store.mover.write = lambda plan: (_ for _ in ()).throw(OSError("I/O error"))
    try:
        fill(store, range(6))
        samples, stats = read_together(store)
        check_write_behind(samples, stats)
        assert stats["dropped_by_reason"]["write_error"] > 0 and stats["write_behind"]["written_pages"] == 0
        assert drops(samples)["no_cold_tier"] == drops(samples)["cold_full"] == 0
    finally:
        store.close(persist=False)


async def test_histograms_are_fed_by_calls(tmp_path):
    async with running_admin(tmp_path) as admin:
        metrics = admin.app[STATE].metrics
        metrics.observe_request(ttft_s=0.02, latency_s=0.3, ok=True, prompt_tokens=100, generation_tokens=8,
                                cached_tokens={"hot": 64, "warm": 16, "cold": 0, "peer": 0})
        metrics.observe_request(ttft_s=0.08, latency_s=1.7, ok=True, prompt_tokens=40, generation_tokens=3,
                                cached_tokens={"hot": 0, "warm": 0, "cold": 16, "peer": 16})
        metrics.observe_request(ttft_s=None, latency_s=0.01, ok=False, prompt_tokens=7)
        metrics.observe_prefetch(0.004)
        samples = await scrape(admin)
        assert samples["kvstore_requests_total"] == {(("status", "ok"),): 2, (("status", "error"),): 1}
        assert samples["kvstore_request_latency_seconds_count"][()] == 3
        assert samples["kvstore_request_latency_seconds_sum"][()] == pytest.approx(2.01)
        assert samples["kvstore_request_latency_seconds_bucket"][(("le", "0.5"),)] == 2
        assert samples["kvstore_request_latency_seconds_bucket"][(("le", "+Inf"),)] == 3
        assert samples["kvstore_ttft_seconds_count"][()] == 2   # the failed request had no first token
        assert samples["kvstore_ttft_seconds_bucket"][(("le", "0.05"),)] == 1
        assert samples["kvstore_prefetch_seconds_count"][()] == 1
        assert samples["kvstore_prefetch_seconds_bucket"][(("le", "0.005"),)] == 1
        assert samples["kvstore_prompt_tokens_total"][()] == samples["kvstore_prefix_cache_queries_total"][()] == 147
        assert samples["kvstore_generation_tokens_total"][()] == 11
        hits = {dict(k)["tier"]: v for k, v in samples["kvstore_prefix_cache_hits_total"].items()}
        assert hits == {"hot": 64, "warm": 16, "cold": 16, "remote": 0, "peer": 16}


def test_no_created_series(tmp_path):
    store = make_store(tmp_path)
    try:
        metrics = Metrics(store)
        metrics.observe_request(0.02, 0.3, True, prompt_tokens=10, cached_tokens={"hot": 8})
        metrics.observe_prefetch(0.004)
        text = metrics.render().decode()
        assert [line for line in text.splitlines() if "_created" in line] == []
        assert "kvstore_prefix_cache_hits_total{tier=\"hot\"} 8.0" in text
    finally:
        store.close()


def test_each_metrics_has_its_own_registry(tmp_path):
    store = make_store(tmp_path)
    try:
        a, b = Metrics(store), Metrics(store)   # two in one process: no duplicate-registration error
        a.observe_prefetch(1.0)
        assert b"kvstore_prefetch_seconds_count 1.0" in a.render()
        assert b"kvstore_prefetch_seconds_count 0.0" in b.render()
        assert b"kvstore_" not in prometheus_client.generate_latest(prometheus_client.REGISTRY)
    finally:
        store.close()


async def test_queue_gauges_follow_the_engine(tmp_path):
    from engine import LLM
    from engine.config import load_config
    config = load_config(None, {}, {"data_dir": str(tmp_path / "llm"), "hot.device": "cpu", "hot.pool": "8MiB",
                                    "warm.bytes": "8MiB"})
    llm = LLM("tiny", config=config)
    try:
        for i in range(3):   # queued, not stepped: they wait
            llm.submit(llm.make_request([1 + i] * 20))
        async with running_admin(tmp_path, engine=llm, store=llm.store) as admin:
            samples = await scrape(admin)
            assert samples["kvstore_queue_depth"][()] == 3 and samples["kvstore_running_requests"][()] == 0
            _, stats = await admin.get("/v1/stats")
            assert stats["queue_depth"] == 3 and stats["engine"]["waiting"] == 3
            llm.step()
            samples = await scrape(admin)
            assert samples["kvstore_queue_depth"][()] + samples["kvstore_running_requests"][()] == 3
            assert samples["kvstore_running_requests"][()] > 0
    finally:
        llm.close()


# `kvstore serve`: its engine feeds the token counters, and its admin API keeps a history
SERVE_READY = re.compile(r"kvstore serve: tiny ready on (http://127\.0\.0\.1:\d+) \(OpenAI API: [^)]*\); "
                         r"admin API on (http://127\.0\.0\.1:\d+)\n")
PROMPT = "The quarterly report shows revenue growth across all regions. " * 4   # several pages of tokens


async def test_serve_counts_prompt_and_cached_tokens(tmp_path):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "app", "serve", "--model", "tiny", "--port", "0", "--admin-port", "0",
        "--data-dir", str(tmp_path / "data"), "--set", "hot.pool=8MiB", cwd=tmp_path, env=clean_env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
        ready = SERVE_READY.fullmatch(line)
        assert ready, (line, (await proc.stderr.read()).decode()[-2000:] if not line else "")
        api, admin = ready.groups()
        async with aiohttp.ClientSession() as session:
            async def metrics() -> dict:
                async with session.get(admin + "/metrics") as r:
                    return parse(await r.text())

            def value(samples, name: str, tier: str | None = None) -> float:
                return samples[name][(("tier", tier),) if tier else ()]

            def finished(samples) -> float:
                return sum(samples["kvstore_requests_total"].values())

            before = await metrics()
            for _ in range(100):   # the warm-up's requests are all counted
                await asyncio.sleep(0.1)
                before, counted = await metrics(), finished(before)
                if finished(before) == counted:
                    break
            usages = []
            for _ in range(2):
                async with session.post(api + "/v1/completions", json={"model": "tiny", "prompt": PROMPT,
                                                                        "max_tokens": 4, "temperature": 0}) as r:
                    assert r.status == 200
                    usages.append((await r.json())["usage"])
            done = time.time()
            for _ in range(100):   # the engine counts a request just after answering it
                after = await metrics()
                if finished(after) - finished(before) == 2:
                    break
                await asyncio.sleep(0.05)
            assert finished(after) - finished(before) == 2
            prompt = usages[0]["prompt_tokens"]
            assert prompt == usages[1]["prompt_tokens"] > 2 * 16

            def delta(name: str, tier: str | None = None) -> float:
                return value(after, name, tier) - value(before, name, tier)

            assert delta("kvstore_prefix_cache_queries_total") == delta("kvstore_prompt_tokens_total") == 2 * prompt
            # the startup heap was frozen once the server was ready; collections are counted by generation
            assert after["kvstore_gc_frozen_objects"][()] > 10_000
            collections = {dict(k)["generation"]: v for k, v in after["kvstore_gc_collections_total"].items()}
            assert set(collections) == {"0", "1", "2"} and collections["0"] > 0
            assert delta("kvstore_generation_tokens_total") == sum(u["completion_tokens"] for u in usages) > 0
            first, second = (u["kvstore"]["cached_tokens"] for u in usages)
            assert sum(first.values()) == 0 and second["hot"] > 0   # the second request found the first's pages
            for tier in ("hot", "warm", "cold", "peer"):
                assert delta("kvstore_prefix_cache_hits_total", tier) == second[tier], tier

            # the history: a sample after the requests, with their hits in it
            for _ in range(100):
                async with session.get(admin + "/v1/history") as r:
                    history = await r.json()
                if history["samples"] and history["samples"][-1]["t"] > done:
                    break
                await asyncio.sleep(0.1)
            assert history["server"]["model"] == "tiny" and history["interval_s"] == 2.0
            assert history["samples"][-1]["t"] > done
            assert max(s["hit_rate"]["hot"] or 0 for s in history["samples"]) > 0
            assert max(s["requests_per_s"] for s in history["samples"]) > 0
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
