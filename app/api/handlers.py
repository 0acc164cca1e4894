"""The API's endpoints: completions and chat (run as engine requests, answered whole or as
server-sent events), tokenize and detokenize, models, version, metrics, the OpenAPI document and
health."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import aclosing
from typing import AsyncIterator

from aiohttp import web

from app.api import parsing
from app.api.errors import ApiError, log_failure
from app.api.models import (ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeChat, TokenizeCompletion,
                            openapi_document)
from app.api.parsing import given
from app.api.responses import Choice, Job, final_choice, usage
from app.api.state import ENGINE, ENGINE_STOPPED, METRICS, SERVED, STATE
from engine import RequestOutput
from engine.request import StepFailed
from kvstore import __version__
from kvstore.server.metrics import CONTENT_TYPE

COMPLETION_MAX_TOKENS = 16      # a completion's max_tokens when left out (OpenAI's), if it fits
CLIENT_CLOSED = 499             # the status logged for a request whose client went away (nginx's)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


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
    error. Closing it (also when the handler is cancelled because its client left: see
    app.api.server.api_runner) closes every stream, which aborts the engine requests still running."""
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
    # in a thread: logprobs decode every token (an echoed prompt's too), which must not block the loop
    choices = await asyncio.to_thread(lambda: [final_choice(i, o, job, chat, tok) for i, o in enumerate(outs)])
    body = {**head, "choices": choices, "usage": usage(outs, job.n)}
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
            log_failure(request, exc)
        message = str(exc) if isinstance(exc, StepFailed) else "internal server error"
        await _send(resp, {"error": {"message": message, "type": "server_error", "param": None, "code": None}})
    return resp


# handlers
async def completions(request: web.Request) -> web.StreamResponse:
    """With `echo`, each choice starts with its prompt; with `logprobs` too, the prompt's tokens get
    their logprobs (the first none), computed by the engine (SamplingParams.prompt_logprobs)."""
    req = await parsing.request_body(request, CompletionRequest)
    llm = request.app[ENGINE].llm
    logprobs = req.logprobs     # its range is SamplingParams.validate()'s
    prompts = parsing.prompts(llm.tokenizer, req.prompt)
    max_tokens = parsing.fit_context(req.max_tokens, "max_tokens", prompts, llm.max_seq_len, "prompt",
                                     COMPLETION_MAX_TOKENS)
    job = parsing.job(request, req, prompts, max_tokens, logprobs,
                      prompt_logprobs=logprobs if req.echo else None)
    if req.echo:
        texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt if isinstance(req.prompt[0], str) \
            else None
        job.echo = texts or [llm.tokenizer.decode(p) for p in prompts]
    return await _answer(request, job, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    req = await parsing.request_body(request, ChatRequest)
    llm = request.app[ENGINE].llm
    ids = llm.tokenizer.encode(parsing.chat_text(llm, req.messages), add_bos=False)   # the template holds its specials
    top = given(req.top_logprobs, 0)
    if not 0 <= top <= 20:
        raise ApiError(400, f"top_logprobs = {top}: must be an integer in [0, 20]", "top_logprobs")
    logprobs = top if req.logprobs else None
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = parsing.fit_context(given(req.max_completion_tokens, req.max_tokens), field, [ids],
                                     llm.max_seq_len, "messages", None)
    return await _answer(request, parsing.job(request, req, [ids], max_tokens, logprobs, field), chat=True)


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: a prompt, or chat messages through the template."""
    req = await parsing.request_body(request, lambda body: TokenizeChat if "messages" in body else TokenizeCompletion)
    llm = request.app[ENGINE].llm
    if isinstance(req, TokenizeChat):
        text = parsing.chat_text(llm, req.messages, req.add_generation_prompt)
    else:
        text = parsing.text(req.prompt, "prompt", "prompt")
    ids = llm.tokenizer.encode(text, add_bos=req.add_special_tokens)
    return web.json_response({"count": len(ids), "max_model_len": llm.max_seq_len, "tokens": ids,
                              "token_strs": llm.tokenizer.token_strs(ids) if req.return_token_strs else None})


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's /detokenize: token ids to text."""
    req = await parsing.request_body(request, DetokenizeRequest)
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
        parsing.check_model(request, request.match_info["model"])
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
