"""Input checks of the admin API: every user mistake becomes an AdminError (status, one line)."""

from __future__ import annotations

import json
import re
from typing import Any, NoReturn

from aiohttp import web

from kvstore.server import openapi

HEX_KEY = re.compile(openapi.HEX_KEY.strip("^$"))


class AdminError(Exception):
    """An error answered as {"error": message} with this status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def fail(message: str, status: int = 400) -> NoReturn:
    raise AdminError(status, message)


def error(status: int, message: str, headers: dict | None = None) -> web.Response:
    return web.json_response({"error": " ".join(message.split())}, status=status, headers=headers)


def short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# input
def reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


async def body(request: web.Request, allowed: tuple[str, ...]) -> dict:
    """The request's JSON object, with no field outside `allowed`."""
    raw = await request.read()          # over client_max_size: HTTPRequestEntityTooLarge -> 413
    try:
        body = json.loads(raw, parse_constant=reject_constant)
    except (ValueError, RecursionError):
        fail("the request body is not valid JSON (a JSON object is expected)")
    if not isinstance(body, dict):
        fail("the request body must be a JSON object")
    unknown = [k for k in body if k not in allowed]
    if unknown:
        fail(f"unknown field {short(unknown[0])}; allowed: {', '.join(allowed)}")
    return body


def text(value: Any, name: str, max_chars: int | None = None) -> str:
    if not isinstance(value, str):
        fail(f"{name} must be a string")
    if max_chars is not None and len(value) > max_chars:
        fail(f"{name} is longer than {max_chars} characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        fail(f"{name} is not valid Unicode (a lone surrogate)")
    return value


def integral(value: Any) -> int | None:
    """An integer, or a float with no fraction (JSON Schema's integer), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def tokens(value: Any) -> list[int]:
    if not isinstance(value, list):
        fail("tokens must be a list of token ids")
    ids = [integral(t) for t in value]
    if not all(t is not None and 0 <= t <= openapi.MAX_TOKEN_ID for t in ids):
        fail(f"tokens must be integers in [0, {openapi.MAX_TOKEN_ID}]")
    return ids


def key(value: Any, name: str = "key") -> bytes:
    if not isinstance(value, str) or not HEX_KEY.fullmatch(value):
        fail(f"{name} must be 64 hex digits")
    return bytes.fromhex(value)


def tenant(body: dict) -> str:
    return text(body.get("tenant", ""), "tenant", openapi.MAX_TENANT_CHARS)


def keys_or_tokens(body: dict) -> tuple[list[bytes] | None, list[int] | None]:
    """Exactly one of `keys` (page keys) and `tokens` (a prefix)."""
    if ("keys" in body) == ("tokens" in body):
        fail("give exactly one of keys (page keys, hex) and tokens (a prefix)")
    if "keys" in body:
        if not isinstance(body["keys"], list):
            fail("keys must be a list of page keys (64 hex digits each)")
        return [key(k, "each of keys") for k in body["keys"]], None
    return None, tokens(body["tokens"])


def query(request: web.Request, allowed: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for name in request.query:
        if name not in allowed:
            fail(f"unknown query parameter {short(name)}; allowed: {', '.join(allowed)}")
        values = request.query.getall(name)
        if len(values) > 1:
            fail(f"query parameter {name} is given {len(values)} times")
        out[name] = values[0]
    return out


def limit(query: dict[str, str], default: int) -> int:
    raw = query.get("limit")
    if raw is None:
        return default
    if not re.fullmatch(r"[0-9]{1,7}", raw) or not 1 <= int(raw) <= openapi.MAX_LIMIT:
        fail(f"limit must be an integer in [1, {openapi.MAX_LIMIT}]")
    return int(raw)
