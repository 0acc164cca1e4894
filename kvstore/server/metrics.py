"""Prometheus metrics: the store's counters read at scrape time, plus histograms fed by calls.

A wrapper around the store, not code inside it: `StoreCollector` turns `store.stats()` (and the
engine's queue, when there is one) into `kvstore_*` families on each scrape; `Metrics` owns its
own CollectorRegistry (never the process-global one) with the request and prefetch histograms
and the token counters that the engine and the daemon feed through observe_request() and
observe_prefetch().

Token counters follow vLLM's prefix-cache ones: kvstore_prefix_cache_queries_total counts the
prompt tokens looked up, kvstore_prefix_cache_hits_total{tier} those served from each tier, so
the hit rate is sum(rate(hits[5m])) / sum(rate(queries[5m])).

Write-behind is kvstore_write_behind_* (dirty pages against their bound, the oldest one's age,
pages written, pages cold refused) and kvstore_backpressure_* (producers that waited for it, and
the pages they did not store); kvstore_dropped_pages_total{reason} counts pages that left the
store with no copy below, every reason's series present from the start.

The Python collector's pauses (kvstore.heap) are kvstore_gc_*: collections and the seconds they
paused the process, by generation, the longest pause, and the objects frozen at startup.

render() reads the store under its lock: async callers run it in the daemon's worker threads.
It leaves out the `_created` series that prometheus_client adds to counters and histograms (the
process-global switch disable_created_metrics() is not touched).
"""

from __future__ import annotations

from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore import heap
from kvstore.movement.move_stats import DROP_REASONS
from kvstore.placement.index import CACHE_TIERS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TIERS = ("hot", "warm", "cold")
TIER_COUNTERS = ("hits", "misses", "evictions", "promotions")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
PREFETCH_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def engine_stats(engine: Any) -> dict | None:
    """The engine's queue (waiting, running, preemptions, computed_tokens): an LLM or an AsyncLLM."""
    if engine is None:
        return None
    target = engine if hasattr(engine, "stats") else getattr(engine, "llm", None)
    return dict(target.stats()) if target is not None else None


def write_behind(wb: dict) -> Iterable[Metric]:
    """The write-behind queue and the producers' backpressure (store.stats()["write_behind"])."""
    yield GaugeMetricFamily("kvstore_write_behind_dirty_pages", "Pages in memory not yet written to cold",
                            value=wb["dirty_pages"])
    yield GaugeMetricFamily("kvstore_write_behind_max_dirty_pages", "The bound on dirty pages (0 without a cold "
                            "tier)", value=wb["max_dirty_pages"])
    yield GaugeMetricFamily("kvstore_write_behind_lag_seconds", "Age of the oldest dirty page (0 when none)",
                            value=wb["lag_s"])
    yield CounterMetricFamily("kvstore_write_behind_written_pages", "Pages written to cold by write-behind",
                              value=wb["written_pages"])
    yield CounterMetricFamily("kvstore_write_behind_batches", "Write-behind batches run (one cold transaction "
                              "each), failed ones included", value=wb["write_batches"])
    yield GaugeMetricFamily("kvstore_write_behind_stranded_pages", "Dirty pages cold refused; retried, and they "
                            "may be dropped", value=wb["stranded_pages"])
    yield CounterMetricFamily("kvstore_backpressure_waits", "Producers (sidecar puts, peer imports) that waited "
                              "for write-behind", value=wb["backpressure_waits"])
    yield CounterMetricFamily("kvstore_backpressure_wait_seconds", "Seconds producers waited for write-behind",
                              value=wb["backpressure_wait_s"])
    yield CounterMetricFamily("kvstore_backpressure_refused_pages", "Pages producers did not store after waiting "
                              "their bound", value=wb["refused_pages"])


class StoreCollector(Collector):
    """Reads store.stats() at scrape time and yields the kvstore_ families."""

    def __init__(self, store, engine: Any = None):
        self.store, self.engine = store, engine
        self.cluster = None   # a ClusterNode, when the instance is part of one

    def describe(self) -> Iterable[Metric]:
        return []   # nothing to describe up front: registering must not read the store

    def collect(self) -> Iterable[Metric]:
        stats = self.store.stats()
        tiers = stats["tiers"]

        def per_tier(family, field: str):
            for tier in TIERS:
                family.add_metric([tier], tiers[tier][field])
            return family

        yield per_tier(GaugeMetricFamily("kvstore_tier_capacity_bytes", "Bytes the tier can hold",
                                         labels=["tier"]), "capacity_bytes")
        yield per_tier(GaugeMetricFamily("kvstore_tier_used_bytes", "Bytes the tier holds now",
                                         labels=["tier"]), "used_bytes")
        yield per_tier(GaugeMetricFamily("kvstore_tier_pages", "Pages in the tier", labels=["tier"]), "pages")
        yield per_tier(GaugeMetricFamily("kvstore_tier_referenced_pages", "Pages in the tier held by requests",
                                         labels=["tier"]), "referenced_pages")
        yield per_tier(GaugeMetricFamily("kvstore_tier_pinned_pages", "Pages in the tier pinned by an operator",
                                         labels=["tier"]), "pinned_pages")
        yield per_tier(GaugeMetricFamily("kvstore_tier_high_watermark", "Usage fraction above which the "
                                         "daemon demotes pages", labels=["tier"]), "high_watermark")
        for field in TIER_COUNTERS:
            yield per_tier(CounterMetricFamily(f"kvstore_tier_{field}", f"Page {field} in the tier",
                                               labels=["tier"]), field)
        moved = CounterMetricFamily("kvstore_bytes_moved", "Bytes copied between tiers", labels=["direction"])
        for direction, n in sorted(stats["bytes_moved"].items()):
            moved.add_metric([direction], n)
        yield moved
        yield CounterMetricFamily("kvstore_corrupt_pages", "Cold pages that failed their checksum",
                                  value=stats["corrupt_pages"])
        yield CounterMetricFamily("kvstore_mismatched_pages", "Lookups whose page did not match the request's "
                                  "tokens", value=stats["mismatched_pages"])
        dropped = CounterMetricFamily("kvstore_dropped_pages", "Cached pages that left the store with no copy "
                                      "below, by reason", labels=["reason"])
        for reason in DROP_REASONS:   # every reason from the start, so rates are defined
            dropped.add_metric([reason], stats["dropped_by_reason"].get(reason, 0))
        yield dropped
        yield CounterMetricFamily("kvstore_cold_write_errors", "Write-behind batches the cold tier refused "
                                  "(disk or map full); their pages stayed in memory", value=stats["cold_write_errors"])
        yield from write_behind(stats["write_behind"])
        yield GaugeMetricFamily("kvstore_cold_index_done", "1 once the cold tier's records are all indexed "
                                "after a start", value=1 if stats["cold_indexing"]["done"] else 0)
        yield GaugeMetricFamily("kvstore_index_entries", "Pages in the index", value=stats["entries"])
        if "remote" in tiers:
            yield from remote_tier(tiers["remote"])
        queue = engine_stats(self.engine) or {}
        yield GaugeMetricFamily("kvstore_queue_depth", "Requests waiting for the engine",
                                value=queue.get("waiting", 0))
        yield GaugeMetricFamily("kvstore_running_requests", "Requests the engine is running",
                                value=queue.get("running", 0))
        yield GaugeMetricFamily("kvstore_loading_requests", "Requests waiting for their cached prefix to come "
                                "up from cold", value=queue.get("loading", 0))
        if self.cluster is not None:
            c = self.cluster.stats()
            yield GaugeMetricFamily("kvstore_cluster_connected", "1 while the Redis prefix index is reachable",
                                    value=1 if c["state"] == "connected" else 0)
            yield CounterMetricFamily("kvstore_cluster_errors", "Redis index failures (outages, timeouts)",
                                      value=c["errors"])
            yield CounterMetricFamily("kvstore_cluster_published_pages", "Page residencies published to the index",
                                      value=c["published"])
            yield CounterMetricFamily("kvstore_peer_fetched_pages", "Pages fetched from peer instances",
                                      value=c["fetch"]["fetched_pages"])
            yield CounterMetricFamily("kvstore_peer_fetch_failures", "Peer fetches that failed",
                                      value=c["fetch"]["failed"])


def remote_tier(r: dict) -> Iterable[Metric]:
    """kvstore_remote_*: the remote tier's health, reads and writes (when remote.url is set)."""
    yield GaugeMetricFamily("kvstore_remote_up", "1 while the remote tier answers (0: down, its pages are misses)",
                            value=1 if r["state"] == "up" else 0)
    for field, help_ in (("hits", "Pages read from the remote tier, verified"),
                         ("misses", "Remote lookups that ended at a page it does not hold"),
                         ("corrupt_pages", "Remote values that failed verification (never served)"),
                         ("errors", "Calls to the remote store that failed or timed out"),
                         ("read_bytes", "Record bytes read from the remote tier"),
                         ("written_pages", "Pages written to the remote tier"),
                         ("skipped_pages", "Pages not written to the remote tier: its queue was full"),
                         ("deleted_pages", "Records deleted to keep within remote.max_bytes")):
        yield CounterMetricFamily(f"kvstore_remote_{field}", help_, value=r[field])
    yield GaugeMetricFamily("kvstore_remote_used_bytes", "Bytes of the records this instance wrote and keeps",
                            value=r["used_bytes"])
    yield GaugeMetricFamily("kvstore_remote_queued_pages", "Pages waiting to be written to the remote tier",
                            value=r["queued_pages"])
    yield GaugeMetricFamily("kvstore_remote_read_latency_seconds", "Mean time of a remote read call",
                            value=r["read_latency_ms"] / 1000)


class HeapCollector(Collector):
    """The process's garbage-collector pauses (kvstore.heap.pauses()), read at scrape time."""

    def __init__(self):
        self.pauses = heap.pauses()

    def collect(self) -> Iterable[Metric]:
        snap = self.pauses.snapshot()
        families = (
            (CounterMetricFamily, "kvstore_gc_collections", "Python garbage collections, by generation",
             snap["collections"]),
            (CounterMetricFamily, "kvstore_gc_pause_seconds", "Time the process spent in garbage collections, "
             "by generation", snap["pause_seconds"]),
            (GaugeMetricFamily, "kvstore_gc_longest_pause_seconds", "The longest garbage collection so far, by "
             "generation", snap["longest_pause_seconds"]))
        for kind, name, doc, values in families:
            family = kind(name, doc, labels=["generation"])
            for generation, value in values.items():
                family.add_metric([str(generation)], value)
            yield family
        yield GaugeMetricFamily("kvstore_gc_frozen_objects", "Objects frozen out of garbage collection at "
                                "startup", value=snap["frozen_objects"])


class Metrics:
    """The admin API's /metrics: a registry of its own with the store collector, the histograms
    and the request and token counters.

    The engine integration calls observe_request() once per finished request and the daemon
    observe_prefetch() once per prefetch; both are thread-safe.
    """

    def __init__(self, store, engine: Any = None):
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = StoreCollector(store, engine)
        self.registry.register(self.collector)
        self.registry.register(HeapCollector())
        self.prefetch_seconds = Histogram("kvstore_prefetch_seconds", "Time to bring a prefix up a tier",
                                          buckets=PREFETCH_BUCKETS, registry=self.registry)
        self.request_latency = Histogram("kvstore_request_latency_seconds", "Request time, arrival to last token",
                                         buckets=LATENCY_BUCKETS, registry=self.registry)
        self.ttft = Histogram("kvstore_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=self.registry)
        self.requests = Counter("kvstore_requests", "Finished requests, by status", ["status"],
                                registry=self.registry)
        for status in ("ok", "error"):
            self.requests.labels(status)   # both series exist from the start, so ratios are defined
        self.prompt_tokens = Counter("kvstore_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=self.registry)
        self.generation_tokens = Counter("kvstore_generation_tokens", "Tokens generated by finished requests",
                                         registry=self.registry)
        self.cache_queries = Counter("kvstore_prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                     "cache", registry=self.registry)
        self.cache_hits = Counter("kvstore_prefix_cache_hits", "Prompt tokens served from the prefix cache, by "
                                  "the tier they came from", ["tier"], registry=self.registry)
        for tier in CACHE_TIERS:
            self.cache_hits.labels(tier)

    def observe_request(self, ttft_s: float | None, latency_s: float, ok: bool, *, prompt_tokens: int = 0,
                        generation_tokens: int = 0, cached_tokens: dict[str, int] | None = None) -> None:
        """One finished request: its time to first token (None if it produced none), total time,
        prompt and generated token counts, and its cached prompt tokens by tier (hot, warm, cold, peer)."""
        self.requests.labels("ok" if ok else "error").inc()
        self.request_latency.observe(latency_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.cache_queries.inc(prompt_tokens)
        for tier, n in (cached_tokens or {}).items():
            if n:
                self.cache_hits.labels(tier).inc(n)

    def observe_prefetch(self, seconds: float) -> None:
        self.prefetch_seconds.observe(seconds)

    def totals(self) -> dict:
        """The request and token counters and the TTFT histogram now, cumulative as on /metrics:
        {"requests", "prompt_tokens", "generation_tokens", "prefix_cache_queries": n,
         "prefix_cache_hits": {tier: n}, "ttft_buckets": [(upper bound, cumulative count), ..., (inf, n)]}."""
        def samples(metric, suffix: str) -> list:
            return [s for family in metric.collect() for s in family.samples if s.name.endswith(suffix)]

        def total(metric) -> float:
            return sum(s.value for s in samples(metric, "_total"))

        return {"requests": total(self.requests), "prompt_tokens": total(self.prompt_tokens),
                "generation_tokens": total(self.generation_tokens),
                "prefix_cache_queries": total(self.cache_queries),
                "prefix_cache_hits": {s.labels["tier"]: s.value for s in samples(self.cache_hits, "_total")},
                "ttft_buckets": [(float(s.labels["le"]), s.value) for s in samples(self.ttft, "_bucket")]}

    def render(self) -> bytes:
        """The Prometheus text format (CONTENT_TYPE), without `_created` series."""
        return generate_latest(_WithoutCreated(self.registry))


class _WithoutCreated:
    """A registry's families without their `_created` samples (the time each series was created)."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self) -> Iterable[Metric]:
        for family in self.registry.collect():
            kept = Metric(family.name, family.documentation, family.type, family.unit)
            kept.samples = [s for s in family.samples if s.name != family.name + "_created"]
            yield kept
