"""OpenAI-compatible HTTP API over AsyncLLM: /v1/completions, /v1/chat/completions, /v1/models, /health.

Request fields follow OpenAI's (the default temperature is 1.0, as there). Extensions, as in vLLM:
top_k, stop_token_ids, ignore_eos, priority, and return_token_ids (each choice also carries
`token_ids`, the response `prompt_token_ids`). A list of prompts and `n` > 1 run as separate
engine requests; with a seed, sample j of a prompt uses seed + j. The tenant (whose cached
prefixes no other tenant sees) is the `X-Tenant` header, else the `user` field. The `model`
field may be left out; when given it must name the served model.

Limits are checked as vLLM checks them: a prompt with `max_tokens` past the model's context
(`max_model_len` in /v1/models) is refused, not cut short. Left out, `max_tokens` is what fits in
the context (a completion's: at most 16, OpenAI's default).

Errors are OpenAI's error JSON: 400 for what the client can fix, 413 for a body over the limit,
429 with Retry-After when the engine's queue is full, 500 (logged) for anything else. A request
whose client disconnects is aborted, its pages released (the access log shows 499). Logs never
hold request content: no prompt, message, token id or generated text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
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

from engine import AsyncLLM, InvalidRequest, QueueFull, RequestOutput, SamplingParams
from engine.request import StepFailed
from engine.tokenizer import check_text

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 << 20
MAX_CHOICES = 64                # prompts x n in one request
COMPLETION_MAX_TOKENS = 16      # a completion's max_tokens when left out (OpenAI's), if it fits
CLIENT_CLOSED = 499             # the status logged for a request whose client went away (nginx's)
WARM_UP_LENGTHS = (8, 64, 200)  # prompt tokens
WARM_UP_TEXT = "The quick brown fox jumps over the lazy dog. "
ROLES = ("system", "developer", "user", "assistant", "tool")
# request fields this server does not implement: accepted only with their neutral value
UNSUPPORTED = {"echo": (False,), "suffix": ("",), "best_of": (1,), "presence_penalty": (0,),
               "frequency_penalty": (0,), "logit_bias": ({},), "tools": ([],), "functions": ([],),
               "response_format": ({"type": "text"},)}
ENGINE_STOPPED = "the engine stopped after an internal error; restart the server"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


@dataclass
class ServerState:
    ready: bool = False         # warm-up done: /health answers 200
    started: int = dataclasses.field(default_factory=lambda: int(time.time()))


ENGINE = web.AppKey("engine", AsyncLLM)
STATE = web.AppKey("state", ServerState)
MAX_BODY = web.AppKey("max_body_bytes", int)


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
@dataclass
class Job:
    """One API request, parsed: the engine requests to run and how to answer."""

    prompts: list[str | list[int]]
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    return_token_ids: bool
    tenant: str
    priority: int

    def requests(self) -> list[tuple[str | list[int], SamplingParams]]:
        """(prompt, params) per choice: choice p * n + j is sample j of prompt p."""
        def sample(j: int) -> SamplingParams:
            seed = self.params.seed
            return self.params if j == 0 or seed is None else dataclasses.replace(self.params, seed=seed + j)
        return [(prompt, sample(j)) for prompt in self.prompts for j in range(self.n)]


_INT = (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer")
_BOOL = (lambda v: isinstance(v, bool), "true or false")
_STR = (lambda v: isinstance(v, str), "a string")
_DICT = (lambda v: isinstance(v, dict), "an object")


def _short(value) -> str:
    try:
        text = json.dumps(value) if not isinstance(value, str) else repr(value)
    except RecursionError:
        text = f"(a {type(value).__name__} nested too deeply to show)"
    return text if len(text) <= 40 else text[:37] + "..."


def _text(value: str, name: str, param: str) -> str:
    """A string of the request that is tokenized or hashed: 400 naming it when not valid Unicode."""
    try:
        return check_text(value, name)
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), param) from None


def _opt(body: dict, name: str, default, check: Callable | None = None, allowed: str = ""):
    """body[name], or `default` when it is missing or null; 400 when `check` fails."""
    value = body.get(name)
    if value is None:
        return default
    if check and not check(value):
        raise ApiError(400, f"{name} = {_short(value)}: must be {allowed}", name)
    return value


def _params(body: dict, default_max_tokens: int, logprobs: int | None, max_tokens_field: str) -> SamplingParams:
    stop = _opt(body, "stop", [])
    seed = _opt(body, "seed", None, lambda v: _INT[0](v) and -(1 << 63) <= v < (1 << 63),
                "an integer in [-2^63, 2^63)")
    params = SamplingParams(
        max_tokens=_opt(body, max_tokens_field, default_max_tokens), temperature=_opt(body, "temperature", 1.0),
        top_k=_opt(body, "top_k", 0), top_p=_opt(body, "top_p", 1.0), seed=seed,
        stop=[stop] if isinstance(stop, str) else stop, stop_token_ids=_opt(body, "stop_token_ids", []),
        logprobs=logprobs, ignore_eos=_opt(body, "ignore_eos", False, *_BOOL))
    try:
        return params.validate()
    except InvalidRequest as exc:
        message = str(exc).replace("max_tokens", max_tokens_field, 1)
        raise ApiError(400, message, message.split(" = ", 1)[0]) from None


def _fit_context(body: dict, field: str, prompts: list[list[int]], context: int, where: str,
                 default: int | None) -> int:
    """The default max_tokens: `default` (None: no limit) cut to what fits in the context after
    the longest prompt. 400, as vLLM answers, when the prompt leaves no room or the given
    max_tokens does not fit (a max_tokens of a wrong type is left to SamplingParams.validate)."""
    longest = max(len(p) for p in prompts)
    intro = f"This model's maximum context length is {context} tokens. However, you requested"
    if longest >= context:
        raise ApiError(400, f"{intro} {longest} tokens in the {where}, which leaves none for the completion. "
                            f"Please reduce the length of the {where}.", where)
    given = body.get(field)
    if _INT[0](given) and given >= 1 and longest + given > context:
        raise ApiError(400, f"{intro} {longest + given} tokens ({longest} in the {where}, {given} in the "
                            f"completion). Please reduce the length of the {where} or completion.", field)
    room = context - longest
    return room if default is None else min(default, room)


def _parse(request: web.Request, body: dict, prompts: list[list[int]], default_max_tokens: int,
           logprobs: int | None, max_tokens_field: str = "max_tokens") -> Job:
    """The fields that completions and chat share."""
    params = _params(body, default_max_tokens, logprobs, max_tokens_field)
    n = _opt(body, "n", 1, lambda v: _INT[0](v) and v >= 1, "an integer >= 1")
    if len(prompts) * n > MAX_CHOICES:
        raise ApiError(400, f"{len(prompts)} prompts x n = {n}: at most {MAX_CHOICES} choices per request", "n")
    options = _opt(body, "stream_options", {}, *_DICT)
    tenant = request.headers.get("X-Tenant") or _opt(body, "user", "", *_STR)
    return Job(prompts=prompts, params=params, n=n, stream=_opt(body, "stream", False, *_BOOL),
               include_usage=bool(options.get("include_usage")),
               return_token_ids=_opt(body, "return_token_ids", False, *_BOOL),
               tenant=_text(tenant, "the tenant (the X-Tenant header or user)", "user"),
               priority=_opt(body, "priority", 0, *_INT))


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


async def _body(request: web.Request) -> dict:
    """The JSON object of the request body, checked against the served model and the fields not supported."""
    raw = await request.read()          # over client_max_size: HTTPRequestEntityTooLarge -> 413
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc})") from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON (nested too deeply)") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    served = request.app[ENGINE].llm.model_name
    model = _opt(body, "model", served, *_STR)
    if model != served:
        raise ApiError(400, f"unknown model {model!r}: this server serves {served!r}", "model", code="model_not_found")
    for name, neutral in UNSUPPORTED.items():
        if body.get(name) is not None and body[name] not in neutral:
            raise ApiError(400, f"{name} = {_short(body[name])}: not supported by this server", name)
    return body


def _is_ids(value) -> bool:
    return isinstance(value, list) and all(_INT[0](t) for t in value)


def _prompts(tok, value) -> list[list[int]]:
    """`prompt` (a string, a list of token ids, or a list of those) as token id lists."""
    if value is None:
        raise ApiError(400, "prompt is required: a string, a list of token ids, or a list of those", "prompt")
    prompts = [value] if isinstance(value, str) or (value and _is_ids(value)) else value
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) or _is_ids(p) for p in prompts):
        raise ApiError(400, "prompt must be a string, a list of token ids, or a non-empty list of those", "prompt")
    if not all(prompts):
        raise ApiError(400, "prompt must not be empty", "prompt")
    return [tok.encode(_text(p, "prompt" if len(prompts) == 1 else f"prompt[{i}]", "prompt"))
            if isinstance(p, str) else p for i, p in enumerate(prompts)]


def _chat_prompt(llm, messages) -> list[int]:
    """`messages` rendered by the model's chat template, as token ids."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    turns = []
    for i, m in enumerate(messages):
        role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None)
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content):
            content = "\n".join(p["text"] for p in content)
        if content is None and role == "assistant":
            content = ""
        if role not in ROLES or not isinstance(content, str):
            raise ApiError(400, f"messages[{i}] must be an object with a role ({', '.join(ROLES)}) and a content "
                                "(a string or a list of text parts)", f"messages[{i}]")
        _text(content, f"messages[{i}].content", f"messages[{i}]")
        turns.append({"role": "system" if role == "developer" else role, "content": content})
    text = llm.tokenizer.apply_chat_template(turns, add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_bos=False)   # the template holds its special tokens


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


def _streamable(text: str, stops: list[str]) -> str:
    """The part of a running request's text that cannot change any more: without a trailing
    partial character (decoded as U+FFFD) or the start of a stop string."""
    end = len(text.rstrip("\ufffd"))
    hold = max((k for s in stops for k in range(1, len(s)) if text[:end].endswith(s[:k])), default=0)
    return text[:end - hold]


# formatting
def _completion_logprobs(tok, entries: list[dict], offset: int) -> dict:
    """OpenAI's completions logprobs; text_offset counts from `offset` in the generated text."""
    tokens = [tok.decode([e["token_id"]]) for e in entries]
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset))[:len(tokens)]
    top = [{**{tok.decode([t]): lp for t, lp in e.get("top", [])}, token: e["logprob"]}
           for e, token in zip(entries, tokens)]
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries], "top_logprobs": top,
            "text_offset": offsets}


def _chat_logprobs(tok, entries: list[dict]) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        token = tok.decode([token_id])
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
    return {"content": [{**item(e["token_id"], e["logprob"]),
                         "top_logprobs": [item(t, lp) for t, lp in e.get("top", [])]} for e in entries]}


def _usage(outs: list[RequestOutput], n: int) -> dict:
    firsts = outs[::n]          # one per prompt
    prompt = sum(len(o.prompt_token_ids) for o in firsts)
    completion = sum(len(o.token_ids) for o in outs)
    by_tier = {t: sum(o.cached_tokens.get(t, 0) for o in firsts) for t in ("hot", "warm", "cold", "peer")}
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(by_tier.values())},
            # extension: where the cached prompt tokens came from, and how many were computed
            "kvstore": {"cached_tokens": by_tier, "prefill_tokens": sum(o.prefill_tokens for o in firsts)}}


class Choice:
    """One choice of a streamed response: what it has sent so far."""

    def __init__(self, index: int, job: Job, chat: bool, tok):
        self.index, self.job, self.chat, self.tok = index, job, chat, tok
        self.text = ""          # sent
        self.tokens = 0         # token ids (and logprobs) sent
        self.last: RequestOutput | None = None

    def chunk(self, out: RequestOutput) -> dict | None:
        """The chunk choice for a new output, or None while there is nothing new to send."""
        first, self.last = self.last is None, out
        text = out.text if out.finish_reason else _streamable(out.text, self.job.params.stop)
        delta = text[len(self.text):] if text.startswith(self.text) else ""
        if not (delta or out.finish_reason or first):
            return None
        choice: dict = {"index": self.index}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": delta} if first else {"content": delta} if delta else {}
        else:
            choice["text"] = delta
        entries = (out.logprobs or [])[self.tokens:]
        choice["logprobs"] = None if out.logprobs is None else _chat_logprobs(self.tok, entries) if self.chat \
            else _completion_logprobs(self.tok, entries, len(self.text))
        choice["finish_reason"] = out.finish_reason
        if self.job.return_token_ids:
            choice["token_ids"] = out.token_ids[self.tokens:]
            if first:
                choice["prompt_token_ids"] = out.prompt_token_ids
        self.text, self.tokens = self.text + delta, len(out.token_ids)
        return choice


def _final_choice(index: int, out: RequestOutput, job: Job, chat: bool, tok) -> dict:
    choice: dict = {"index": index}
    if chat:
        choice["message"] = {"role": "assistant", "content": out.text}
        choice["logprobs"] = None if out.logprobs is None else _chat_logprobs(tok, out.logprobs)
    else:
        choice["text"] = out.text
        choice["logprobs"] = None if out.logprobs is None else _completion_logprobs(tok, out.logprobs, 0)
    choice["finish_reason"] = out.finish_reason
    if job.return_token_ids:
        choice["token_ids"] = out.token_ids
        choice["prompt_token_ids"] = out.prompt_token_ids
    return choice


# answering
async def _answer(request: web.Request, job: Job, chat: bool) -> web.StreamResponse:
    engine = request.app[ENGINE]
    if engine.error is not None:
        raise ApiError(503, ENGINE_STOPPED, type="server_error", code="engine_stopped")
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": engine.llm.model_name}
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
    body = {**head, "choices": [_final_choice(i, o, job, chat, tok) for i, o in enumerate(outs)],
            "usage": _usage(outs, job.n)}
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
            await _send(resp, {**head, "choices": [], "usage": _usage([c.last for c in choices], job.n)})
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
    body = await _body(request)
    llm = request.app[ENGINE].llm
    logprobs = _opt(body, "logprobs", None, lambda v: _INT[0](v) and 0 <= v <= 20, "an integer in [0, 20]")
    prompts = _prompts(llm.tokenizer, body.get("prompt"))
    default = _fit_context(body, "max_tokens", prompts, llm.max_seq_len, "prompt", COMPLETION_MAX_TOKENS)
    return await _answer(request, _parse(request, body, prompts, default, logprobs), chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await _body(request)
    llm = request.app[ENGINE].llm
    ids = _chat_prompt(llm, body.get("messages"))
    top = _opt(body, "top_logprobs", 0, lambda v: _INT[0](v) and 0 <= v <= 20, "an integer in [0, 20]")
    logprobs = top if _opt(body, "logprobs", False, *_BOOL) else None
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    default = _fit_context(body, field, [ids], llm.max_seq_len, "messages", None)
    return await _answer(request, _parse(request, body, [ids], default, logprobs, field), chat=True)


async def models(request: web.Request) -> web.Response:
    llm, state = request.app[ENGINE].llm, request.app[STATE]
    card = {"id": llm.model_name, "object": "model", "created": state.started, "owned_by": "kvstore",
            "max_model_len": llm.max_seq_len}
    if request.match_info.get("model", llm.model_name) != llm.model_name:
        raise ApiError(404, f"unknown model {request.match_info['model']!r}: this server serves "
                            f"{llm.model_name!r}", "model", code="model_not_found")
    return web.json_response(card if "model" in request.match_info else {"object": "list", "data": [card]})


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


def api_runner(app: web.Application, **kwargs) -> web.AppRunner:
    """The runner the API is served with: a handler is cancelled when its client disconnects
    (aiohttp's AppRunner does not do that by default), so a request nobody waits for is aborted
    and its pages are released, streamed or not."""
    return web.AppRunner(app, handler_cancellation=True, **kwargs)


def create_app(engine: AsyncLLM, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> web.Application:
    """The API over a started AsyncLLM. /health answers 503 until warm_up(engine, app) is done."""
    app = web.Application(client_max_size=max_body_bytes, middlewares=[errors])
    app[ENGINE], app[STATE], app[MAX_BODY] = engine, ServerState(), max_body_bytes
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", models)
    app.router.add_get("/health", health)
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
