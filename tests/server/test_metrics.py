"""/metrics: the Prometheus text format, the kvstore_ families, values equal to /v1/stats."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import prometheus_client
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvstore.server.admin import STATE
from kvstore.server.metrics import Metrics
from storeutil import make_store
from test_admin import TOKEN, running_admin

FAMILIES = {  # name as the parser reports it -> type
    "kvstore_tier_capacity_bytes": "gauge", "kvstore_tier_used_bytes": "gauge", "kvstore_tier_pages": "gauge",
    "kvstore_tier_hits": "counter", "kvstore_tier_misses": "counter", "kvstore_tier_evictions": "counter",
    "kvstore_tier_promotions": "counter", "kvstore_bytes_moved": "counter", "kvstore_corrupt_pages": "counter",
    "kvstore_queue_depth": "gauge", "kvstore_running_requests": "gauge", "kvstore_prefetch_seconds": "histogram",
    "kvstore_request_latency_seconds": "histogram", "kvstore_ttft_seconds": "histogram",
    "kvstore_requests": "counter", "kvstore_dropped_pages": "counter", "kvstore_cold_write_errors": "counter",
    "kvstore_cold_index_done": "gauge", "kvstore_loading_requests": "gauge",
}


async def scrape(admin) -> dict[str, dict[tuple, float]]:
    """{sample name: {label items: value}}"""
    status, text, headers = await admin.request("GET", "/metrics")
    assert status == 200 and headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
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


def tier(samples, name: str, t: str) -> float:
    return samples[name][(("tier", t),)]


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
        assert samples["kvstore_queue_depth"][()] == stats["queue_depth"] == 0
        assert samples["kvstore_running_requests"][()] == stats["running"] == 0
        assert samples["kvstore_requests_total"] == {(("status", "ok"),): 0, (("status", "error"),): 0}


async def test_histograms_are_fed_by_calls(tmp_path):
    async with running_admin(tmp_path) as admin:
        metrics = admin.app[STATE].metrics
        metrics.observe_request(ttft_s=0.02, latency_s=0.3, ok=True)
        metrics.observe_request(ttft_s=0.08, latency_s=1.7, ok=True)
        metrics.observe_request(ttft_s=None, latency_s=0.01, ok=False)
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
    from kvstore.config import load_config
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


# the alert rules and the Grafana dashboard: they name only metrics that /metrics exposes
REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "etc/prometheus/alerts.yml"
DASHBOARD = REPO / "etc/grafana/kvstore.json"
PROMQL_WORDS = {"sum", "rate", "by", "and", "or", "offset", "histogram_quantile", "le", "job", "instance", "tier",
                "status", "direction", "without", "on", "ignoring", "bool", "irate", "increase", "avg", "max", "min"}


def metric_names(expr: str) -> set[str]:
    expr = re.sub(r'"[^"]*"', '""', expr)            # label values
    expr = re.sub(r"\[[^\]]*\]", "", expr)           # ranges
    words = re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*|[0-9.]+[a-z]*", expr)   # names, and numbers or durations
    return {w for w in words if not w[0].isdigit() and w[0] != "." and w not in PROMQL_WORDS}


async def exposed_names(tmp_path) -> set[str]:
    async with running_admin(tmp_path) as admin:
        return set((await scrape(admin)).keys())


def rules() -> list[dict]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [r for group in doc["groups"] for r in group["rules"]]


async def test_alert_rules_use_exposed_metrics(tmp_path):
    exposed = await exposed_names(tmp_path)
    recorded = {r["record"] for r in rules() if "record" in r}
    for rule in rules():
        for name in metric_names(rule["expr"]):
            assert name in exposed or name in recorded, (rule.get("alert") or rule.get("record"), name)
    alerts = {r["alert"]: r for r in rules() if "alert" in r}
    assert set(alerts) == {"KVStoreHotTierHigh", "KVStoreHotTierFull", "KVStoreLatencyRegression", "KVStoreErrorRate"}
    assert alerts["KVStoreHotTierHigh"]["expr"].endswith("> 0.85") and alerts["KVStoreHotTierHigh"]["for"] == "5m"
    assert alerts["KVStoreHotTierFull"]["expr"].endswith("> 0.90") and alerts["KVStoreHotTierFull"]["for"] == "5m"
    assert alerts["KVStoreHotTierHigh"]["labels"]["severity"] == "warning"
    assert alerts["KVStoreHotTierFull"]["labels"]["severity"] == "page"
    assert alerts["KVStoreErrorRate"]["expr"].endswith("> 0.01") and alerts["KVStoreErrorRate"]["for"] == "5m"
    assert "offset 1d" in next(r["expr"] for r in rules() if r.get("record", "").endswith("p99_baseline"))


async def test_grafana_dashboard_uses_exposed_metrics(tmp_path):
    exposed = await exposed_names(tmp_path)
    dashboard = json.loads(DASHBOARD.read_text())
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Tier occupancy", "Hit rate per tier", "Bytes moved between tiers", "Request latency",
            "Time to first token", "Queue"} <= titles
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = metric_names(target["expr"].replace("$instance", "x"))
            assert names and names <= exposed, (panel["title"], names - exposed)


PROMTOOL = shutil.which("promtool")
def firing(at: str, alert: str, *instances: dict) -> dict:
    """A promtool check: at `at`, exactly these instances (their labels) of `alert` fire."""
    query = f'ALERTS{{alertname="{alert}", alertstate="firing"}}'
    samples = [{"labels": "ALERTS{" + ", ".join(f'{k}="{v}"' for k, v in sorted(
        {"alertname": alert, "alertstate": "firing", **labels}.items())) + "}", "value": 1} for labels in instances]
    return {"eval_time": at, "expr": query, "exp_samples": samples}


def series(name: str, values: str, **labels: str) -> dict:
    return {"series": name + "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}", "values": values}


HOT = {"tier": "hot"}
RULE_TESTS = [
    {"interval": "1m",   # a: 87% full; b: 95%, with a dip to 87% at minutes 4 to 6
     "input_series": [series("kvstore_tier_capacity_bytes", "1000x20", instance="a", **HOT),
                      series("kvstore_tier_used_bytes", "870x20", instance="a", **HOT),
                      series("kvstore_tier_capacity_bytes", "1000x20", instance="b", **HOT),
                      series("kvstore_tier_used_bytes", "950x3 870x2 950x15", instance="b", **HOT)],
     "promql_expr_test": [
         firing("4m", "KVStoreHotTierHigh"),   # above 85% for 4 minutes only: pending
         firing("10m", "KVStoreHotTierHigh", {"instance": "a", "severity": "warning", **HOT},
                {"instance": "b", "severity": "warning", **HOT}),
         firing("8m", "KVStoreHotTierFull"),
         firing("13m", "KVStoreHotTierFull", {"instance": "b", "severity": "page", **HOT})]},
    {"interval": "1m",   # 2% of requests fail on a, 0.5% on b
     "input_series": [series("kvstore_requests_total", "0+98x30", status="ok", instance="a", job="kvstore"),
                      series("kvstore_requests_total", "0+2x30", status="error", instance="a", job="kvstore"),
                      series("kvstore_requests_total", "0+199x30", status="ok", instance="b", job="kvstore"),
                      series("kvstore_requests_total", "0+1x30", status="error", instance="b", job="kvstore")],
     "promql_expr_test": [firing("20m", "KVStoreErrorRate", {"instance": "a", "job": "kvstore", "severity": "page"})]},
    {"interval": "1m",   # for a day every request takes under 0.1 s; then they take 0.1 to 1 s
     "input_series": [
         series("kvstore_request_latency_seconds_bucket", "0+60x1440 86400+0x60", le="0.1", instance="a", job="kvstore"),
         series("kvstore_request_latency_seconds_bucket", "0+60x1500", le="1.0", instance="a", job="kvstore"),
         series("kvstore_request_latency_seconds_bucket", "0+60x1500", le="+Inf", instance="a", job="kvstore")],
     "promql_expr_test": [
         firing("1000m", "KVStoreLatencyRegression"),   # a steady day
         firing("1447m", "KVStoreLatencyRegression"),   # slower for a few minutes only: pending
         firing("1480m", "KVStoreLatencyRegression", {"instance": "a", "job": "kvstore", "severity": "warning"})]},
]


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian package prometheus)")
def test_promtool_checks_and_unit_tests_the_rules(tmp_path):
    check = subprocess.run([PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    tests = tmp_path / "alerts_test.yml"
    tests.write_text(yaml.safe_dump({"rule_files": [str(ALERTS)], "evaluation_interval": "1m", "tests": RULE_TESTS}))
    run = subprocess.run([PROMTOOL, "test", "rules", str(tests)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
