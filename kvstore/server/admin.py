"""The REST admin API (aiohttp): health, stats, pages, prefixes, lookup, pin, evict, flush, config.

    app = create_admin_app(store, config, engine=llm, metrics=Metrics(store, llm))
    runner = await start_admin(app, config)     # binds admin.host:admin.port (TLS with a cert and key)
    print(admin_url(runner))
    ...
    await runner.cleanup()

Rules:
- every store call runs in the store daemon's worker threads (`await store.daemon.run(...)`), never on the loop;
- when admin.token is set, every path but /healthz, /readyz and / (the dashboard's static page)
  needs `Authorization: Bearer <token>`; start_admin refuses a non-loopback address without one;
- errors are JSON `{"error": "one line"}`: 400 bad input, 401, 404, 405, 409 (the store refused),
  413 (body over admin.max_body_bytes); a 500 is a bug, logged without the request's content;
- logs never hold request bodies, prompt text or token ids: the access log has method, path and status.
The request and response shapes are in openapi.py, served at /openapi.json; each request's path
parameters, query and body are validated against its operation there before the handler runs
(validate.py), so handlers read checked values.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import ssl
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from kvstore.cluster.node import CLUSTER, add_cluster_routes, peer_status
from kvstore.config import Config
from kvstore.errors import KVStoreError
from kvstore.server import openapi
from kvstore.server import validate as check
from kvstore.server.validate import AdminError
from kvstore.server.views import get_page, list_pages, remote_state, top_prefixes, write_health
from kvstore.server.history import add_history
from kvstore.server.metrics import CONTENT_TYPE, Metrics, engine_stats

log = logging.getLogger("kvstore.admin")

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/",
                        "/v1/peer/pages"})   # peers authenticate with cluster.token instead
DASHBOARD = Path(__file__).with_name("dashboard.html")
DEFAULT_PAGES_LIMIT = 100
DEFAULT_PREFIXES_LIMIT = 20


@dataclass
class AdminState:
    store: Any
    daemon: Any
    config: Config
    engine: Any
    metrics: Metrics
    model_name: str | None = None   # the model the engine serves, as its API names it
    draining: bool = False          # set on shutdown: /readyz answers 503
    scheme: str = "http"
    started: float = field(default_factory=time.monotonic)


STATE = web.AppKey("admin_state", AdminState)
REQUESTS = web.AppKey("admin_requests", check.Requests)   # the validators, built once per app


# handlers
async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    checks = {"store": state.store is not None,
              "engine": bool(getattr(state.engine, "ready", True)),
              "accepting": not state.draining}
    ready = all(checks.values())
    cluster = request.app.get(CLUSTER)
    writes = await state.daemon.run(write_health, state.store)   # shown, not a condition of readiness
    return web.json_response({"ready": ready, "checks": checks,
                              "cluster": cluster.index.state if cluster else "disabled",
                              "peers": peer_status(cluster),
                              "cold_index": dict(state.store.indexing),
                              "cold": state.store.cold_state(), **writes,
                              "remote": remote_state(state.store)},
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
    q = request[check.QUERY]
    namespace = bytes.fromhex(q["namespace"]) if "namespace" in q else None
    cursor = bytes.fromhex(q["cursor"]) if "cursor" in q else None
    return web.json_response(await state.daemon.run(
        list_pages, state.store, q.get("tier"), namespace, q.get("pinned"), q.get("limit", DEFAULT_PAGES_LIMIT),
        cursor))


async def page(request: web.Request) -> web.Response:
    state = request.app[STATE]
    key = bytes.fromhex(request.match_info["key"])
    found = await state.daemon.run(get_page, state.store, key)
    if found is None:
        check.fail("no page with this key", 404)
    return web.json_response(found)


async def prefixes(request: web.Request) -> web.Response:
    state = request.app[STATE]
    limit = request[check.QUERY].get("limit", DEFAULT_PREFIXES_LIMIT)
    return web.json_response(await state.daemon.run(top_prefixes, state.store, limit))


def _namespace(state: AdminState, tenant: str):
    # as the engine names it (it may share one namespace across tenants), else the store's own
    llm = getattr(state.engine, "llm", state.engine)
    return llm.namespace(tenant) if hasattr(llm, "namespace") else state.store.namespace(tenant)


def _tokenizer(engine: Any):
    return getattr(engine, "tokenizer", None) or getattr(getattr(engine, "llm", None), "tokenizer", None)


async def lookup(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = request[check.BODY]
    if "tokens" in body:
        tokens = [int(t) for t in body["tokens"]]   # JSON Schema's integers include 2.0
    else:
        tokenizer = _tokenizer(state.engine)
        if tokenizer is None:
            check.fail("text lookup needs a model: this server runs no engine; send tokens")
        tokens = list(await state.daemon.run(tokenizer.encode, body["text"]))
    ns = _namespace(state, body.get("tenant", ""))
    match = await state.daemon.run(state.store.match, tokens, ns)
    cluster = request.app.get(CLUSTER)
    return web.json_response({"prompt_tokens": len(tokens), "cached_prefix_tokens": match.num_tokens,
                              "cached_pages": match.num_pages,
                              "tiers": {t: n * match.page_size for t, n in match.counts().items()},
                              "peers": await cluster.lookup_peers(tokens, ns) if cluster else []})


async def _target_keys(state: AdminState, body: dict) -> list[bytes]:
    """The pages a pin/unpin/evict request names: its keys, or the cached prefix of its tokens."""
    if "keys" in body:
        return [bytes.fromhex(k) for k in body["keys"]]
    tokens = [int(t) for t in body["tokens"]]
    match = await state.daemon.run(state.store.match, tokens, _namespace(state, body.get("tenant", "")))
    return match.keys


def _requested(body: dict, page_size: int) -> int:
    return len(body["keys"]) if "keys" in body else len(body["tokens"]) // page_size


async def pin(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = request[check.BODY]
    keys = await _target_keys(state, body)
    pinned = await state.daemon.run(state.store.pin, keys, body.get("ttl_s"))
    return web.json_response({"requested": _requested(body, state.store.spec.page_size), "pinned": pinned})


async def unpin(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = request[check.BODY]
    keys = await _target_keys(state, body)
    unpinned = await state.daemon.run(state.store.unpin, keys)
    return web.json_response({"requested": _requested(body, state.store.spec.page_size), "unpinned": unpinned})


async def evict(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = request[check.BODY]
    keys = await _target_keys(state, body)
    moved = await state.daemon.run(state.store.evict, keys, body["to"])
    return web.json_response({"requested": _requested(body, state.store.spec.page_size), "moved": moved,
                              "to": body["to"]})


async def flush(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = request[check.BODY]
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
    """Auth first, then the request's inputs against its operation in the OpenAPI document, then
    every failure as a JSON error."""
    state = request.app[STATE]
    token = state.config.admin.token
    if token and request.path not in OPEN_PATHS and not authorized(request, token):
        return check.error(401, "missing or wrong bearer token (Authorization: Bearer <admin.token>)",
                      {"WWW-Authenticate": 'Bearer realm="kvstore-admin"'})
    try:
        await request.app[REQUESTS].check(request)
        return await handler(request)
    except AdminError as exc:
        return check.error(exc.status, exc.message)
    except web.HTTPRequestEntityTooLarge:
        return check.error(413, f"the request body is over the limit of {state.config.admin.max_body_bytes} bytes "
                           "(admin.max_body_bytes)")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return check.error(exc.status, f"{exc.reason}: {request.method} {request.path}", allow)
    except KVStoreError as exc:
        return check.error(409, str(exc))
    except Exception as exc:  # noqa: BLE001 - answered 500 and logged
        _log_failure(request, exc)
        return check.error(500, "internal server error (logged on the server)")


class AccessLogger(AbstractAccessLogger):
    """Method, path (no query string), status and time: never a request's content."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        self.logger.info("%s %s %s %d %.1f ms", request.remote, request.method, request.path,
                         response.status, time * 1000)


# app and server
def create_admin_app(store, config: Config, engine: Any = None,
                     metrics: Metrics | None = None, model_name: str | None = None) -> web.Application:
    """The admin API over a store (its calls run on the store daemon's worker threads); `engine` (an
    LLM or AsyncLLM) adds the queue to the stats, text lookups (its tokenizer) and its `ready` flag
    to /readyz; `model_name` is the model as its API names it (default: the engine's)."""
    llm = getattr(engine, "llm", engine)
    model_name = model_name or getattr(llm, "model_name", None)
    app = web.Application(client_max_size=config.admin.max_body_bytes, middlewares=[guard])
    app[STATE] = AdminState(store, store.daemon if store is not None else None, config, engine,
                            metrics or Metrics(store, engine), model_name)
    app[REQUESTS] = check.Requests(openapi.DOCUMENT)
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
    add_cluster_routes(app, store)
    add_history(app, app[STATE])   # GET /v1/history and its sampler, running while the app does
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
