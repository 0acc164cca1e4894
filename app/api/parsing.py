"""A request's body parsed into what the engine runs (a Job): JSON, the typed model, the served
model's name, the prompts as token ids, the sampling parameters and the limits of the context,
each refused with 400 (ApiError) naming the field, as OpenAI and vLLM answer."""

from __future__ import annotations

import json
from typing import Callable

from aiohttp import web

from app.api.errors import ApiError
from app.api.models import SHAPES, ChatMessage, InvalidBody, M, Sampling, parse
from app.api.responses import Job
from app.api.state import SERVED, TENANT, USER
from engine import InvalidRequest, SamplingParams
from engine.tokenizer import check_text

MAX_CHOICES = 64                # prompts x n in one request


def text(value: str, name: str, param: str) -> str:
    """A string of the request that is tokenized or hashed: 400 naming it when not valid Unicode."""
    try:
        return check_text(value, name)
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), param) from None


def given(value, default):
    return default if value is None else value


def _params(req: Sampling, max_tokens: int, logprobs: int | None, max_tokens_field: str,
            prompt_logprobs: int | None) -> SamplingParams:
    stop = given(req.stop, [])
    stops = [stop] if isinstance(stop, str) else stop
    for i, s in enumerate(stops):
        text(s, "stop" if isinstance(stop, str) else f"stop[{i}]", "stop")
    params = SamplingParams(
        max_tokens=max_tokens, temperature=given(req.temperature, 1.0),
        top_k=0 if req.top_k == -1 else given(req.top_k, 0),     # vLLM's -1: off
        top_p=given(req.top_p, 1.0), min_p=given(req.min_p, 0.0), seed=req.seed, stop=stops,
        stop_token_ids=given(req.stop_token_ids, []), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        ignore_eos=given(req.ignore_eos, False), presence_penalty=given(req.presence_penalty, 0.0),
        frequency_penalty=given(req.frequency_penalty, 0.0), repetition_penalty=given(req.repetition_penalty, 1.0),
        logit_bias=given(req.logit_bias, {}))
    try:
        return params.validate()
    except InvalidRequest as exc:
        message = str(exc).replace("max_tokens", max_tokens_field, 1)
        raise ApiError(400, message, message.split(" = ", 1)[0].split("[", 1)[0]) from None


def fit_context(given_tokens: int | None, field: str, prompts: list[list[int]], context: int, where: str,
                default: int | None) -> int:
    """max_tokens: the given one, else `default` (None: no limit) cut to what fits in the context
    after the longest prompt. 400, as vLLM answers, when the prompt leaves no room or the given
    max_tokens does not fit (one below 1 is left to SamplingParams.validate)."""
    longest = max(len(p) for p in prompts)
    intro = f"This model's maximum context length is {context} tokens. However, you requested"
    if longest >= context:
        raise ApiError(400, f"{intro} {longest} tokens in the {where}, which leaves none for the completion. "
                            f"Please reduce the length of the {where}.", where)
    if given_tokens is not None:
        if given_tokens >= 1 and longest + given_tokens > context:
            raise ApiError(400, f"{intro} {longest + given_tokens} tokens ({longest} in the {where}, {given_tokens} "
                                f"in the completion). Please reduce the length of the {where} or completion.", field)
        return given_tokens
    room = context - longest
    return room if default is None else min(default, room)


def job(request: web.Request, req: Sampling, prompts: list[list[int]], max_tokens: int, logprobs: int | None,
        max_tokens_field: str = "max_tokens", prompt_logprobs: int | None = None) -> Job:
    """The fields that completions and chat share."""
    params = _params(req, max_tokens, logprobs, max_tokens_field, prompt_logprobs)
    n = given(req.n, 1)
    if n < 1:
        raise ApiError(400, f"n = {n}: must be an integer >= 1", "n")
    if len(prompts) * n > MAX_CHOICES:
        raise ApiError(400, f"{len(prompts)} prompts x n = {n}: at most {MAX_CHOICES} choices per request", "n")
    if req.user is not None:
        request[USER] = text(req.user, "user", "user")     # recorded in the access log, nothing more
    return Job(prompts=prompts, params=params, n=n, stream=given(req.stream, False),
               include_usage=bool(req.stream_options and req.stream_options.include_usage),
               return_token_ids=given(req.return_token_ids, False), tenant=request[TENANT],
               priority=given(req.priority, 0))


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


def check_model(request: web.Request, model: str | None) -> None:
    """404 as OpenAI answers it when the request names a model this server does not serve."""
    served = request.app[SERVED].name
    if model is not None and model != served:
        raise ApiError(404, f"The model {model!r} does not exist: this server serves {served!r}.", "model",
                       code="model_not_found")


async def request_body(request: web.Request, model: type[M] | Callable[[dict], type[M]]) -> M:
    """The request body as `model` (or as the model `model(body)` chooses), naming the served model
    (or none)."""
    body = await _body(request)
    try:
        parsed = parse(model if isinstance(model, type) else model(body), body)
    except InvalidBody as exc:
        raise ApiError(400, str(exc), exc.param) from None
    check_model(request, parsed.model)
    return parsed


def prompts(tok, value) -> list[list[int]]:
    """`prompt` (a string, a list of token ids, or a list of those; typed by CompletionRequest) as
    token id lists."""
    listed = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else value
    if not listed or not all(listed):
        raise ApiError(400, "prompt must not be empty", "prompt")
    return [tok.encode(text(p, "prompt" if len(listed) == 1 else f"prompt[{i}]", "prompt"))
            if isinstance(p, str) else p for i, p in enumerate(listed)]


def chat_text(llm, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
    """`messages` rendered by the model's chat template."""
    turns = []
    for i, m in enumerate(messages):
        if m.content is None and m.role != "assistant":
            raise ApiError(400, f"messages[{i}] {SHAPES['messages[]']}", f"messages[{i}]")
        content = text(m.text(), f"messages[{i}].content", f"messages[{i}]")
        turns.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return llm.tokenizer.apply_chat_template(turns, add_generation_prompt=add_generation_prompt)
