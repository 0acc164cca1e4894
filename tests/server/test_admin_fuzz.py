"""Thousands of generated requests against a running admin server: requests built from the
OpenAPI document's schemas (valid ones must succeed), mutated and arbitrary bodies, raw bytes,
odd queries, paths, methods and Authorization headers. Never a 5xx; every JSON answer validates
against the document; afterwards the server is healthy and the store's index agrees with its tiers."""

from __future__ import annotations

import json
import urllib.parse

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from httputil import ThreadedServer
from kvstore.server import admin_url, create_admin_app, start_admin
from kvstore.server.openapi import DOCUMENT
from storeutil import make_config, make_store
from test_admin import TOKEN, populate

SCHEMAS = DOCUMENT["components"]["schemas"]
POSTS = {path: ops["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
         for path, ops in DOCUMENT["paths"].items() if "post" in ops}
FIELDS = sorted({name for name in (SCHEMAS[s]["properties"] for s in POSTS.values()) for name in name})
SETTINGS = settings(deadline=None, database=None, derandomize=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


# strategies from the schemas (the subset of JSON Schema the document uses)
def from_schema(schema: dict, hints: dict | None = None) -> st.SearchStrategy:
    hints = hints or {}
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        return st.floats(low, schema.get("maximum"), exclude_min="exclusiveMinimum" in schema, allow_nan=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True)
        return st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 64), 64))
    if kind == "array":
        return st.lists(from_schema(schema["items"]), max_size=80)
    assert kind == "object", schema
    props, required = schema["properties"], set(schema.get("required", ()))
    variants = [set(v["required"]) for v in schema.get("oneOf", [])] or [set()]
    exclusive = set().union(*variants)

    def field(name: str) -> st.SearchStrategy:
        own = from_schema(props[name])
        return st.one_of(own, hints[name]) if name in hints else own

    return st.one_of(*[st.fixed_dictionaries({k: field(k) for k in sorted(required | v)},
                                              optional={k: field(k) for k in sorted(set(props) - required - exclusive)})
                       for v in variants])


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=8), kids, max_size=5),
                    max_leaves=20)


class ThreadedAdmin(ThreadedServer):
    """An admin server over a populated tiny store."""

    def __init__(self, tmp_path):
        self.store = make_store(tmp_path)
        self.facts = populate(self.store)
        self.config = make_config(tmp_path, **{"admin.port": 0, "admin.token": TOKEN,
                                               "admin.max_body_bytes": "64KiB"})
        super().__init__()
        self.validators: dict = {}

    async def serve(self):
        runner = await start_admin(create_admin_app(self.store, self.config), self.config)
        host, port = admin_url(runner).split("//")[1].rsplit(":", 1)
        return runner, host, int(port)

    def close(self) -> None:
        self.store.close()

    def request(self, method: str, path: str, body: bytes | None = None, auth: str | None = None) -> tuple[int, bytes]:
        headers = {"Authorization": f"Bearer {TOKEN}" if auth is None else auth}
        if not headers["Authorization"]:
            del headers["Authorization"]
        if body is not None:
            headers["Content-Type"] = "application/json"
        resp, data = self.http.send(method, path, body, headers)
        self.requests += 1
        assert resp.status < 500, f"{method} {path}: {resp.status} {data[:300]!r}"
        if resp.getheader("Content-Type", "").startswith("application/json") and method != "HEAD":
            self.check(method, path, resp.status, json.loads(data))
        return resp.status, data

    def check(self, method: str, path: str, status: int, body) -> None:
        """The answer validates against the document (the status documented for the operation)."""
        template = _template(path)
        op = DOCUMENT["paths"].get(template, {}).get(method.lower()) if template else None
        if op is None or status == 405:
            assert status in (401, 404, 405), (method, path, status)
            name = "#/components/schemas/Error"
        else:
            assert str(status) in op["responses"], (method, path, status, body)
            name = op["responses"][str(status)]["content"]["application/json"]["schema"]
        key = json.dumps(name, sort_keys=True)
        if key not in self.validators:
            schema = name if isinstance(name, dict) else {"$ref": name}
            self.validators[key] = Draft202012Validator({**schema, "components": DOCUMENT["components"]})
        self.validators[key].validate(body)


def _template(path: str) -> str | None:
    path = urllib.parse.urlsplit(path).path
    if path in DOCUMENT["paths"]:
        return path
    if path.startswith("/v1/pages/") and path.count("/") == 3:
        return "/v1/pages/{key}"
    return None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ThreadedAdmin(tmp_path_factory.mktemp("fuzz")) as s:
        yield s
        assert s.request("GET", "/healthz") == (200, b'{"status": "ok"}')
        assert s.store.audit()["problems"] == []
        print(f"\nadmin fuzz: {s.requests} requests")


def _hints(server) -> dict:
    """Known token prefixes and keys, so that generated requests also hit cached pages."""
    docs = list(server.facts["tokens"].values())
    keys = [k.hex() for ks in server.facts["keys"].values() for k in ks]
    return {"tokens": st.sampled_from(docs).flatmap(lambda d: st.integers(0, len(d)).map(lambda n: d[:n])),
            "keys": st.lists(st.sampled_from(keys), max_size=8)}


CLUSTER_ONLY = {"/v1/peers/forget": (409,), "/v1/peer/pages": (403,)}


@settings(SETTINGS, max_examples=1000)
@given(data=st.data())
def test_schema_valid_requests_succeed(server, data):
    path = data.draw(st.sampled_from(sorted(POSTS)), label="path")
    body = data.draw(from_schema(SCHEMAS[POSTS[path]], _hints(server)), label="body")
    status, answer = server.request("POST", path, json.dumps(body).encode())
    if path == "/v1/lookup" and "text" in body:
        assert status == 400 and b"needs a model" in answer   # this server runs no engine
    elif path in CLUSTER_ONLY:                                # this server has no cluster index
        assert status in CLUSTER_ONLY[path], (path, body, answer)
    else:
        assert status == 200, (path, body, answer)


def _mutated(server) -> st.SearchStrategy:
    """A valid body with one field replaced by any JSON value, removed, or an unknown field added."""
    def mutate(args):
        path, body, field, value, how = args
        body = dict(body)
        if how == "replace":
            body[field] = value
        elif how == "drop" and body:
            body.pop(sorted(body)[0])
        else:
            body[field + "_x"] = value
        return path, json.dumps(body).encode()
    return st.sampled_from(sorted(POSTS)).flatmap(
        lambda path: st.tuples(st.just(path), from_schema(SCHEMAS[POSTS[path]], _hints(server)),
                               st.sampled_from(FIELDS), JSON, st.sampled_from(["replace", "drop", "add"]))
    ).map(mutate)


def _raw_bodies() -> st.SearchStrategy:
    return st.tuples(st.sampled_from(sorted(POSTS)), st.one_of(
        st.binary(max_size=300),
        JSON.map(lambda v: json.dumps(v).encode()),
        st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=4).map(lambda v: json.dumps(v).encode()),
        st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
        st.sampled_from([b"", b"{", b"[]", b"null", b'{"tier": NaN}', b'{"ttl_s": 1e999, "keys": []}',
                         b'{"tokens": [1e400]}', b'{"tokens": [' + b"9" * 5000 + b"]}", b"[" * 5000,
                         b'{"text": "\\ud800"}', b'{"tenant": "\\udfff", "tokens": []}']),
    ))


@settings(SETTINGS, max_examples=1000)
@given(data=st.data())
def test_malformed_bodies_are_client_errors(server, data):
    path, body = data.draw(st.one_of(_raw_bodies(), _mutated(server)), label="request")
    status, _ = server.request("POST", path, body)
    assert status in (200, 400) + CLUSTER_ONLY.get(path, ()), (path, body[:200], status)


@settings(SETTINGS, max_examples=300)
@given(data=st.data())
def test_unknown_fields_are_named(server, data):
    """An otherwise valid body with a field its schema does not name: 400, naming that field
    (/v1/peer/pages authenticates the peer before it reads the body)."""
    path = data.draw(st.sampled_from(sorted(set(POSTS) - {"/v1/peer/pages"})), label="path")
    schema = SCHEMAS[POSTS[path]]
    body = data.draw(from_schema(schema, _hints(server)), label="body")
    name = data.draw(st.text(min_size=1, max_size=20).filter(lambda n: n not in schema["properties"]), label="name")
    body[name] = data.draw(st.none() | st.integers() | st.text(max_size=20), label="value")
    status, answer = server.request("POST", path, json.dumps(body).encode())
    assert status == 400, (path, body, answer)
    assert json.loads(answer)["error"].startswith(f"unknown field {json.dumps(name)}; allowed: "), answer

def _query_value(schema: dict) -> st.SearchStrategy:
    valid = from_schema(schema).map(lambda v: str(v).lower() if isinstance(v, bool) else str(v))
    return st.one_of(valid, st.text(max_size=70), st.integers().map(str))


def _queries() -> st.SearchStrategy:
    def for_path(path: str) -> st.SearchStrategy:
        params = {p["name"]: p["schema"] for p in DOCUMENT["paths"][path]["get"].get("parameters", [])}
        names = st.sampled_from(sorted(params) + ["x", "limit", "tier"])
        pair = names.flatmap(lambda n: st.tuples(st.just(n), _query_value(params.get(n, {"type": "string"}))))
        return st.lists(pair, max_size=4).map(lambda q: path + ("?" + urllib.parse.urlencode(q) if q else ""))
    return st.sampled_from(["/v1/pages", "/v1/prefixes", "/v1/stats", "/v1/config"]).flatmap(for_path)


def _paths() -> st.SearchStrategy:
    segment = st.text(max_size=70).map(lambda s: urllib.parse.quote(s, safe=""))
    return st.one_of(
        segment.map(lambda s: f"/v1/pages/{s}"),
        st.from_regex(r"[0-9a-fA-F]{64}", fullmatch=True).map(lambda k: f"/v1/pages/{k}"),
        st.sampled_from(sorted(DOCUMENT["paths"])).map(lambda p: p.replace("{key}", "00" * 32)),
        segment.map(lambda s: f"/{s}"), segment.map(lambda s: f"/v1/{s}"))


@settings(SETTINGS, max_examples=1000)
@given(data=st.data())
def test_queries_paths_methods_and_auth(server, data):
    kind = data.draw(st.sampled_from(["query", "path", "method", "auth"]), label="kind")
    if kind == "query":
        path = data.draw(_queries(), label="path")
        status, _ = server.request("GET", path)
        assert status in (200, 400), path
    elif kind == "path":
        path = data.draw(_paths(), label="path")
        status, _ = server.request("GET", path)
        assert status in (200, 400, 404, 405), path
    elif kind == "method":
        method = data.draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]))
        path = data.draw(st.sampled_from(sorted(DOCUMENT["paths"])).map(lambda p: p.replace("{key}", "00" * 32)))
        body = data.draw(st.one_of(st.none(), st.binary(max_size=50)))
        status, _ = server.request(method, path, body)
        assert status in (200, 400, 404, 405, 503) + CLUSTER_ONLY.get(path, ()), (method, path)
    else:
        text = st.text(st.characters(codec="latin-1", exclude_categories=["Cc"]), max_size=60)   # what HTTP allows
        header = data.draw(st.one_of(text, text.map(lambda t: "Bearer " + t), st.just(f"Bearer {TOKEN}x"),
                                     st.just(f"Basic {TOKEN}"), st.just(f"bearer {TOKEN}")), label="header")
        path = data.draw(st.sampled_from(["/v1/stats", "/v1/pages", "/metrics", "/openapi.json", "/v1/config"]))
        status, _ = server.request("GET", path, auth=header)
        assert status == (200 if header.strip() in (f"Bearer {TOKEN}", f"bearer {TOKEN}") else 401), header

