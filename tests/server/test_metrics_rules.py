"""The alert rules and the Grafana dashboard over /metrics: they name only metrics that it exposes,
hold the deployment guides' thresholds, and pass promtool's checks and unit tests."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from conftest import requires
from test_admin import running_admin
from test_metrics import scrape


# the alert rules and the Grafana dashboard: they name only metrics that /metrics exposes
REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "etc/prometheus/kvstore-rules.yml"
RULE_TESTS = REPO / "etc/prometheus/kvstore-rules.test.yml"
DASHBOARD = REPO / "etc/grafana/kvstore.json"
PROMQL_WORDS = {"sum", "rate", "by", "and", "or", "unless", "offset", "histogram_quantile", "le", "job", "instance",
                "tier", "status", "direction", "reason", "without", "on", "ignoring", "bool", "irate", "increase",
                "avg", "max", "min", "group_left"}


def metric_names(expr: str) -> set[str]:
    expr = re.sub(r'"[^"]*"', '""', expr)            # label values
    expr = re.sub(r"\[[^\]]*\]", "", expr)           # ranges
    words = re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*|[0-9.]+[a-z]*", expr)   # names, and numbers or durations
    return {w for w in words if not w[0].isdigit() and w[0] != "." and w not in PROMQL_WORDS}


async def exposed_names(tmp_path) -> set[str]:
    async with running_admin(tmp_path) as admin:
        return set((await scrape(admin)).keys())


def rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for group in doc["groups"] for r in group["rules"]]


async def test_alert_rules_use_exposed_metrics(tmp_path):
    exposed = await exposed_names(tmp_path)
    recorded = {r["record"] for r in rules() if "record" in r}
    for rule in rules():
        for name in metric_names(rule["expr"]):
            assert name in exposed or name in recorded, (rule.get("alert") or rule.get("record"), name)
    alerts = {r["alert"]: r for r in rules() if "alert" in r}
    assert set(alerts) == {"KVStoreHotTierHigh", "KVStoreHotTierFull", "KVStoreLatencyRegression", "KVStoreErrorRate",
                           "KVStoreTTFTRegression", "KVStoreHitRateDrop", "KVStoreColdWriteErrors",
                           "KVStoreCorruptPages", "KVStorePagesDropped", "KVStoreWriteBehindLag",
                           "KVStoreProducersRefused", "KVStoreStrandedPages"}
    # the deployment guides' thresholds: memory above 85% warns, above 90% for 5 minutes pages,
    # P99 50% above its baseline, errors above 1%
    assert alerts["KVStoreHotTierHigh"]["expr"].endswith("> 0.85") and alerts["KVStoreHotTierHigh"]["for"] == "5m"
    assert alerts["KVStoreHotTierFull"]["expr"].endswith("> 0.90") and alerts["KVStoreHotTierFull"]["for"] == "5m"
    assert alerts["KVStoreHotTierHigh"]["labels"]["severity"] == "warning"
    assert alerts["KVStoreHotTierFull"]["labels"]["severity"] == "page"
    assert alerts["KVStoreErrorRate"]["expr"].endswith("> 0.01") and alerts["KVStoreErrorRate"]["for"] == "5m"
    for name in ("KVStoreLatencyRegression", "KVStoreTTFTRegression"):
        assert "> 1.5 * " in alerts[name]["expr"], name
    assert "offset 1d" in next(r["expr"] for r in rules() if r.get("record", "").endswith("p99_baseline"))
    # write-behind: drops of any reason (where a cold tier exists), lag over 30 s for 5 minutes,
    # any refused page, pages stranded for 10 minutes
    assert "kvstore_dropped_pages_total" in alerts["KVStorePagesDropped"]["expr"]
    assert "reason=" not in alerts["KVStorePagesDropped"]["expr"]
    lag = alerts["KVStoreWriteBehindLag"]
    assert lag["expr"] == "kvstore_write_behind_lag_seconds > 30" and lag["for"] == "5m"
    refused = alerts["KVStoreProducersRefused"]["expr"]
    assert refused.endswith("(rate(kvstore_backpressure_refused_pages_total[5m])) > 0")
    assert alerts["KVStoreStrandedPages"]["expr"] == "kvstore_write_behind_stranded_pages > 0"
    hit_rate = next(r["expr"] for r in rules() if r.get("record") == "kvstore:prefix_cache_hit:ratio_5m")
    assert metric_names(hit_rate) == {"kvstore_prefix_cache_hits_total", "kvstore_prefix_cache_queries_total"}
    # every alert has a promtool unit test
    tested = RULE_TESTS.read_text()
    for name in alerts:
        assert f'alertname="{name}"' in tested, name


async def test_grafana_dashboard_uses_exposed_metrics(tmp_path):
    exposed = await exposed_names(tmp_path)
    dashboard = json.loads(DASHBOARD.read_text())
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Tier occupancy", "Hit rate per tier", "Bytes moved between tiers", "Request latency",
            "Time to first token", "Queue", "Prefix cache hit rate (tokens)", "Tokens per second", "Write-behind",
            "Dropped and refused pages"} <= titles
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = metric_names(target["expr"].replace("$instance", "x"))
            assert names and names <= exposed, (panel["title"], names - exposed)
    hit_rate = next(p for p in dashboard["panels"] if p["title"] == "Prefix cache hit rate (tokens)")
    assert {metric_names(t["expr"].replace("$instance", "x")) == {"kvstore_prefix_cache_hits_total",
                                                                 "kvstore_prefix_cache_queries_total"}
            for t in hit_rate["targets"]} == {True}
    write_behind = next(p for p in dashboard["panels"] if p["title"] == "Write-behind")
    assert {"kvstore_write_behind_dirty_pages", "kvstore_write_behind_max_dirty_pages",
            "kvstore_write_behind_lag_seconds"} <= {n for t in write_behind["targets"] for n in metric_names(t["expr"])}
    dropped = next(p for p in dashboard["panels"] if p["title"] == "Dropped and refused pages")
    assert any("by (reason)" in t["expr"] and "kvstore_dropped_pages_total" in t["expr"] for t in dropped["targets"])


PROMTOOL = shutil.which("promtool")


def test_promtool_checks_and_unit_tests_the_rules(tmp_path):
    requires(PROMTOOL is not None, "promtool is not installed (Debian package prometheus; scripts/bootstrap installs it)")
    check = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    # as an operator runs them, from the repository
    run = subprocess.run([PROMTOOL, "test", "rules", str(RULE_TESTS.relative_to(REPO))], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "SUCCESS" in run.stdout, run.stdout + run.stderr
    # the Grafana panels' queries parse (as recording rules: promtool has no offline query check)
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [t["expr"].replace("$instance", "x") for p in panels for t in p["targets"]]
    queries = tmp_path / "grafana_rules.yml"
    queries.write_text(yaml.safe_dump({"groups": [{"name": "grafana", "rules": [
        {"record": f"grafana:panel:{i}", "expr": e} for i, e in enumerate(exprs)]}]}))
    check = subprocess.run([PROMTOOL, "check", "rules", str(queries)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
