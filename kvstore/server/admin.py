"""The REST admin API (aiohttp): health, stats, pages, prefixes, lookup, pin, evict, flush, config.

    app = create_admin_app(store, daemon, config, engine=llm, metrics=Metrics(store, llm))
    runner = await start_admin(app, config)     # binds admin.host:admin.port (TLS with a cert and key)
    print(admin_url(runner))
    ...
    await runner.cleanup()

Rules:
- every store call runs in the daemon's worker threads (`await daemon.run(...)`), never on the loop;
- when admin.token is set, every path but /healthz, /readyz and / (the dashboard's static page)
  needs `Authorization: Bearer <token>`; start_admin refuses a non-loopback address without one;
- errors are JSON `{"error": "one line"}`: 400 bad input, 401, 404, 405, 409 (the store refused),
  413 (body over admin.max_body_bytes); a 500 is a bug, logged without the request's content;
- logs never hold request bodies, prompt text or token ids: the access log has method, path and status.
The request and response shapes are in openapi.py, served at /openapi.json.
"""

from __future__ import annotations

import hmac
import heapq
import ipaddress
import json
import logging
import re
import ssl
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from kvstore.cluster.node import CLUSTER, add_cluster_routes
from kvstore.config import Config
from kvstore.errors import KVStoreError
from kvstore.index import PageEntry
from kvstore.server import openapi
from kvstore.server.metrics import CONTENT_TYPE, TIERS, Metrics, engine_stats

log = logging.getLogger("kvstore.admin")

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/",
                        "/v1/peer/pages"})   # peers authenticate with cluster.token instead
DASHBOARD = Path(__file__).with_name("dashboard.html")
HEX_KEY = re.compile(openapi.HEX_KEY.strip("^$"))
DEFAULT_PAGES_LIMIT = 100
DEFAULT_PREFIXES_LIMIT = 20


@dataclass
class AdminState:
    store: Any
    daemon: Any
    config: Config
    engine: Any
    metrics: Metrics
    draining: bool = False          # set on shutdown: /readyz answers 503
    scheme: str = "http"
    started: float = field(default_factory=time.monotonic)


STATE = web.AppKey("admin_state", AdminState)


class AdminError(Exception):
    """An error answered as {"error": message} with this status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _fail(message: str, status: int = 400) -> NoReturn:
    raise AdminError(status, message)


def _error(status: int, message: str, headers: dict | None = None) -> web.Response:
    return web.json_response({"error": " ".join(message.split())}, status=status, headers=headers)


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# input
def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


async def _body(request: web.Request, allowed: tuple[str, ...]) -> dict:
    """The request's JSON object, with no field outside `allowed`."""
    raw = await request.read()          # over client_max_size: HTTPRequestEntityTooLarge -> 413
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        _fail("the request body is not valid JSON (a JSON object is expected)")
    if not isinstance(body, dict):
        _fail("the request body must be a JSON object")
    unknown = [k for k in body if k not in allowed]
    if unknown:
        _fail(f"unknown field {_short(unknown[0])}; allowed: {', '.join(allowed)}")
    return body


def _text(value: Any, name: str, max_chars: int | None = None) -> str:
    if not isinstance(value, str):
        _fail(f"{name} must be a string")
    if max_chars is not None and len(value) > max_chars:
        _fail(f"{name} is longer than {max_chars} characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        _fail(f"{name} is not valid Unicode (a lone surrogate)")
    return value


def _integral(value: Any) -> int | None:
    """An integer, or a float with no fraction (JSON Schema's integer), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _tokens(value: Any) -> list[int]:
    if not isinstance(value, list):
        _fail("tokens must be a list of token ids")
    ids = [_integral(t) for t in value]
    if not all(t is not None and 0 <= t <= openapi.MAX_TOKEN_ID for t in ids):
        _fail(f"tokens must be integers in [0, {openapi.MAX_TOKEN_ID}]")
    return ids


def _key(value: Any, name: str = "key") -> bytes:
    if not isinstance(value, str) or not HEX_KEY.fullmatch(value):
        _fail(f"{name} must be 64 hex digits")
    return bytes.fromhex(value)


def _tenant(body: dict) -> str:
    return _text(body.get("tenant", ""), "tenant", openapi.MAX_TENANT_CHARS)


def _keys_or_tokens(body: dict) -> tuple[list[bytes] | None, list[int] | None]:
    """Exactly one of `keys` (page keys) and `tokens` (a prefix)."""
    if ("keys" in body) == ("tokens" in body):
        _fail("give exactly one of keys (page keys, hex) and tokens (a prefix)")
    if "keys" in body:
        if not isinstance(body["keys"], list):
            _fail("keys must be a list of page keys (64 hex digits each)")
        return [_key(k, "each of keys") for k in body["keys"]], None
    return None, _tokens(body["tokens"])


def _query(request: web.Request, allowed: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for name in request.query:
        if name not in allowed:
            _fail(f"unknown query parameter {_short(name)}; allowed: {', '.join(allowed)}")
        values = request.query.getall(name)
        if len(values) > 1:
            _fail(f"query parameter {name} is given {len(values)} times")
        out[name] = values[0]
    return out


def _limit(query: dict[str, str], default: int) -> int:
    raw = query.get("limit")
    if raw is None:
        return default
    if not re.fullmatch(r"[0-9]{1,7}", raw) or not 1 <= int(raw) <= openapi.MAX_LIMIT:
        _fail(f"limit must be an integer in [1, {openapi.MAX_LIMIT}]")
    return int(raw)


# views of the index, built in a worker thread under the store's lock (the index is the store's)
def _page_json(e: PageEntry, now: float, page_size: int) -> dict:
    pinned = e.pinned(now)
    return {"key": e.key.hex(), "parent": e.parent.hex(), "namespace": e.namespace.hex(), "depth": e.depth,
            "tokens": page_size, "tier": e.tier,
            "tiers": [t for t, here in zip(TIERS, (e.hot is not None, e.warm is not None, e.cold)) if here],
            "refcount": e.refcount, "pinned": pinned,
            "pin_remaining_s": round(e.pin_until - now, 3) if pinned else None,
            "hits": e.hits, "last_access": e.last_access, "children": len(e.kids)}


def list_pages(store, tier: str | None, namespace: bytes | None, pinned: bool | None, limit: int,
               cursor: bytes | None) -> dict:
    """Pages matching the filters, in key order, `limit` after `cursor`: O(entries log limit)."""
    with store._lock:
        now = store.index.now()
        entries = store.index.in_tier(tier) if tier else store.index.entries.values()
        matching = [e for e in entries if (namespace is None or e.namespace == namespace)
                    and (pinned is None or e.pinned(now) == pinned)]
        after = matching if cursor is None else [e for e in matching if e.key > cursor]
        chosen = heapq.nsmallest(limit + 1, after, key=lambda e: e.key)
        pages = [_page_json(e, now, store.spec.page_size) for e in chosen[:limit]]
    return {"pages": pages, "next_cursor": pages[-1]["key"] if len(chosen) > limit else None,
            "total": len(matching)}


def get_page(store, key: bytes) -> dict | None:
    with store._lock:
        e = store.index.get(key)
        return None if e is None else _page_json(e, store.index.now(), store.spec.page_size)


def top_prefixes(store, limit: int) -> dict:
    """The most reused prefixes: for each leaf-most page with hits (no child has hits), the chain of
    cached pages back towards the first, ranked by the leaf's hits. O(entries): each page's chain
    summary is computed once, from its parent's."""
    with store._lock:
        entries = store.index.entries
        leaves = [e for e in entries.values()
                  if e.hits and not any(entries[k].hits for k in e.kids if k in entries)]
        top = heapq.nlargest(limit, leaves, key=lambda e: (e.hits, e.depth, e.key))
        chains: dict[bytes, tuple[int, dict[str, int], bool]] = {}   # key -> (pages, tiers, complete)

        def chain(e: PageEntry) -> tuple[int, dict[str, int], bool]:
            path, cur = [], e
            while cur is not None and cur.key not in chains:
                path.append(cur)
                cur = entries.get(cur.parent)
            if cur is not None:
                pages, tiers, complete = chains[cur.key]
            else:   # the topmost cached page: complete if it is the sequence's first
                pages, tiers, complete = 0, dict.fromkeys(TIERS, 0), path[-1].parent == path[-1].namespace
            for p in reversed(path):
                tiers = {**tiers, p.tier: tiers[p.tier] + 1}
                pages += 1
                chains[p.key] = (pages, tiers, complete)
            return chains[e.key]

        prefixes = []
        for e in top:
            pages, tiers, complete = chain(e)
            prefixes.append({"key": e.key.hex(), "namespace": e.namespace.hex(), "pages": pages,
                             "tokens": pages * store.spec.page_size, "hits": e.hits, "complete": complete,
                             "tiers": tiers, "last_access": e.last_access})
    return {"prefixes": prefixes, "page_size": store.spec.page_size}


# handlers
async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    checks = {"store": state.store is not None,   # the store indexes its cold tier when it is built
              "engine": bool(getattr(state.engine, "ready", True)),
              "accepting": not state.draining}
    ready = all(checks.values())
    cluster = request.app.get(CLUSTER)
    return web.json_response({"ready": ready, "checks": checks,
                              "cluster": cluster.index.state if cluster else "disabled"},
                             status=200 if ready else 503)


async def stats(request: web.Request) -> web.Response:
    state = request.app[STATE]
    out = await state.daemon.run(state.store.stats)
    for tier in out["tiers"].values():
        looked = tier["hits"] + tier["misses"]
        tier["hit_rate"] = tier["hits"] / looked if looked else None
    engine = engine_stats(state.engine)
    out.update(engine=engine, queue_depth=engine["waiting"] if engine else 0,
               running=engine["running"] if engine else 0,
               uptime_s=round(time.monotonic() - state.started, 3))
    cluster = request.app.get(CLUSTER)
    if cluster is not None:
        out["cluster"] = cluster.stats()
    return web.json_response(out)


async def pages(request: web.Request) -> web.Response:
    state = request.app[STATE]
    q = _query(request, ("tier", "namespace", "pinned", "limit", "cursor"))
    tier = q.get("tier")
    if tier is not None and tier not in TIERS:
        _fail(f"tier must be one of {', '.join(TIERS)}")
    pinned = q.get("pinned")
    if pinned is not None and pinned not in ("true", "false"):
        _fail("pinned must be true or false")
    namespace = _key(q["namespace"], "namespace") if "namespace" in q else None
    cursor = _key(q["cursor"], "cursor") if "cursor" in q else None
    return web.json_response(await state.daemon.run(
        list_pages, state.store, tier, namespace, None if pinned is None else pinned == "true",
        _limit(q, DEFAULT_PAGES_LIMIT), cursor))


async def page(request: web.Request) -> web.Response:
    state = request.app[STATE]
    key = _key(request.match_info["key"])
    found = await state.daemon.run(get_page, state.store, key)
    if found is None:
        _fail("no page with this key", 404)
    return web.json_response(found)


async def prefixes(request: web.Request) -> web.Response:
    state = request.app[STATE]
    q = _query(request, ("limit",))
    return web.json_response(await state.daemon.run(top_prefixes, state.store, _limit(q, DEFAULT_PREFIXES_LIMIT)))


def _namespace(state: AdminState, tenant: str):
    # as the engine does: with share_across_tenants every tenant sees the shared namespace
    return state.store.namespace("" if state.config.engine.share_across_tenants else tenant)


def _tokenizer(engine: Any):
    return getattr(engine, "tokenizer", None) or getattr(getattr(engine, "llm", None), "tokenizer", None)


async def lookup(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _body(request, ("tokens", "text", "tenant"))
    if ("tokens" in body) == ("text" in body):
        _fail("give exactly one of tokens (token ids) and text")
    tenant = _tenant(body)
    if "tokens" in body:
        tokens = _tokens(body["tokens"])
    else:
        text = _text(body["text"], "text")
        tokenizer = _tokenizer(state.engine)
        if tokenizer is None:
            _fail("text lookup needs a model: this server runs no engine; send tokens")
        tokens = list(await state.daemon.run(tokenizer.encode, text))
    ns = _namespace(state, tenant)
    match = await state.daemon.run(state.store.match, tokens, ns)
    cluster = request.app.get(CLUSTER)
    return web.json_response({"prompt_tokens": len(tokens), "cached_prefix_tokens": match.num_tokens,
                              "cached_pages": match.num_pages,
                              "tiers": {t: n * match.page_size for t, n in match.counts().items()},
                              "peers": await cluster.lookup_peers(tokens, ns) if cluster else []})


async def _target_keys(state: AdminState, body: dict) -> list[bytes]:
    """The pages a pin/unpin/evict request names: its keys, or the cached prefix of its tokens."""
    keys, tokens = _keys_or_tokens(body)
    tenant = _tenant(body)
    if keys is not None:
        return keys
    match = await state.daemon.run(state.store.match, tokens, _namespace(state, tenant))
    return match.keys


def _requested(body: dict, page_size: int) -> int:
    return len(body["keys"]) if "keys" in body else len(body["tokens"]) // page_size


async def pin(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _body(request, ("keys", "tokens", "tenant", "ttl_s"))
    ttl = body.get("ttl_s")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float))
                            or not 0 < ttl <= openapi.MAX_TTL_S):   # NaN and infinity fail the range too
        _fail(f"ttl_s must be a number of seconds in (0, {openapi.MAX_TTL_S}]")
    keys = await _target_keys(state, body)
    pinned = await state.daemon.run(state.store.pin, keys, ttl)
    return web.json_response({"requested": _requested(body, state.store.spec.page_size), "pinned": pinned})


async def unpin(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _body(request, ("keys", "tokens", "tenant"))
    keys = await _target_keys(state, body)
    unpinned = await state.daemon.run(state.store.unpin, keys)
    return web.json_response({"requested": _requested(body, state.store.spec.page_size), "unpinned": unpinned})


async def evict(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _body(request, ("keys", "tokens", "tenant", "to"))
    if "to" not in body or body["to"] not in ("warm", "cold", None):
        _fail("to must be warm (out of hot), cold (out of hot and warm) or null (out of the store)")
    keys = await _target_keys(state, body)
    moved = await state.daemon.run(state.store.evict, keys, body["to"])
    return web.json_response({"requested": _requested(body, state.store.spec.page_size), "moved": moved,
                              "to": body["to"]})


async def flush(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _body(request, ("tier",))
    if body.get("tier") not in TIERS:
        _fail(f"tier must be one of {', '.join(TIERS)}")
    moved = await state.daemon.run(state.store.flush, body["tier"])
    return web.json_response({"tier": body["tier"], "moved": moved})


async def config_view(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].config.to_dict(redact=True))


async def metrics_text(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.Response(body=await state.daemon.run(state.metrics.render), headers={"Content-Type": CONTENT_TYPE})


async def openapi_json(request: web.Request) -> web.Response:
    return web.json_response(openapi.DOCUMENT)


async def dashboard(request: web.Request) -> web.Response:
    return web.Response(body=DASHBOARD.read_bytes(), content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
                                 "Content-Security-Policy": "default-src 'self'; style-src 'unsafe-inline'; "
                                                            "script-src 'unsafe-inline'; img-src data:"})


# middleware
def authorized(request: web.Request, token: str) -> bool:
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("utf-8", "surrogatepass"),
                                                              token.encode("utf-8", "surrogatepass"))


def _log_failure(request: web.Request, exc: BaseException) -> None:
    # the message may quote the request, so only the type and where it was raised
    where = "".join(traceback.format_tb(exc.__traceback__))
    log.error("%s %s failed with %s (message withheld: it may quote the request)\n%s",
              request.method, request.path, type(exc).__name__, where)


@web.middleware
async def guard(request: web.Request, handler) -> web.StreamResponse:
    """Auth first, then every failure as a JSON error."""
    state = request.app[STATE]
    token = state.config.admin.token
    if token and request.path not in OPEN_PATHS and not authorized(request, token):
        return _error(401, "missing or wrong bearer token (Authorization: Bearer <admin.token>)",
                      {"WWW-Authenticate": 'Bearer realm="kvstore-admin"'})
    try:
        return await handler(request)
    except AdminError as exc:
        return _error(exc.status, exc.message)
    except web.HTTPRequestEntityTooLarge:
        return _error(413, f"the request body is over the limit of {state.config.admin.max_body_bytes} bytes "
                           "(admin.max_body_bytes)")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return _error(exc.status, f"{exc.reason}: {request.method} {request.path}", allow)
    except KVStoreError as exc:
        return _error(409, str(exc))
    except Exception as exc:  # noqa: BLE001 - answered 500 and logged
        _log_failure(request, exc)
        return _error(500, "internal server error (logged on the server)")


class AccessLogger(AbstractAccessLogger):
    """Method, path (no query string), status and time: never a request's content."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        self.logger.info("%s %s %s %d %.1f ms", request.remote, request.method, request.path,
                         response.status, time * 1000)


# app and server
def create_admin_app(store, daemon, config: Config, engine: Any = None,
                     metrics: Metrics | None = None) -> web.Application:
    """The admin API over a store and its daemon; `engine` (an LLM or AsyncLLM) adds the queue to
    the stats, text lookups (its tokenizer) and its `ready` flag to /readyz."""
    app = web.Application(client_max_size=config.admin.max_body_bytes, middlewares=[guard])
    app[STATE] = AdminState(store, daemon, config, engine, metrics or Metrics(store, engine))
    add = app.router
    add.add_get("/healthz", healthz)
    add.add_get("/readyz", readyz)
    add.add_get("/", dashboard)
    add.add_get("/v1/stats", stats)
    add.add_get("/v1/pages", pages)
    add.add_get("/v1/pages/{key}", page)
    add.add_get("/v1/prefixes", prefixes)
    add.add_post("/v1/lookup", lookup)
    add.add_post("/v1/pin", pin)
    add.add_post("/v1/unpin", unpin)
    add.add_post("/v1/evict", evict)
    add.add_post("/v1/flush", flush)
    add.add_get("/v1/config", config_view)
    add.add_get("/metrics", metrics_text)
    add.add_get("/openapi.json", openapi_json)
    add_cluster_routes(app, store, daemon)
    return app


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(config: Config) -> None:
    """Raise KVStoreError when the admin API would listen beyond loopback without a token."""
    host = config.admin.host
    if not is_loopback(host) and not config.admin.token:
        raise KVStoreError(f"admin.host = {host!r} is not a loopback address: set admin.token "
                           "(or KVSTORE_ADMIN_TOKEN) to expose the admin API, or bind 127.0.0.1")


def ssl_context(config: Config) -> ssl.SSLContext | None:
    cert, key = config.admin.tls_cert, config.admin.tls_key
    if not cert and not key:
        return None
    if not (cert and key):
        raise KVStoreError("admin.tls_cert and admin.tls_key must be set together to serve HTTPS")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise KVStoreError(f"admin.tls_cert / admin.tls_key: cannot load the certificate and key "
                           f"({getattr(exc, 'strerror', None) or exc})") from None
    return ctx


async def start_admin(app: web.Application, config: Config) -> web.AppRunner:
    """Listen on admin.host:admin.port (0: any free port); HTTPS with admin.tls_cert and tls_key.
    Raises KVStoreError, before binding, for a non-loopback host without admin.token."""
    check_exposure(config)
    tls = ssl_context(config)
    app[STATE].scheme = "https" if tls else "http"
    runner = web.AppRunner(app, access_log_class=AccessLogger, access_log=logging.getLogger("kvstore.admin.access"))
    await runner.setup()
    try:
        await web.TCPSite(runner, config.admin.host, config.admin.port, ssl_context=tls).start()
    except OSError as exc:
        await runner.cleanup()
        raise KVStoreError(f"admin API: cannot listen on {config.admin.host}:{config.admin.port} "
                           f"({exc.strerror or exc})") from None
    return runner


def admin_url(runner: web.AppRunner) -> str:
    """The base URL the admin API listens on (the first bound address)."""
    host, port = runner.addresses[0][:2]
    scheme = runner.app[STATE].scheme
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def set_draining(app: web.Application, draining: bool = True) -> None:
    """Mark the server as shutting down: /readyz answers 503 from now on."""
    app[STATE].draining = draining
