"""The REST admin API: a real aiohttp server on loopback over a real TieredStore (tiny geometry, LMDB
in tmp_path). Every response is validated against the /openapi.json that the server serves. Its
defences (bad input, auth, exposure, TLS) are in test_admin_security."""

from __future__ import annotations

import contextlib
import json
import re
import ssl
import time
from pathlib import Path

import aiohttp
import pytest
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate as validate_openapi

from kvstore.pages.keys import page_keys
from kvstore.server import create_admin_app, set_draining, start_admin
from kvstore.server.admin import admin_url
from storeutil import QUIET, SPEC, fill_and_commit, make_config, make_store, settle, stall_writes, tokens_for

TOKEN = "s3cret-admin-token"
PS = SPEC.page_size


class Admin:
    """A running admin server and a client session; every response is checked against the
    server's own OpenAPI document."""

    def __init__(self, store, daemon, config, runner, session: aiohttp.ClientSession, token: str = ""):
        self.store, self.daemon, self.config, self.runner, self.session = store, daemon, config, runner, session
        self.url = admin_url(runner)
        self.token = token
        self.app = runner.app
        self.doc: dict | None = None
        self.checked = 0

    def headers(self, token: str | None) -> dict:
        token = self.token if token is None else token
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def request(self, method: str, path: str, body=None, data: bytes | None = None, token: str | None = None,
                      headers: dict | None = None):
        """(status, parsed JSON or text, response headers); JSON answers are validated against the document."""
        hdrs = {**self.headers(token), **(headers or {})}
        async with self.session.request(method, self.url + path, json=body if data is None else None, data=data,
                                        headers=hdrs) as r:
            text = await r.text()
            if r.content_type == "application/json":
                parsed = json.loads(text)
                if self.doc is not None:
                    check_response(self.doc, method, path, r.status, parsed)
                    self.checked += 1
                return r.status, parsed, r.headers
            assert r.status < 400, f"{method} {path}: error {r.status} not JSON: {text[:200]}"
            return r.status, text, r.headers

    async def get(self, path: str, **kw):
        status, body, _ = await self.request("GET", path, **kw)
        return status, body

    async def post(self, path: str, body=None, **kw):
        status, body, _ = await self.request("POST", path, body, **kw)
        return status, body


def _template(doc: dict, path: str) -> str | None:
    path = path.split("?", 1)[0]
    for template in doc["paths"]:
        pattern = "^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(template)) + "$"
        if re.match(pattern, path):
            return template
    return None


def check_response(doc: dict, method: str, path: str, status: int, body) -> None:
    """Validate a JSON answer against the document: the status must be documented for the
    operation (405 and unknown paths answer the Error schema)."""
    template = _template(doc, path)
    op = doc["paths"].get(template, {}).get(method.lower()) if template else None
    if op is None:
        assert status in (401, 404, 405), f"{method} {path}: {status} for an undocumented operation"
        schema = {"$ref": "#/components/schemas/Error"}
    elif status == 405:
        schema = {"$ref": "#/components/schemas/Error"}
    else:
        assert str(status) in op["responses"], f"{method} {path}: status {status} is not documented"
        schema = op["responses"][str(status)]["content"]["application/json"]["schema"]
    Draft202012Validator({**schema, "components": doc["components"]}).validate(body)


def populate(store) -> dict:
    """Doc A: 4 pages in hot, reused once (hits); doc B: 2 pages in cold only; doc C: 1 page in warm
    (and cold). Every page is in cold: written behind as it was committed."""
    ns = store.namespace()
    docs = {"A": tokens_for(1, 4), "B": tokens_for(2, 2), "C": tokens_for(3, 1)}
    keys = {}
    for name, tokens in docs.items():
        slots, keys[name] = fill_and_commit(store, ns, tokens)
        store.release(slots)
    slots, _ = fill_and_commit(store, ns, docs["A"])   # a second request over doc A: 4 hits
    store.release(slots)
    settle(store)
    store.evict(keys["B"], "cold")
    store.evict(keys["C"], "warm")
    return {"tokens": docs, "keys": keys, "namespace": ns}


@contextlib.asynccontextmanager
async def running_admin(tmp_path: Path, token: str = "", engine=None, store=None, fill: bool = True,
                        client_ssl: ssl.SSLContext | None = None, **overrides):
    """An admin server on 127.0.0.1 (a free port) over `store` (default: a fresh tiny store, populated);
    the client trusts `client_ssl`'s certificates."""
    own = store is None
    if own:
        store = make_store(tmp_path / "data")
    config = make_config(tmp_path / "data", **{"admin.port": 0, "admin.token": token, **overrides})
    if own and fill:
        populate(store)
    daemon = store.daemon
    runner = None
    try:
        app = create_admin_app(store, config, engine=engine)
        runner = await start_admin(app, config)
        connector = aiohttp.TCPConnector(ssl=client_ssl) if client_ssl else None
        async with aiohttp.ClientSession(connector=connector) as session:
            admin = Admin(store, daemon, config, runner, session, token)
            status, admin.doc = await admin.get("/openapi.json")
            assert status == 200
            yield admin
    finally:
        if runner is not None:
            await runner.cleanup()
        if own:
            store.close()


@pytest.fixture
async def admin(tmp_path):
    async with running_admin(tmp_path) as a:
        yield a


@pytest.fixture
async def secured(tmp_path):
    async with running_admin(tmp_path, token=TOKEN) as a:
        yield a


def hexes(keys) -> list[str]:
    return [k.hex() for k in keys]


# the document
async def test_openapi_is_a_valid_document_covering_every_route(admin):
    validate_openapi(admin.doc)
    routes = {(r.method.lower(), r.resource.canonical) for r in admin.app.router.routes() if r.method != "HEAD"}
    documented = {(m, p) for p, ops in admin.doc["paths"].items() for m in ops}
    assert routes == documented


# health
async def test_health_and_readiness(admin):
    assert await admin.get("/healthz") == (200, {"status": "ok"})
    status, ready = await admin.get("/readyz")
    assert status == 200 and ready == {"ready": True, "checks": {"store": True, "engine": True, "accepting": True},
                                       "cluster": "disabled", "cold_index": {"done": True, "pages": 0},
                                       "peers": {"serving": False, "fetching": False,
                                                 "reason": "no cluster: cluster.redis_url is not set"},
                                       "cold": {"enabled": True, "write_errors": 0, "last_error": "", "full": False,
                                                "evicted_for_room": 0, "disk_bound": False},
                                       "write_behind": {"dirty_pages": 0, "max_dirty_pages": 4, "lag_s": 0.0,
                                                        "stranded_pages": 0},
                                       "dropped_by_reason": {"no_cold_tier": 0, "cold_full": 0, "write_error": 0},
                                       "remote": {"state": "disabled", "last_error": ""}}
    set_draining(admin.app)
    status, ready = await admin.get("/readyz")
    assert status == 503 and ready["ready"] is False and ready["checks"]["accepting"] is False
    assert (await admin.get("/healthz"))[0] == 200   # alive while draining


async def test_readiness_shows_write_behind_and_drops(tmp_path):
    """A disk that stalls: dirty pages at their bound and ageing; a store without a cold tier that
    drops what memory evicts. Neither holds readiness back, and /v1/stats says the same."""
    store = make_store(tmp_path / "a", warm=8)
    gate = stall_writes(store)
    try:
        store.commit_warm(store.namespace(), tokens_for(1, 4), store.allocate_warm(4))
        time.sleep(0.05)
        async with running_admin(tmp_path, store=store) as admin:
            status, ready = await admin.get("/readyz")
            _, stats = await admin.get("/v1/stats")
        wb = ready["write_behind"]
        assert status == 200 and ready["ready"] and (wb["dirty_pages"], wb["max_dirty_pages"]) == (4, 4)
        assert 0.05 <= wb["lag_s"] <= stats["write_behind"]["lag_s"] and wb["stranded_pages"] == 0
        full = stats["write_behind"]
        assert (full["dirty_pages"], full["max_dirty_pages"], full["stranded_pages"]) == (4, 4, 0)
        assert full["queued_pages"] + full["writing_pages"] == 4 and full["written_pages"] == 0
    finally:
        gate.set()
        store.close(persist=False)

    store = make_store(tmp_path / "b", hot=4, warm=4, **{**QUIET, "cold.enabled": "false"})
    try:
        for doc in range(6):   # 12 pages, room for 8
            slots, _ = fill_and_commit(store, store.namespace(), tokens_for(doc, 2))
            store.release(slots)
        async with running_admin(tmp_path, store=store) as admin:
            status, ready = await admin.get("/readyz")
            _, stats = await admin.get("/v1/stats")
        drops = ready["dropped_by_reason"]
        assert status == 200 and ready["ready"] and drops == stats["dropped_by_reason"]
        assert drops["no_cold_tier"] == stats["dropped_pages"] > 0 and drops["cold_full"] == drops["write_error"] == 0
        assert ready["write_behind"] == {"dirty_pages": 0, "max_dirty_pages": 0, "lag_s": 0.0, "stranded_pages": 0}
    finally:
        store.close(persist=False)


# stats
async def test_stats_report_the_store(admin):
    status, stats = await admin.get("/v1/stats")
    assert status == 200
    direct = admin.store.stats()
    for tier in ("hot", "warm", "cold"):
        for field, value in direct["tiers"][tier].items():
            assert stats["tiers"][tier][field] == value, (tier, field)
    assert [stats["tiers"][t]["pages"] for t in ("hot", "warm", "cold")] == [4, 1, 7]
    hot = stats["tiers"]["hot"]
    assert hot["hits"] >= 4 and hot["hit_rate"] == pytest.approx(hot["hits"] / (hot["hits"] + hot["misses"]))
    assert stats["entries"] == 7 and stats["bytes_moved"] == direct["bytes_moved"]
    assert stats["bytes_moved"]["hot_to_cold"] == 7 * SPEC.page_bytes   # written behind from hot
    assert stats["bytes_moved"]["warm_to_cold"] == 0
    assert (stats["engine"], stats["queue_depth"], stats["running"]) == (None, 0, 0)


async def test_hit_rate_is_null_before_any_lookup(tmp_path):
    async with running_admin(tmp_path, fill=False) as admin:
        _, stats = await admin.get("/v1/stats")
        assert {t["hit_rate"] for t in stats["tiers"].values()} == {None}


# pages
async def test_pages_filters(admin):
    status, listing = await admin.get("/v1/pages")
    assert status == 200 and listing["total"] == 7 and len(listing["pages"]) == 7 and listing["next_cursor"] is None
    assert [p["key"] for p in listing["pages"]] == sorted(p["key"] for p in listing["pages"])
    for tier, n in (("hot", 4), ("warm", 1), ("cold", 7)):
        _, got = await admin.get(f"/v1/pages?tier={tier}")
        assert got["total"] == n and all(tier in p["tiers"] for p in got["pages"])
    ns = admin.store.namespace().digest.hex()
    assert (await admin.get(f"/v1/pages?namespace={ns}"))[1]["total"] == 7
    assert (await admin.get(f"/v1/pages?namespace={'ab' * 32}"))[1]["total"] == 0
    assert (await admin.get("/v1/pages?pinned=true"))[1]["total"] == 0
    assert (await admin.get("/v1/pages?pinned=false"))[1]["total"] == 7
    page = next(p for p in listing["pages"] if p["depth"] == 0 and p["hits"])
    assert page["parent"] == ns and page["tokens"] == PS and page["children"] == 1 and page["tier"] == "hot"


async def test_pages_paginate_in_key_order(admin):
    seen, cursor = [], None
    while True:
        _, got = await admin.get("/v1/pages?limit=2" + (f"&cursor={cursor}" if cursor else ""))
        assert got["total"] == 7 and len(got["pages"]) <= 2
        seen += [p["key"] for p in got["pages"]]
        cursor = got["next_cursor"]
        if cursor is None:
            break
    assert len(seen) == 7 and seen == sorted(set(seen))
    assert set(seen) == {k.hex() for k in admin.store.index.entries}


@pytest.mark.parametrize("query", ["tier=lukewarm", "limit=0", "limit=1001", "limit=abc", "limit=-1", "pinned=maybe",
                                   "cursor=xyz", "namespace=12", "colour=red", "tier=hot&tier=cold"])
async def test_pages_reject_bad_queries(admin, query):
    status, body = await admin.get(f"/v1/pages?{query}")
    assert status == 400 and "\n" not in body["error"]


async def test_page_by_key(admin):
    key = next(iter(admin.store.index.entries))
    status, page = await admin.get(f"/v1/pages/{key.hex()}")
    assert status == 200 and page["key"] == key.hex()
    assert (await admin.get(f"/v1/pages/{key.hex().upper()}"))[0] == 200
    assert (await admin.get(f"/v1/pages/{'0' * 64}"))[0] == 404
    for bad in ("xyz", "0" * 63, "0" * 65, "g" * 64):
        assert (await admin.get(f"/v1/pages/{bad}"))[0] == 400


# prefixes
async def test_prefixes_rank_reused_chains(admin, tmp_path):
    status, got = await admin.get("/v1/prefixes")
    assert status == 200 and got["page_size"] == PS
    top = got["prefixes"][0]
    doc_a = page_keys(admin.store.namespace(), tokens_for(1, 4), PS)
    assert top["key"] == doc_a[-1].hex() and top["pages"] == 4 and top["tokens"] == 4 * PS
    assert top["hits"] == 1 and top["complete"] and top["tiers"] == {"hot": 4, "warm": 0, "cold": 0}
    # a longer, more reused chain overtakes it; its shorter prefix is not listed on its own
    store, ns = admin.store, admin.store.namespace()
    for _ in range(2):
        slots, _ = fill_and_commit(store, ns, tokens_for(2, 2))   # doc B, promoted from cold
        store.release(slots)
    _, got = await admin.get("/v1/prefixes?limit=1")
    assert len(got["prefixes"]) == 1
    doc_b = page_keys(ns, tokens_for(2, 2), PS)
    assert got["prefixes"][0]["key"] == doc_b[-1].hex() and got["prefixes"][0]["hits"] == 2
    _, got = await admin.get("/v1/prefixes")
    assert [p["key"] for p in got["prefixes"]] == [doc_b[-1].hex(), doc_a[-1].hex()]
    assert (await admin.get("/v1/prefixes?limit=0"))[0] == 400


# lookup
async def test_lookup_tokens(admin):
    tokens = tokens_for(1, 4) + [7] * (PS + 3)   # doc A and more
    status, got = await admin.post("/v1/lookup", {"tokens": tokens})
    assert status == 200
    assert got == {"prompt_tokens": len(tokens), "cached_prefix_tokens": 4 * PS, "cached_pages": 4,
                   "tiers": {"hot": 4 * PS, "warm": 0, "cold": 0}, "peers": []}
    _, got = await admin.post("/v1/lookup", {"tokens": tokens_for(2, 2)})
    assert got["tiers"] == {"hot": 0, "warm": 0, "cold": 2 * PS}
    _, got = await admin.post("/v1/lookup", {"tokens": tokens, "tenant": "someone-else"})
    assert got["cached_prefix_tokens"] == 0   # another tenant's namespace
    _, got = await admin.post("/v1/lookup", {"tokens": []})
    assert got["prompt_tokens"] == 0 and got["cached_prefix_tokens"] == 0


@pytest.mark.parametrize("body, message", [
    ({"text": "hello"}, "text lookup needs a model"),
    ({"tokens": [1, 2], "text": "x"}, "exactly one"),
    ({}, "exactly one"),
    ({"tokens": "1 2 3"}, "tokens"),
    ({"tokens": [1, -2]}, "tokens"),
    ({"tokens": [1, 2**31]}, "tokens"),
    ({"tokens": [1, True]}, "tokens"),
    ({"tokens": [1.5]}, "tokens"),
    ({"tokens": [1], "tenant": 5}, "tenant"),
    ({"tokens": [1], "tenant": "t" * 257}, "tenant"),
    ({"tokens": [1], "colour": "red"}, "unknown field"),
])
async def test_lookup_rejects_bad_bodies(admin, body, message):
    status, got = await admin.post("/v1/lookup", body)
    assert status == 400 and message in got["error"]


# operator controls: they change what /v1/pages and /v1/stats show
async def test_pin_and_unpin_by_keys_and_by_prefix(admin):
    doc_a = page_keys(admin.store.namespace(), tokens_for(1, 4), PS)
    status, got = await admin.post("/v1/pin", {"keys": hexes(doc_a[:2]) + ["ab" * 32], "ttl_s": 60})
    assert status == 200 and got == {"requested": 3, "pinned": 2}
    _, listing = await admin.get("/v1/pages?pinned=true")
    assert {p["key"] for p in listing["pages"]} == set(hexes(doc_a[:2]))
    assert all(0 < p["pin_remaining_s"] <= 60 for p in listing["pages"])
    assert (await admin.get("/v1/stats"))[1]["tiers"]["hot"]["pinned_pages"] == 2
    # pinned pages stay in hot through a flush
    _, flushed = await admin.post("/v1/flush", {"tier": "hot"})
    assert flushed == {"tier": "hot", "moved": 2}
    _, hot = await admin.get("/v1/pages?tier=hot")
    assert {p["key"] for p in hot["pages"]} == set(hexes(doc_a[:2]))
    # a prefix by tokens: the cached pages of the prompt (doc A is now in hot and warm)
    _, got = await admin.post("/v1/pin", {"tokens": tokens_for(1, 4) + [1] * PS})
    assert got == {"requested": 5, "pinned": 4}
    _, got = await admin.post("/v1/unpin", {"tokens": tokens_for(1, 4)})
    assert got == {"requested": 4, "unpinned": 4}
    assert (await admin.get("/v1/pages?pinned=true"))[1]["total"] == 0
    _, got = await admin.post("/v1/unpin", {"keys": hexes(doc_a)})
    assert got == {"requested": 4, "unpinned": 0}


async def test_evict_a_prefix_down_and_out(admin):
    tokens = tokens_for(1, 4)
    doc_a = page_keys(admin.store.namespace(), tokens, PS)
    status, got = await admin.post("/v1/evict", {"tokens": tokens, "to": "warm"})
    assert status == 200 and got == {"requested": 4, "moved": 4, "to": "warm"}
    _, page = await admin.get(f"/v1/pages/{doc_a[0].hex()}")
    assert page["tiers"] == ["warm", "cold"]   # its cold copy was written behind at commit
    _, lookup = await admin.post("/v1/lookup", {"tokens": tokens})
    assert lookup["tiers"] == {"hot": 0, "warm": 4 * PS, "cold": 0}
    _, got = await admin.post("/v1/evict", {"keys": hexes(doc_a[2:]), "to": "cold"})
    assert got["moved"] == 2
    _, stats = await admin.get("/v1/stats")
    assert [stats["tiers"][t]["pages"] for t in ("hot", "warm", "cold")] == [0, 3, 7]
    _, got = await admin.post("/v1/evict", {"keys": [doc_a[3].hex()], "to": None})
    assert got["moved"] == 1
    assert (await admin.get(f"/v1/pages/{doc_a[3].hex()}"))[0] == 404
    assert (await admin.get("/v1/stats"))[1]["entries"] == 6


async def test_flush_each_tier(admin):
    for tier, moved in (("hot", 4), ("warm", 5), ("cold", 7)):
        status, got = await admin.post("/v1/flush", {"tier": tier})
        assert status == 200 and got == {"tier": tier, "moved": moved}
        assert (await admin.get(f"/v1/pages?tier={tier}"))[1]["total"] == 0
    assert (await admin.get("/v1/stats"))[1]["entries"] == 0


@pytest.mark.parametrize("path, body", [
    ("/v1/pin", {"keys": ["zz"]}), ("/v1/pin", {"keys": "ab" * 32}), ("/v1/pin", {"keys": [], "tokens": []}),
    ("/v1/pin", {"keys": [], "ttl_s": 0}), ("/v1/pin", {"keys": [], "ttl_s": "5"}),
    ("/v1/pin", {"keys": [], "ttl_s": 1e12}), ("/v1/pin", {"tokens": [1], "ttl_s": True}),
    ("/v1/unpin", {"keys": [], "ttl_s": 5}), ("/v1/unpin", {}),
    ("/v1/evict", {"keys": []}), ("/v1/evict", {"keys": [], "to": "hot"}), ("/v1/evict", {"tokens": [], "to": 3}),
    ("/v1/flush", {}), ("/v1/flush", {"tier": "lukewarm"}), ("/v1/flush", {"tier": "hot", "all": True}),
    ("/v1/flush", {"tier": ["hot"]}),
])
async def test_controls_reject_bad_bodies(admin, path, body):
    status, got = await admin.post(path, body)
    assert status == 400, got
    assert (await admin.get("/v1/stats"))[1]["entries"] == 7   # nothing happened



# config, metrics, dashboard
async def test_config_is_redacted(tmp_path):
    async with running_admin(tmp_path, token=TOKEN) as admin:
        status, config = await admin.get("/v1/config")
        assert status == 200 and config["admin"]["token"] == "<redacted>"
        assert config["page_size"] == PS and config["admin"]["port"] == 0
        assert TOKEN not in json.dumps(config)


async def test_metrics_and_dashboard_are_served(admin):
    status, text, headers = await admin.request("GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert 'kvstore_tier_pages{tier="hot"} 4.0' in text
    status, html, headers = await admin.request("GET", "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert 'id="hot-used-bytes"' not in html   # built by the page's script...
    assert 'data-field="used-bytes"' in html and "v1/stats" in html and "<script" in html
    assert "http://" not in html and "https://" not in html   # ...which loads nothing from elsewhere
