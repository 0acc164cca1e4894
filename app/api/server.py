"""OpenAI-compatible HTTP API over AsyncLLM, with vLLM's extensions and endpoints: the server (its
requests are app.api.models, parsed by app.api.parsing, its endpoints app.api.handlers, its
responses app.api.responses).

Endpoints: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize (vLLM's
shapes), /version, /health, /metrics (when given the Metrics), /openapi.json (this API's requests
as JSON Schema, from app.api.models).

Requests are typed (app.api.models): a field this server does not describe is refused with
400 naming it, never ignored. Sampling follows OpenAI and vLLM (the default temperature is 1.0):
top_k, min_p, presence/frequency/repetition penalties, logit_bias, seed, stop, stop_token_ids,
ignore_eos, priority, logprobs, echo (completions; with logprobs, the prompt's tokens get theirs
too, the first none, as in vLLM), return_token_ids (each choice also carries `token_ids`, the
response `prompt_token_ids`). A list of prompts and `n` > 1 run as separate engine requests; with a seed,
sample j of a prompt uses seed + j. The `model` field may be left out; a model other than the
served one is 404, as in OpenAI.

Authentication and tenants (the namespace whose cached prefixes no other tenant sees): with API
keys (server.api_key, server.api_keys), every endpoint but /health, /version, /metrics and
/openapi.json needs `Authorization: Bearer KEY` (401 otherwise), and a request's tenant is its
key's (server.api_key: the default tenant ""). The `user` field is only recorded (access log).
The X-Tenant header chooses the tenant only with server.trust_tenant_header (a gateway that
authenticates users itself); otherwise a header naming another tenant is refused (403).

Limits are checked as vLLM checks them: a prompt with `max_tokens` past the model's context
(`max_model_len` in /v1/models) is refused, not cut short. Left out, `max_tokens` is what fits in
the context (a completion's: at most 16, OpenAI's default).

Errors are OpenAI's error JSON: 400 for what the client can fix, 401/403 for keys and tenants, 404
for another model, 413 for a body over the limit, 429 with Retry-After when the engine's queue is
full, 500 (logged) for anything else. A request whose client disconnects is aborted, its pages
released (the access log shows 499). Logs never hold request content: no prompt, message, token
id or generated text.
"""

from __future__ import annotations

import hmac
import logging

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from app.api import handlers
from app.api.config import ServerConfig
from app.api.errors import ApiError, errors
from app.api.parsing import text
from app.api.state import ENGINE, MAX_BODY, METRICS, SERVED, STATE, TENANT, USER, Served, ServerState
from engine import AsyncLLM, SamplingParams
from kvstore.server.metrics import Metrics

DEFAULT_MAX_BODY_BYTES = 16 << 20
WARM_UP_LENGTHS = (8, 64, 200)  # prompt tokens
WARM_UP_TEXT = "The quick brown fox jumps over the lazy dog. "
OPEN_PATHS = ("/health", "/version", "/metrics", "/openapi.json")   # no API key needed, as in vLLM


@web.middleware
async def authenticate(request: web.Request, handler) -> web.StreamResponse:
    """The request's tenant (request[TENANT]): its API key's; 401 without a valid key when keys are set."""
    if request.path in OPEN_PATHS:
        return await handler(request)
    served = request.app[SERVED]
    tenant = ""
    if served.keys:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        presented = given.strip().encode("utf-8", "surrogateescape")
        matched = [t for k, t in served.keys.items() if hmac.compare_digest(k, presented)]   # every key, no early exit
        if scheme.lower() != "bearer" or not matched:
            raise ApiError(401, "a valid API key is required: send the header Authorization: Bearer KEY",
                           type="invalid_request_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        tenant = matched[0]
    header = request.headers.get("X-Tenant")
    if header is not None:
        header = text(header, "the X-Tenant header", "X-Tenant")
        if served.trust_tenant_header:
            tenant = header
        elif header != tenant:
            raise ApiError(403, "the X-Tenant header names another tenant than this request's: the tenant is the API "
                                "key's (server.api_keys); X-Tenant is honoured only with server.trust_tenant_header",
                           "X-Tenant", type="invalid_request_error", code="tenant_forbidden")
    request[TENANT] = tenant
    return await handler(request)


class AccessLogger(AbstractAccessLogger):
    """Method, path (no query string), status, time, tenant and `user`: never a request's content."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        self.logger.info("%s %s %s %d %.1f ms tenant=%r user=%r", request.remote, request.method, request.path,
                         response.status, time * 1000, request.get(TENANT), request.get(USER))


def api_runner(app: web.Application, **kwargs) -> web.AppRunner:
    """The runner the API is served with: a handler is cancelled when its client disconnects
    (aiohttp's AppRunner does not do that by default), so a request nobody waits for is aborted
    and its pages are released, streamed or not."""
    kwargs.setdefault("access_log_class", AccessLogger)
    kwargs.setdefault("access_log", logging.getLogger("kvstore.api.access"))
    return web.AppRunner(app, handler_cancellation=True, **kwargs)


def create_app(engine: AsyncLLM, server: ServerConfig | None = None, metrics: Metrics | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> web.Application:
    """The API over a started AsyncLLM, as `server` configures it (default: the server section of the
    engine's config when its tree has one, as app.api.config's has, else the defaults).
    /health answers 503 until warm_up(engine, app) is done; /metrics exists when `metrics` is given."""
    app = web.Application(client_max_size=max_body_bytes, middlewares=[errors, authenticate])
    app[ENGINE], app[STATE], app[MAX_BODY] = engine, ServerState(), max_body_bytes
    app[SERVED] = Served.of(engine.llm, server or getattr(engine.llm.config, "server", None) or ServerConfig())
    add = app.router
    add.add_post("/v1/completions", handlers.completions)
    add.add_post("/v1/chat/completions", handlers.chat_completions)
    add.add_get("/v1/models", handlers.models)
    add.add_get("/v1/models/{model}", handlers.models)
    add.add_post("/tokenize", handlers.tokenize)
    add.add_post("/detokenize", handlers.detokenize)
    add.add_get("/version", handlers.version)
    add.add_get("/health", handlers.health)
    add.add_get("/openapi.json", handlers.openapi)
    if metrics is not None:
        app[METRICS] = metrics
        add.add_get("/metrics", handlers.metrics_text)
    return app


async def warm_up(engine: AsyncLLM, app: web.Application | None = None) -> None:
    """A few short requests (prompts of 8, 64 and 200 tokens, 2 new tokens each), so the first
    user request pays for no lazy initialisation; then `app`'s /health reports ready."""
    llm = engine.llm
    text_ids = llm.tokenizer.encode(WARM_UP_TEXT * (max(WARM_UP_LENGTHS) // 4))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for n in sorted({min(n, llm.max_seq_len - 3, len(text_ids)) for n in WARM_UP_LENGTHS}):
        if n >= 1:
            async for _ in engine.generate(text_ids[:n], params, tenant="warm-up"):
                pass
    if app is not None:
        app[STATE].ready = True
