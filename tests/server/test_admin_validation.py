"""The admin API's inputs against its OpenAPI document: every operation refuses each violation of
its schema with a 400 naming the field and what it allows, and valid values reach the handlers
typed (kvstore/server/validate.py validates from the document)."""

from __future__ import annotations

import json
import urllib.parse

import pytest

from kvstore.server import openapi
from storeutil import tokens_for
from test_admin import PS, admin  # noqa: F401 (admin: the fixture)


# every operation's inputs against the document: one violation of each constraint at a time
HEX = "0" * 64
UNKNOWN = "no_such_field"


def _deref(doc: dict, schema: dict) -> dict:
    while "$ref" in schema:
        target = doc
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        schema = target
    return schema


def _example(schema: dict, variant: int = 0):
    """A valid value of a request schema: the first of each choice, `variant` of an object's oneOf."""
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema["type"]
    if kind in ("integer", "number"):
        return schema.get("minimum", schema.get("exclusiveMinimum", -1) + 1)
    if kind == "boolean":
        return True
    if kind == "string":
        assert schema.get("pattern") in (None, openapi.HEX_KEY), "a new pattern: give it an example here"
        return HEX if "pattern" in schema else "x" * max(schema.get("minLength", 1), 1)
    if kind == "array":
        return [_example(schema["items"])]
    assert kind == "object", schema
    names = [*schema.get("required", []), *(schema["oneOf"][variant]["required"] if "oneOf" in schema else [])]
    return {n: _example(schema["properties"][n]) for n in names}


WRONG_TYPE = {"integer": "x", "number": "x", "string": 5, "boolean": "x", "array": "x", "object": "x"}


def _violations(schema: dict, name: str, as_text: bool = False):
    """(what, name, a value breaking one constraint of `schema`, words the message must hold)."""
    if "enum" in schema:
        yield "outside the enum", name, "no-such-choice", [json.dumps(v) for v in schema["enum"]]
        return
    kind = schema["type"]
    if not (as_text and kind == "string"):   # a query's value is always a string
        yield "wrong type", name, WRONG_TYPE[kind], ["must be"]
    for key, bad in (("minimum", lambda v: v - 1), ("exclusiveMinimum", lambda v: v),
                     ("maximum", lambda v: v + 1), ("exclusiveMaximum", lambda v: v)):
        if key in schema:
            yield key, name, bad(schema[key]), [str(schema[key])]
    if "minLength" in schema and schema["minLength"] > 0:
        yield "minLength", name, "", [str(schema["minLength"])]
    if "maxLength" in schema:
        yield "maxLength", name, "x" * (schema["maxLength"] + 1), [str(schema["maxLength"])]
    if "pattern" in schema:
        yield "pattern", name, "zz", [schema["pattern"]]
    if kind == "array":
        if schema.get("minItems", 0) > 0:
            yield "minItems", name, [], [str(schema["minItems"])]
        for what, item, bad, words in _violations(schema["items"], f"{name}[0]"):
            yield f"item {what}", item, [bad], words


def _body_violations(schema: dict):
    """(what, field named in the message, body, words the message must hold) for an object schema."""
    props = schema["properties"]
    variants = [v["required"] for v in schema.get("oneOf", [])]
    if schema.get("additionalProperties") is False:
        yield "unknown field", UNKNOWN, {**_example(schema), UNKNOWN: 1}, ["unknown field", *props]
    for name in schema.get("required", []):
        body = _example(schema)
        del body[name]
        yield "missing", name, body, ["missing"]
    if variants:
        every = [n for v in variants for n in v]
        body = {**_example(schema), **{n: _example(props[n]) for n in every}}
        yield "more than one of oneOf", every[0], body, ["exactly one", *every]
        yield "none of oneOf", every[0], {k: v for k, v in body.items() if k not in every}, ["exactly one", *every]
    for name, prop in props.items():
        variant = next((i for i, v in enumerate(variants) if name in v), 0)
        for what, field, bad, words in _violations(prop, name):
            yield what, field, {**_example(schema, variant), name: bad}, words


def _query_text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


async def test_every_operation_refuses_each_schema_violation(admin):
    """Walk the document: for each operation, its path parameters, query parameters and body each
    break one constraint at a time; every answer is 400 with one line naming the field and what it
    allows. The valid example of each input is accepted, so each 400 has that one cause."""
    doc, sent, covered = admin.doc, 0, set()
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if op.get("security", doc["security"]) not in ([], doc["security"]):
                assert (method, path) == ("post", "/v1/peer/pages")   # authenticates the peer first
                continue
            params = {p["name"]: p for p in op.get("parameters", [])}
            path_params = {n: p for n, p in params.items() if p["in"] == "path"}
            query = {n: p["schema"] for n, p in params.items() if p["in"] == "query"}
            schema = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            body = _deref(doc, schema) if schema else None
            url = path
            for name, p in path_params.items():
                url = url.replace("{" + name + "}", _example(p["schema"]))
            cases = []   # (what, field, url, body, words)
            for name, p in path_params.items():
                for what, field, bad, words in _violations(p["schema"], name, as_text=True):
                    cases.append((what, field, path.replace("{" + name + "}", _query_text(bad)), None, words))
            if query:
                cases.append(("unknown query parameter", UNKNOWN, f"{url}?{UNKNOWN}=1", None,
                              ["unknown query parameter", *query]))
                for name, s in query.items():
                    for what, field, bad, words in _violations(s, name, as_text=True):
                        cases.append((what, field, f"{url}?{urllib.parse.urlencode({name: _query_text(bad)})}",
                                      None, words))
                valid = urllib.parse.urlencode({n: _query_text(_example(s)) for n, s in query.items()})
                status, got, _ = await admin.request(method.upper(), f"{url}?{valid}")
                assert status == 200, (path, valid, got)
            if body is not None:
                cases += [(what, field, url, bad, words) for what, field, bad, words in _body_violations(body)]
                status, got, _ = await admin.request(method.upper(), url, _example(body))
                assert status in (200, 409), (path, _example(body), got)   # forget: no cluster index here
            for what, field, target, bad, words in cases:
                status, got, _ = await admin.request(method.upper(), target, bad)
                assert status == 400, (method, target, what, bad, status, got)
                message = got["error"]
                assert "\n" not in message and field in message, (method, target, what, message)
                assert all(w in message for w in words), (method, target, what, words, message)
                covered.add((method, path))
                sent += 1
    takes_input = {(m, p) for p, item in doc["paths"].items() for m, op in item.items()
                   if (op.get("parameters") or "requestBody" in op) and p != "/v1/peer/pages"}
    assert covered == takes_input and sent > 60, (covered, sent)


@pytest.mark.parametrize("method, target, body, message", [
    ("POST", "/v1/lookup", {"tokens": [1, "x"]}, 'tokens[1]: must be an integer in [0, 2147483647] (got "x")'),
    ("POST", "/v1/lookup", {"tokens": "1 2"}, 'tokens: must be an array, each item an integer in [0, 2147483647] '
                                              '(got "1 2")'),
    ("POST", "/v1/pin", {"keys": [], "ttl_s": 0}, "ttl_s: must be a number in (0, 31536000] (got 0)"),
    ("POST", "/v1/flush", {"tier": "hot", "all": True}, 'unknown field "all"; allowed: tier'),
    ("POST", "/v1/evict", {"keys": []}, 'missing field "to": must be one of "warm", "cold", null'),
    ("POST", "/v1/pin", {"keys": [], "tokens": []}, "give exactly one of keys and tokens"),
    ("POST", "/v1/lookup", {"text": "a\ud800"}, "text: not valid Unicode (a lone surrogate)"),
    ("POST", "/v1/peers/forget", {"instance": ""}, 'instance: must be a string of at least 1 character (got "")'),
    ("GET", "/v1/pages?limit=x", None, 'limit: must be an integer in [1, 1000] (got "x")'),
    ("GET", "/v1/pages?pinned=1", None, 'pinned: must be true or false (got "1")'),
    ("GET", "/v1/pages?tier=hot&tier=cold", None, 'query parameter "tier" is given 2 times (at most once)'),
    ("GET", "/v1/prefixes?tier=hot", None, 'unknown query parameter "tier"; allowed: limit'),
    ("GET", f"/v1/pages?namespace={HEX}%0A", None, "namespace: must be a string matching ^[0-9a-fA-F]{64}$"),
    ("GET", f"/v1/pages/{HEX}%0A", None, "key: must be a string matching ^[0-9a-fA-F]{64}$"),
])
async def test_error_messages_name_the_field_and_what_it_allows(admin, method, target, body, message):
    status, got, _ = await admin.request(method, target, body)
    assert status == 400 and got["error"].startswith(message), got


async def test_valid_values_reach_the_handler_typed(admin):
    # integral floats are JSON Schema integers; the query's limit and pinned arrive as int and bool
    tokens = tokens_for(1, 4)
    status, got = await admin.post("/v1/lookup", {"tokens": [float(t) for t in tokens]})
    assert status == 200 and got["cached_prefix_tokens"] == 4 * PS
    _, listing = await admin.get("/v1/pages?limit=3&pinned=false")
    assert len(listing["pages"]) == 3 and listing["total"] == 7
    for query, status in (("limit=3", 200), ("limit=0", 400)):   # HEAD is checked as GET
        async with admin.session.head(f"{admin.url}/v1/pages?{query}") as r:
            assert r.status == status, query
