"""The OpenAI-compatible API's requests as typed models: every field the server honours, with its type.

Rules:
- A field that is not described here is refused (400 naming it), never dropped: the models
  forbid extra fields. Types are strict: JSON `true` is not a number, `"3"` is not an integer,
  `1.0` is not an integer.
- Ranges are SamplingParams.validate()'s (one place, shared with the library API); the models
  state types and shapes only.
- A few OpenAI fields exist only with their neutral value (NEUTRAL): `response_format`
  {"type": "text"}, empty `tools`, ...; any other value is refused naming the field.
- `parse()` turns a pydantic ValidationError into one line naming the field and what was wrong.

The same models give the OpenAPI document of this API (openapi_document()).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.json_schema import models_json_schema

from kvstore import __version__

ROLES = ("system", "developer", "user", "assistant", "tool")
# fields that exist only with their neutral value: anything else is refused
NEUTRAL: dict[str, tuple] = {"suffix": ("",), "best_of": (1,), "tools": ([],), "functions": ([],),
                             "tool_choice": ("none",), "parallel_tool_calls": (False, True),
                             "response_format": ({"type": "text"},)}
# one message for a field whose union type would give several pydantic errors
SHAPES = {"prompt": "prompt must be a string, a list of token ids, or a non-empty list of those",
          "messages": "messages must be a non-empty list of {role, content} objects",
          "messages[]": "must be an object with a role (" + ", ".join(ROLES) + ") and a content (a string or "
                        "a list of text parts)",
          "stop": "stop must be a string or a list of strings"}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal[ROLES]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content or ""


class Sampling(Strict):
    """The fields completions and chat share."""

    model: str | None = Field(None, description="the served model's id (optional)")
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, description="vLLM extension: 0 or -1 is off")
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias added to "
                                                                  "its logit")
    ignore_eos: bool | None = None
    priority: int | None = None
    return_token_ids: bool | None = None
    user: str | None = Field(None, description="recorded only: the tenant is the API key's")
    # neutral-only (see NEUTRAL)
    suffix: Any = None
    best_of: Any = None
    tools: Any = None
    functions: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = None


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None


class TokenizeCompletion(Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


class InvalidBody(Exception):
    """A request body that does not fit its model: `param` is the field, the message one line."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


M = TypeVar("M", bound=BaseModel)


_PLAIN = re.compile(r"[A-Za-z0-9_-]{1,40}")   # a key shown as it is in a field's path


def short(value: Any) -> str:
    try:
        text = json.dumps(value) if not isinstance(value, str) else repr(value)
    except (RecursionError, TypeError, ValueError):
        text = f"(a {type(value).__name__})"
    return text if len(text) <= 40 else text[:37] + "..."


def _path(loc: tuple) -> str:
    """Where a field is: messages[0].content, logit_bias.50256; a key the client chose that is not
    a plain name is quoted (logit_bias['\\n']), so that the message stays one line."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _PLAIN.fullmatch(str(part)):
            out += f"[{short(str(part))}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def parse(model: type[M], body: dict) -> M:
    """body as `model`; InvalidBody naming the first field that does not fit."""
    try:
        parsed = model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        loc = tuple(p for p in error["loc"] if not (isinstance(p, str) and p[:1].islower() and "[" in p))
        param = _path(loc[:1]) if loc else None
        if error["type"] == "extra_forbidden":
            raise InvalidBody(f"{_path(loc)}: unknown field; this server does not support it", param) from None
        if error["type"] == "missing":
            raise InvalidBody(f"{_path(loc)} is required", param) from None
        if param == "messages" and len(loc) > 1 and error["type"] != "too_short":
            item = _path(loc[:2])
            raise InvalidBody(f"{item} {SHAPES['messages[]']}", item) from None
        if param in SHAPES:
            raise InvalidBody(SHAPES[param], param) from None
        message = error["msg"][0].lower() + error["msg"][1:]
        raise InvalidBody(f"{_path(loc)} = {short(error.get('input'))}: {message}", param) from None
    for name, neutral in NEUTRAL.items():
        value = getattr(parsed, name, None)
        if value is not None and value not in neutral:
            raise InvalidBody(f"{name} = {short(value)}: not supported by this server", name)
    return parsed


@functools.cache
def openapi_document() -> dict:
    """This API's OpenAPI document: the request bodies from app.api.models."""
    bodies = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest,
              "/tokenize": TokenizeCompletion, "/detokenize": DetokenizeRequest}
    _, schemas = models_json_schema([(m, "validation") for m in (*bodies.values(), TokenizeChat)],
                                    ref_template="#/components/schemas/{model}")

    def body(*names: str) -> dict:
        refs = [{"$ref": f"#/components/schemas/{n}"} for n in names]
        return {"required": True, "content": {"application/json": {"schema": refs[0] if len(refs) == 1
                                                                   else {"oneOf": refs}}}}
    paths = {path: {"post": {"requestBody": body(m.__name__) if path != "/tokenize"
                             else body("TokenizeCompletion", "TokenizeChat"),
                             "responses": {"200": {"description": "OK"}}}} for path, m in bodies.items()}
    for path in ("/v1/models", "/health", "/version", "/metrics"):
        paths[path] = {"get": {"responses": {"200": {"description": "OK"}}}}
    return {"openapi": "3.1.0", "info": {"title": "kvstore OpenAI-compatible API", "version": __version__},
            "paths": paths, "components": {"schemas": schemas.get("$defs", {}),
                                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}}
