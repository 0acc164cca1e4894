"""OpenAI-compatible HTTP API over AsyncLLM, with vLLM's extensions and endpoints: the server (its
requests are engine.openai_models, its responses engine.openai_responses).

Endpoints: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize (vLLM's
shapes), /version, /health, /metrics (when given the Metrics), /openapi.json (this API's requests
as JSON Schema, from engine.openai_models).

Requests are typed (engine.openai_models): a field this server does not describe is refused with
400 naming it, never ignored. Sampling follows OpenAI and vLLM (the default temperature is 1.0):
top_k, min_p, presence/frequency/repetition penalties, logit_bias, seed, stop, stop_token_ids,
ignore_eos, priority, logprobs, echo (completions; not with logprobs: prompt logprobs are not
computed), return_token_ids (each choice also carries `token_ids`, the response
`prompt_token_ids`). A list of prompts and `n` > 1 run as separate engine requests; with a seed,
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

import asyncio
import dataclasses
import hmac
import json
import logging
import math
import time
import traceback
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from engine import AsyncLLM, InvalidRequest, QueueFull, RequestOutput, SamplingParams
from engine.openai_models import (SHAPES, ChatMessage, ChatRequest, CompletionRequest, DetokenizeRequest,
                                  InvalidBody, M, Sampling, TokenizeChat, TokenizeCompletion, openapi_document, parse)
from engine.openai_responses import Choice, Job, final_choice, usage
from engine.request import StepFailed
from engine.tokenizer import check_text
from kvstore import __version__
from engine.config import ServerConfig
from kvstore.server.metrics import CONTENT_TYPE, Metrics

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 << 20
MAX_CHOICES = 64                # prompts x n in one request
COMPLETION_MAX_TOKENS = 16      # a completion's max_tokens when left out (OpenAI's), if it fits
CLIENT_CLOSED = 499             # the status logged for a request whose client went away (nginx's)
WARM_UP_LENGTHS = (8, 64, 200)  # prompt tokens
WARM_UP_TEXT = "The quick brown fox jumps over the lazy dog. "
OPEN_PATHS = ("/health", "/version", "/metrics", "/openapi.json")   # no API key needed, as in vLLM
ENGINE_STOPPED = "the engine stopped after an internal error; restart the server"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


@dataclass
class ServerState:
    ready: bool = False         # warm-up done: /health answers 200
    started: int = dataclasses.field(default_factory=lambda: int(time.time()))


@dataclass(frozen=True)
class Served:
    """What the API answers as, and to whom: the model id and root, the API keys and their tenants."""

    name: str
    root: str
    keys: dict[bytes, str]          # API key -> tenant; empty: no key needed, every request in tenant ""
    trust_tenant_header: bool = False

    @classmethod
    def of(cls, llm, server: ServerConfig) -> "Served":
        keys = {k.encode(): t for k, t in server.api_keys.items()}
        if server.api_key:
            keys.setdefault(server.api_key.encode(), "")
        return cls(server.served_model_name or llm.model_name, llm.config.model, keys, server.trust_tenant_header)


ENGINE = web.AppKey("engine", AsyncLLM)
STATE = web.AppKey("state", ServerState)
SERVED = web.AppKey("served", Served)
METRICS = web.AppKey("metrics", Metrics)
MAX_BODY = web.AppKey("max_body_bytes", int)
TENANT = web.RequestKey("tenant", str)     # the authenticated tenant
USER = web.RequestKey("user", str)         # the `user` field, recorded in the access log


class ApiError(Exception):
    """An error answered as OpenAI's error JSON."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers

    def response(self) -> web.Response:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return web.json_response({"error": error}, status=self.status, headers=self.headers)


# parsing
def _text(value: str, name: str, param: str) -> str:
    """A string of the request that is tokenized or hashed: 400 naming it when not valid Unicode."""
    try:
        return check_text(value, name)
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), param) from None


def _given(value, default):
    return default if value is None else value


def _params(req: Sampling, max_tokens: int, logprobs: int | None, max_tokens_field: str) -> SamplingParams:
    stop = _given(req.stop, [])
    stops = [stop] if isinstance(stop, str) else stop
    for i, s in enumerate(stops):
        _text(s, "stop" if isinstance(stop, str) else f"stop[{i}]", "stop")
    params = SamplingParams(
        max_tokens=max_tokens, temperature=_given(req.temperature, 1.0),
        top_k=0 if req.top_k == -1 else _given(req.top_k, 0),     # vLLM's -1: off
        top_p=_given(req.top_p, 1.0), min_p=_given(req.min_p, 0.0), seed=req.seed, stop=stops,
        stop_token_ids=_given(req.stop_token_ids, []), logprobs=logprobs, ignore_eos=_given(req.ignore_eos, False),
        presence_penalty=_given(req.presence_penalty, 0.0), frequency_penalty=_given(req.frequency_penalty, 0.0),
        repetition_penalty=_given(req.repetition_penalty, 1.0), logit_bias=_given(req.logit_bias, {}))
    try:
        return params.validate()
    except InvalidRequest as exc:
        message = str(exc).replace("max_tokens", max_tokens_field, 1)
        raise ApiError(400, message, message.split(" = ", 1)[0].split("[", 1)[0]) from None


def _fit_context(given: int | None, field: str, prompts: list[list[int]], context: int, where: str,
                 default: int | None) -> int:
    """max_tokens: the given one, else `default` (None: no limit) cut to what fits in the context
    after the longest prompt. 400, as vLLM answers, when the prompt leaves no room or the given
    max_tokens does not fit (one below 1 is left to SamplingParams.validate)."""
    longest = max(len(p) for p in prompts)
    intro = f"This model's maximum context length is {context} tokens. However, you requested"
    if longest >= context:
        raise ApiError(400, f"{intro} {longest} tokens in the {where}, which leaves none for the completion. "
                            f"Please reduce the length of the {where}.", where)
    if given is not None:
        if given >= 1 and longest + given > context:
            raise ApiError(400, f"{intro} {longest + given} tokens ({longest} in the {where}, {given} in the "
                                f"completion). Please reduce the length of the {where} or completion.", field)
        return given
    room = context - longest
    return room if default is None else min(default, room)


def _job(request: web.Request, req: Sampling, prompts: list[list[int]], max_tokens: int, logprobs: int | None,
         max_tokens_field: str = "max_tokens") -> Job:
    """The fields that completions and chat share."""
    params = _params(req, max_tokens, logprobs, max_tokens_field)
    n = _given(req.n, 1)
    if n < 1:
        raise ApiError(400, f"n = {n}: must be an integer >= 1", "n")
    if len(prompts) * n > MAX_CHOICES:
        raise ApiError(400, f"{len(prompts)} prompts x n = {n}: at most {MAX_CHOICES} choices per request", "n")
    if req.user is not None:
        request[USER] = _text(req.user, "user", "user")     # recorded in the access log, nothing more
    return Job(prompts=prompts, params=params, n=n, stream=_given(req.stream, False),
               include_usage=bool(req.stream_options and req.stream_options.include_usage),
               return_token_ids=_given(req.return_token_ids, False), tenant=request[TENANT],
               priority=_given(req.priority, 0))


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


async def _body(request: web.Request) -> dict:
    """The JSON object of the request body."""
    raw = await request.read()          # over client_max_size: HTTPRequestEntityTooLarge -> 413
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc})") from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON (nested too deeply)") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _check_model(request: web.Request, model: str | None) -> None:
    """404 as OpenAI answers it when the request names a model this server does not serve."""
    served = request.app[SERVED].name
    if model is not None and model != served:
        raise ApiError(404, f"The model {model!r} does not exist: this server serves {served!r}.", "model",
                       code="model_not_found")


async def _request(request: web.Request, model: type[M] | Callable[[dict], type[M]]) -> M:
    """The request body as `model` (or as the model `model(body)` chooses), naming the served model
    (or none)."""
    body = await _body(request)
    try:
        parsed = parse(model if isinstance(model, type) else model(body), body)
    except InvalidBody as exc:
        raise ApiError(400, str(exc), exc.param) from None
    _check_model(request, parsed.model)
    return parsed


def _prompts(tok, value) -> list[list[int]]:
    """`prompt` (a string, a list of token ids, or a list of those; typed by CompletionRequest) as
    token id lists."""
    prompts = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else value
    if not prompts or not all(prompts):
        raise ApiError(400, "prompt must not be empty", "prompt")
    return [tok.encode(_text(p, "prompt" if len(prompts) == 1 else f"prompt[{i}]", "prompt"))
            if isinstance(p, str) else p for i, p in enumerate(prompts)]


def _chat_text(llm, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
    """`messages` rendered by the model's chat template."""
    turns = []
    for i, m in enumerate(messages):
        if m.content is None and m.role != "assistant":
            raise ApiError(400, f"messages[{i}] {SHAPES['messages[]']}", f"messages[{i}]")
        content = _text(m.text(), f"messages[{i}].content", f"messages[{i}]")
        turns.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return llm.tokenizer.apply_chat_template(turns, add_generation_prompt=add_generation_prompt)


# running
async def _pump(index: int, stream: AsyncIterator[RequestOutput], queue: asyncio.Queue) -> None:
    async with aclosing(stream):
        try:
            async for out in stream:
                queue.put_nowait((index, out))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((index, exc))
            return
    queue.put_nowait((index, None))


async def _merged(streams: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, cumulative output) from every engine stream as they come; raises the first
    error. Closing it (also when the handler is cancelled because its client left: see api_runner)
    closes every stream, which aborts the engine requests still running."""
    queue: asyncio.Queue = asyncio.Queue()
    pumps = [asyncio.create_task(_pump(i, s, queue)) for i, s in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for p in pumps:
            p.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


# answering
async def _answer(request: web.Request, job: Job, chat: bool) -> web.StreamResponse:
    engine = request.app[ENGINE]
    if engine.error is not None:
        raise ApiError(503, ENGINE_STOPPED, type="server_error", code="engine_stopped")
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": request.app[SERVED].name}
    streams = [engine.generate(prompt, params, tenant=job.tenant, request_id=f"{rid}-{i}", priority=job.priority)
               for i, (prompt, params) in enumerate(job.requests())]
    async with aclosing(_merged(streams)) as outputs:
        if job.stream:
            head["object"] += ".chunk" if chat else ""
            return await _stream(request, job, chat, head, outputs, len(streams))
        last: dict[int, RequestOutput] = {}
        async for i, out in outputs:
            last[i] = out
    outs = [last[i] for i in range(len(streams))]
    tok = engine.llm.tokenizer
    body = {**head, "choices": [final_choice(i, o, job, chat, tok) for i, o in enumerate(outs)],
            "usage": usage(outs, job.n)}
    if job.return_token_ids:
        prompt_ids = [o.prompt_token_ids for o in outs[::job.n]]
        body["prompt_token_ids"] = prompt_ids[0] if len(prompt_ids) == 1 else prompt_ids
    return web.json_response(body)


async def _send(resp: web.StreamResponse, data: dict | str) -> None:
    await resp.write(b"data: " + (data if isinstance(data, str) else json.dumps(data)).encode() + b"\n\n")


async def _open_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    return resp


async def _stream(request: web.Request, job: Job, chat: bool, head: dict, outputs, count: int) -> web.StreamResponse:
    """Server-sent events: a chunk per text delta, the usage chunk if asked, then [DONE]. The response
    starts once every choice has its first token, so a refused request still gets its status code."""
    choices = [Choice(i, job, chat, request.app[ENGINE].llm.tokenizer) for i in range(count)]
    resp, pending = None, []

    async def flush() -> None:
        for chunk in pending:
            await _send(resp, {**head, "choices": [chunk]})
        pending.clear()

    try:
        async for i, out in outputs:
            chunk = choices[i].chunk(out)
            pending += [chunk] if chunk else []
            if resp is None and all(c.last is not None for c in choices):
                resp = await _open_sse(request)
            if resp is not None:
                await flush()
        resp = resp if resp is not None else await _open_sse(request)
        await flush()
        if job.include_usage:
            await _send(resp, {**head, "choices": [], "usage": usage([c.last for c in choices], job.n)})
        await _send(resp, "[DONE]")
    except ConnectionResetError:        # the client went away
        return resp if resp is not None else web.Response(status=CLIENT_CLOSED)
    except Exception as exc:
        if resp is None:
            raise
        if not isinstance(exc, StepFailed):
            _log_failure(request, exc)
        message = str(exc) if isinstance(exc, StepFailed) else "internal server error"
        await _send(resp, {"error": {"message": message, "type": "server_error", "param": None, "code": None}})
    return resp


# handlers
async def completions(request: web.Request) -> web.StreamResponse:
    req = await _request(request, CompletionRequest)
    llm = request.app[ENGINE].llm
    if req.echo and req.logprobs is not None:
        raise ApiError(400, "echo with logprobs: prompt logprobs are not computed by this server; "
                            "leave out one of them", "echo")
    logprobs = req.logprobs     # its range is SamplingParams.validate()'s
    prompts = _prompts(llm.tokenizer, req.prompt)
    max_tokens = _fit_context(req.max_tokens, "max_tokens", prompts, llm.max_seq_len, "prompt", COMPLETION_MAX_TOKENS)
    job = _job(request, req, prompts, max_tokens, logprobs)
    if req.echo:
        texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt if isinstance(req.prompt[0], str) \
            else None
        job.echo = texts or [llm.tokenizer.decode(p) for p in prompts]
    return await _answer(request, job, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    req = await _request(request, ChatRequest)
    llm = request.app[ENGINE].llm
    ids = llm.tokenizer.encode(_chat_text(llm, req.messages), add_bos=False)   # the template holds its specials
    top = _given(req.top_logprobs, 0)
    if not 0 <= top <= 20:
        raise ApiError(400, f"top_logprobs = {top}: must be an integer in [0, 20]", "top_logprobs")
    logprobs = top if req.logprobs else None
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    given = _given(req.max_completion_tokens, req.max_tokens)
    max_tokens = _fit_context(given, field, [ids], llm.max_seq_len, "messages", None)
    return await _answer(request, _job(request, req, [ids], max_tokens, logprobs, field), chat=True)


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: a prompt, or chat messages through the template."""
    req = await _request(request, lambda body: TokenizeChat if "messages" in body else TokenizeCompletion)
    llm = request.app[ENGINE].llm
    if isinstance(req, TokenizeChat):
        text = _chat_text(llm, req.messages, req.add_generation_prompt)
    else:
        text = _text(req.prompt, "prompt", "prompt")
    ids = llm.tokenizer.encode(text, add_bos=req.add_special_tokens)
    return web.json_response({"count": len(ids), "max_model_len": llm.max_seq_len, "tokens": ids,
                              "token_strs": llm.tokenizer.token_strs(ids) if req.return_token_strs else None})


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's /detokenize: token ids to text."""
    req = await _request(request, DetokenizeRequest)
    llm = request.app[ENGINE].llm
    vocab = llm.loaded.shape.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(400, f"tokens: {bad} is not a token id of this model (ids are in [0, {vocab}))", "tokens")
    return web.json_response({"prompt": llm.tokenizer.decode(req.tokens)})


async def models(request: web.Request) -> web.Response:
    llm, state, served = request.app[ENGINE].llm, request.app[STATE], request.app[SERVED]
    card = {"id": served.name, "object": "model", "created": state.started, "owned_by": "kvstore",
            "root": served.root, "parent": None, "max_model_len": llm.max_seq_len,
            "permission": [{"id": f"modelperm-{served.name}", "object": "model_permission", "created": state.started,
                            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                            "organization": "*", "group": None, "is_blocking": False}]}
    if "model" in request.match_info:
        _check_model(request, request.match_info["model"])
        return web.json_response(card)
    return web.json_response({"object": "list", "data": [card]})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def metrics_text(request: web.Request) -> web.Response:
    """The Prometheus metrics, as on the admin API (vLLM serves them on its API port)."""
    body = await asyncio.to_thread(request.app[METRICS].render)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


async def health(request: web.Request) -> web.Response:
    if request.app[ENGINE].error is not None:
        return web.json_response({"status": ENGINE_STOPPED}, status=503)
    if not request.app[STATE].ready:
        return web.json_response({"status": "warming up"}, status=503)
    return web.json_response({"status": "ok"})


def _log_failure(request: web.Request, exc: BaseException | None) -> None:
    # messages may quote the request (text, token ids), so only the types and where they were raised
    chain = []
    while exc is not None and len(chain) < 4:
        chain.append(f"{type(exc).__name__}, raised at:\n" + "".join(traceback.format_tb(exc.__traceback__)))
        exc = exc.__cause__ or exc.__context__
    log.error("%s %s failed (exception messages withheld: they may quote the request): %s",
              request.method, request.path, "caused by ".join(chain))


@web.middleware
async def errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except InvalidRequest as exc:
        return ApiError(400, str(exc)).response()
    except StepFailed as exc:   # logged by the engine, with its traceback
        return ApiError(500, f"{exc} (this request was failed; the server goes on)", type="server_error",
                        code="engine_step_failed").response()
    except QueueFull as exc:
        retry = max(1, math.ceil(exc.retry_after_s))
        return ApiError(429, str(exc), type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(retry), "Retry-After-Ms": str(int(exc.retry_after_s * 1000))}
                        ).response()
    except web.HTTPRequestEntityTooLarge:
        return ApiError(413, f"the request body is over the limit of {request.app[MAX_BODY]} bytes",
                        code="request_too_large").response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}",
                        code=exc.reason.lower().replace(" ", "_")).response()
    except Exception as exc:  # noqa: BLE001 - answered 500 and logged
        _log_failure(request, exc)
        return ApiError(500, "internal server error (logged on the server)", type="server_error").response()


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
        header = _text(header, "the X-Tenant header", "X-Tenant")
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
    """The API over a started AsyncLLM, as `server` configures it (default: the engine's config).
    /health answers 503 until warm_up(engine, app) is done; /metrics exists when `metrics` is given."""
    app = web.Application(client_max_size=max_body_bytes, middlewares=[errors, authenticate])
    app[ENGINE], app[STATE], app[MAX_BODY] = engine, ServerState(), max_body_bytes
    app[SERVED] = Served.of(engine.llm, server or engine.llm.config.server)
    add = app.router
    add.add_post("/v1/completions", completions)
    add.add_post("/v1/chat/completions", chat_completions)
    add.add_get("/v1/models", models)
    add.add_get("/v1/models/{model}", models)
    add.add_post("/tokenize", tokenize)
    add.add_post("/detokenize", detokenize)
    add.add_get("/version", version)
    add.add_get("/health", health)
    add.add_get("/openapi.json", openapi)
    if metrics is not None:
        app[METRICS] = metrics
        add.add_get("/metrics", metrics_text)
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
