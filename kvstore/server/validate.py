"""Input checks of the admin API: every user mistake becomes an AdminError (status, one line).

Each request is validated against its operation in the OpenAPI document (openapi.py, the one
statement of what every operation accepts) with jsonschema's Draft 2020-12 validator, the schema
dialect of OpenAPI 3.1. The validators are built once, when the app is created (Requests); a
failure is answered 400 with one line naming the field and what it allows. Parsing that a schema
cannot state stays here: a body must be a JSON object (no NaN or Infinity, no lone surrogates)
and a query gives each parameter at most once.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterable, NoReturn

from aiohttp import web
from jsonschema import Draft202012Validator, ValidationError
from jsonschema.validators import extend
from referencing import Registry
from referencing.jsonschema import DRAFT202012

DOCUMENT_URI = "urn:kvstore:admin:openapi"
METHODS = ("get", "put", "post", "delete", "patch", "options", "trace")
BODY = web.RequestKey("admin_body", dict)      # the validated JSON body of an operation that takes one
QUERY = web.RequestKey("admin_query", dict)    # the validated query, typed (limit: int, pinned: bool)


class AdminError(Exception):
    """An error answered as {"error": message} with this status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def fail(message: str, status: int = 400) -> NoReturn:
    raise AdminError(status, message)


def error(status: int, message: str, headers: dict | None = None) -> web.Response:
    """{"error": message} on one line: its lines joined by a space (a field named in the message, JSON
    quoted, keeps its spaces: collapsing every run of them misnamed a field of two spaces)."""
    one_line = " ".join(part.strip() for part in message.splitlines() if part.strip())
    return web.json_response({"error": one_line}, status=status, headers=headers)


def short(value: Any, limit: int = 40) -> str:
    """A value as JSON, cut to `limit` characters."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


# parsing
def reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


async def read_body(request: web.Request) -> dict:
    raw = await request.read()          # over client_max_size: HTTPRequestEntityTooLarge -> 413
    try:
        body = json.loads(raw, parse_constant=reject_constant)
    except (ValueError, RecursionError):
        fail("the request body is not valid JSON (a JSON object is expected)")
    if not isinstance(body, dict):
        fail("the request body must be a JSON object")
    where = lone_surrogate(body)
    if where is not None:
        fail(f"{field(where)}: not valid Unicode (a lone surrogate)")
    return body


def lone_surrogate(body: dict) -> tuple | None:
    """The path of the first string (field name or value) that UTF-8 cannot encode, or None."""
    stack: list[tuple[tuple, Any]] = [((), body)]
    while stack:                        # a loop, not recursion: the body may nest deeply
        path, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    return path
        elif isinstance(value, dict):
            stack += [((*path, k), k) for k in value] + [((*path, k), v) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [((*path, i), v) for i, v in enumerate(value)]
    return None


def read_query(request: web.Request, types: dict[str, Any]) -> dict[str, Any]:
    """The query as an object, each value as the JSON type its parameter's schema names (as given
    when it is not one: the validator says what is allowed)."""
    out = {}
    for name in request.query:
        values = request.query.getall(name)
        if len(values) > 1:
            fail(f"query parameter {json.dumps(name)} is given {len(values)} times (at most once)")
        out[name] = typed(values[0], types.get(name))
    return out


def typed(text: str, kind: Any) -> Any:
    if kind == "integer" and re.fullmatch(r"-?[0-9]{1,18}", text):
        return int(text)
    if kind == "number" and re.fullmatch(r"-?[0-9]{1,18}(\.[0-9]{1,18})?", text):
        return float(text)
    if kind == "boolean" and text in ("true", "false"):
        return text == "true"
    return text


# messages
KINDS = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "true or false",
         "array": "an array", "object": "an object", "null": "null"}
DESCRIBED = {"type", "enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "pattern",
             "minLength", "maxLength", "minItems", "maxItems", "uniqueItems"}
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def field(path: Iterable) -> str:
    """A path into the request as one name: tokens[3], checks.store; odd names quoted as JSON."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            name = part if NAME.fullmatch(part) else json.dumps(part)
            out += f".{name}" if out else name
    return out


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def describe(schema: dict) -> str:
    """What a schema allows, in words: `an integer in [1, 1000]`, `one of "hot", "warm", "cold"`."""
    if "const" in schema:
        return json.dumps(schema["const"])
    if "enum" in schema:
        return "one of " + ", ".join(json.dumps(v) for v in schema["enum"])
    kinds = schema.get("type", [])
    words = [" or ".join(KINDS[k] for k in ([kinds] if isinstance(kinds, str) else kinds)) or "a value"]
    low = (("[", schema["minimum"]) if "minimum" in schema else
           ("(", schema["exclusiveMinimum"]) if "exclusiveMinimum" in schema else None)
    high = (("]", schema["maximum"]) if "maximum" in schema else
            (")", schema["exclusiveMaximum"]) if "exclusiveMaximum" in schema else None)
    if low and high:
        words.append(f"in {low[0]}{low[1]}, {high[1]}{high[0]}")
    elif low:
        words.append(f"{'>=' if low[0] == '[' else '>'} {low[1]}")
    elif high:
        words.append(f"{'<=' if high[0] == ']' else '<'} {high[1]}")
    for key, text in (("minLength", "of at least {}"), ("maxLength", "of at most {}")):
        if key in schema:
            words.append(text.format(_plural(schema[key], "character")))
    if "pattern" in schema:
        words.append(f"matching {schema['pattern']}")
    for key, text in (("minItems", "of at least {}"), ("maxItems", "of at most {}")):
        if key in schema:
            words.append(text.format(_plural(schema[key], "item")))
    if schema.get("uniqueItems"):
        words.append("without duplicates")
    if isinstance(schema.get("items"), dict):
        words[-1] += ","
        words.append(f"each item {describe(schema['items'])}")
    return " ".join(words)


def _rank(error: ValidationError) -> tuple[int, int]:
    """Which error to report: unknown fields first, then missing ones, then wrong values."""
    order = {"additionalProperties": 0, "required": 1, "oneOf": 1}
    return order.get(error.validator, 2), len(error.path)


# validation
@lru_cache(maxsize=64)
def _ecma(pattern: str) -> re.Pattern:
    # ECMA-262's `$` matches only at the end; Python's also before a final newline
    return re.compile(re.sub(r"(?<!\\)\$", r"\\Z", pattern))


def _pattern(validator, pattern: str, instance: Any, schema: dict):
    if validator.is_type(instance, "string") and not _ecma(pattern).search(instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


Validator = extend(Draft202012Validator, {"pattern": _pattern})


def _ref(*parts: Any) -> dict:
    """A $ref to this JSON pointer in the document."""
    return {"$ref": DOCUMENT_URI + "#/" + "/".join(str(p).replace("~", "~0").replace("/", "~1") for p in parts)}


def resolve(resolver, schema: dict) -> dict:
    while "$ref" in schema:
        schema = resolver.lookup(schema["$ref"]).contents
    return schema


class Input:
    """One input of an operation (its path parameters, query or JSON body) and its validator."""

    def __init__(self, schema: dict, noun: str, registry: Registry):
        self.validator = Validator(schema, registry=registry)
        self.noun = noun
        self.resolver = registry.resolver(DOCUMENT_URI)

    def check(self, instance: Any) -> Any:
        """`instance` when it is valid; else AdminError 400 with the most telling error."""
        found = min(self.validator.iter_errors(instance), key=_rank, default=None)
        if found is not None:
            fail(self.message(found))
        return instance

    def message(self, e: ValidationError) -> str:
        where, schema, value = field(e.path), e.schema, e.instance
        at = f"{where}: " if where else ""
        if e.validator == "additionalProperties":
            allowed = list(schema.get("properties", {}))
            unknown = next(k for k in value if k not in allowed)
            return f"{at}unknown {self.noun} {json.dumps(unknown)}; allowed: {', '.join(allowed) or 'none'}"
        if e.validator == "required":
            missing = next(k for k in e.validator_value if k not in value)
            wanted = schema.get("properties", {}).get(missing)
            return (f"{at}missing {self.noun} {json.dumps(missing)}"
                    + (f": must be {describe(resolve(self.resolver, wanted))}" if wanted is not None else ""))
        if e.validator == "oneOf" and all(set(s) == {"required"} for s in e.validator_value):
            names = [n for s in e.validator_value for n in s["required"]]
            return f"{at}give exactly one of {', '.join(names[:-1])} and {names[-1]}"
        if e.validator in DESCRIBED:
            return f"{where or 'the value'}: must be {describe(schema)} (got {short(value)})"
        return f"{at}{e.message}"


@dataclass(frozen=True)
class Operation:
    """The inputs one operation takes; None where it takes none of that kind."""
    path: Input | None
    query: Input | None
    query_types: dict
    body: Input | None


class Requests:
    """Validators of every operation in the OpenAPI document, built once (at app creation).

    An operation with its own security scheme (the peers' cluster token) is left to its handler,
    which authenticates the caller before it reads any input."""

    def __init__(self, document: dict):
        self.registry = Registry().with_resource(DOCUMENT_URI, DRAFT202012.create_resource(document))
        resolver = self.registry.resolver(DOCUMENT_URI)
        default_security = document.get("security", [])
        self.operations: dict[tuple[str, str], Operation] = {}
        for path, item in document["paths"].items():
            for method in METHODS:
                op = item.get(method)
                if op is None or op.get("security", default_security) not in ([], default_security):
                    continue
                params = {}    # (in, name) -> (where its schema is, required); the operation's own win
                for where, holder in ((("paths", path), item), (("paths", path, method), op)):
                    for i, p in enumerate(holder.get("parameters", [])):
                        params[p["in"], p["name"]] = ((*where, "parameters", i, "schema"), p.get("required", False))
                body = op.get("requestBody", {}).get("content", {}).get("application/json")
                self.operations[method.upper(), path] = Operation(
                    path=self._params(params, "path", "path parameter"),
                    query=self._params(params, "query", "query parameter"),
                    query_types={name: resolve(resolver, _ref(*at)).get("type")
                                 for (kind, name), (at, _) in params.items() if kind == "query"},
                    body=Input(_ref("paths", path, method, "requestBody", "content", "application/json", "schema"),
                               "field", self.registry) if body is not None else None)

    def _params(self, params: dict, kind: str, noun: str) -> Input | None:
        mine = {name: (at, required) for (k, name), (at, required) in params.items() if k == kind}
        if not mine:
            return None
        return Input({"type": "object", "properties": {name: _ref(*at) for name, (at, _) in mine.items()},
                      "required": [name for name, (_, required) in mine.items() if required],
                      "additionalProperties": False}, noun, self.registry)

    async def check(self, request: web.Request) -> None:
        """Validate the request against its operation: its path parameters, its query (when the
        operation takes one; then request[QUERY]) and its JSON body (then request[BODY])."""
        resource = request.match_info.route.resource
        method = "GET" if request.method == "HEAD" else request.method
        op = self.operations.get((method, resource.canonical)) if resource is not None else None
        if op is None:
            return
        if op.path is not None:
            op.path.check(dict(request.match_info))
        if op.query is not None:
            request[QUERY] = op.query.check(read_query(request, op.query_types))
        if op.body is not None:
            request[BODY] = op.body.check(await read_body(request))
