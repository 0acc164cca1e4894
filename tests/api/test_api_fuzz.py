"""Thousands of generated requests against a running OpenAI-compatible server (tiny preset, a
context of 64 tokens): completions and chat, streamed and not, built from valid requests with
fields replaced by edge values (deep nesting, lone surrogates, 1e400, 10**30, wrong types, zero,
negative, null) or unknown fields added; raw bodies; odd headers, methods and paths. Never a 5xx;
every error is OpenAI's error JSON; afterwards the server is healthy, runs no request, no engine
step failed and nothing was logged as an error."""

from __future__ import annotations

import json
import logging
import re

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import AsyncLLM
from httputil import ThreadedServer
from app.api.server import create_app, warm_up
from app.api.models import ROLES
from app.api.config import ServerConfig
from test_api import make_llm

CONTEXT = 64                # max_seq_len: a chat request's default max_tokens stays short
SETTINGS = settings(deadline=None, database=None, derandomize=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


# JSON text that json.dumps cannot write: a string "\0raw:TEXT" is sent as TEXT
def raw(text: str) -> str:
    return "\0raw:" + text


def dumps(body) -> bytes:
    return re.sub(r'"\\u0000raw:([^"]*)"', lambda m: m.group(1), json.dumps(body)).encode()


def nested(depth: int) -> str:
    return raw("[" * depth + "]" * depth)


EDGES = st.sampled_from([
    None, True, False, 0, -1, 1, 10**30, -(10**30), 2**63, 0.5, -0.0, 1e308, "", "x", "\ud800", "abc\udfff",
    "\udc80\ud800x", [], {}, [1], [None], {"a": 1}, [[1, 2]], ["\ud800"], {"include_usage": "\ud800"},
    raw("1e400"), raw("-1e400"), raw("1e-400"), raw("1" + "0" * 30), raw("-" + "9" * 400), raw("1.5e308"),
    nested(50), nested(2000), nested(100_000), raw('{"a": ' * 3000 + "1" + "}" * 3000), "y" * (CONTEXT + 5),
    [600, 1], {"role": "wizard", "content": "x"}, [{"role": "user", "content": None}]])
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
                    max_leaves=12)
ANY = st.one_of(EDGES, EDGES, JSON)

TEXT = st.text(min_size=1, max_size=10)
IDS = st.lists(st.integers(0, 511), min_size=1, max_size=8)
PROMPT = st.one_of(TEXT, IDS, st.lists(st.one_of(TEXT, IDS), min_size=1, max_size=3))
CONTENT = st.one_of(TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2))
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(sorted(ROLES)), "content": CONTENT}),
                    min_size=1, max_size=2)
SHARED = {
    "model": st.just("tiny"), "max_tokens": st.integers(1, 4), "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1), "top_k": st.integers(0, 40), "n": st.integers(1, 3), "seed": st.integers(-9, 9),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=2)), "stop_token_ids": st.lists(st.integers(0, 300), max_size=2),
    "ignore_eos": st.booleans(), "priority": st.integers(-3, 3), "return_token_ids": st.booleans(),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": TEXT, "min_p": st.floats(0, 1), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2),
    "logit_bias": st.dictionaries(st.integers(0, 258).map(str), st.floats(-100, 100), max_size=3),
    "response_format": st.just({"type": "text"})}
FIELDS = {
    "/v1/completions": {**SHARED, "prompt": PROMPT, "logprobs": st.integers(0, 3), "echo": st.booleans()},
    "/v1/chat/completions": {**SHARED, "messages": MESSAGES, "logprobs": st.booleans(),
                             "top_logprobs": st.integers(0, 3), "max_completion_tokens": st.integers(1, 4)},
    "/tokenize": {"model": st.just("tiny"), "prompt": TEXT, "add_special_tokens": st.booleans(),
                  "return_token_strs": st.booleans()},
    "/detokenize": {"model": st.just("tiny"), "tokens": IDS},
}
REQUIRED = {"/v1/completions": "prompt", "/v1/chat/completions": "messages", "/tokenize": "prompt",
            "/detokenize": "tokens"}


def valid_body(path: str) -> st.SearchStrategy:
    fields = FIELDS[path]
    required = REQUIRED[path]
    return st.fixed_dictionaries({required: fields[required]},
                                 optional={k: v for k, v in fields.items() if k != required})


def mutated(path: str) -> st.SearchStrategy:
    """A valid body with up to three fields replaced by an edge value, removed, or added unknown."""
    def mutate(args) -> bytes:
        body, changes = args
        body = dict(body)
        for name, how, value in changes:
            if how == "replace":
                body[name] = value
            elif how == "drop":
                body.pop(name, None)
            else:
                body[name + "_x"] = value
        return dumps(body)
    change = st.tuples(st.sampled_from(sorted(FIELDS[path])), st.sampled_from(["replace", "replace", "drop", "add"]),
                       ANY)
    return st.tuples(valid_body(path), st.lists(change, max_size=3)).map(mutate)


class ThreadedApi(ThreadedServer):
    """The OpenAI API over the tiny preset, served as `kvstore serve` serves it (an AppRunner and
    a TCPSite, no handler cancellation)."""

    wait_s = 60

    def __init__(self, tmp_path):
        self.llm = make_llm(tmp_path, max_seq_len=str(CONTEXT))
        super().__init__()
        self.statuses: dict[int, int] = {}

    async def serve(self):
        self.engine = AsyncLLM(self.llm)
        await self.engine.start()
        app = create_app(self.engine, ServerConfig(trust_tenant_header=True), max_body_bytes=1 << 20)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        await warm_up(self.engine, app)
        return runner, "127.0.0.1", runner.addresses[0][1]

    async def stop(self) -> None:
        await self.engine.stop()

    def close(self) -> None:
        self.llm.close()

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict | None = None) -> tuple[int, str, bytes]:
        headers = {"Content-Type": "application/json", **(headers or {})}
        resp, data = self.http.send(method, path, body, headers)
        self.requests += 1
        self.statuses[resp.status] = self.statuses.get(resp.status, 0) + 1
        ctype = resp.getheader("Content-Type", "")
        check_answer(method, path, resp.status, ctype, data, body)
        return resp.status, ctype, data


def check_answer(method: str, path: str, status: int, ctype: str, data: bytes, body: bytes | None = None) -> None:
    """Never a 5xx; an error is OpenAI's error JSON (one line); a success is a completion, or
    server-sent events of JSON chunks ending with [DONE] and holding no error."""
    where = f"{method} {path}: {status} {data[:300]!r}"
    assert status < 500, where
    if method == "HEAD":
        return
    if status != 200:
        assert ctype.startswith("application/json"), where
        error = json.loads(data)["error"]
        assert isinstance(error["message"], str) and error["message"] and "\n" not in error["message"], where
        assert isinstance(error["type"], str) and (error["param"] is None or isinstance(error["param"], str)), where
        return
    if ctype.startswith("text/event-stream"):
        events = [line[len(b"data: "):] for line in data.split(b"\n\n") if line]
        assert events and events[-1] == b"[DONE]", where
        for event in events[:-1]:
            chunk = json.loads(event)
            assert "error" not in chunk and "choices" in chunk, where
    elif method == "POST" and path == "/tokenize":
        answer, asked = json.loads(data), json.loads(body or b"{}")
        # an empty prompt without special tokens is no tokens, as vLLM's; anything else at least one
        empty = asked.get("prompt") in ("", []) and asked.get("add_special_tokens") is False
        assert answer["count"] == len(answer["tokens"]) and answer["count"] >= (0 if empty else 1), where
    elif method == "POST" and path == "/detokenize":
        assert isinstance(json.loads(data)["prompt"], str), where
    elif method == "POST":
        answer = json.loads(data)
        assert answer["choices"] and answer["usage"]["total_tokens"] <= CONTEXT * len(answer["choices"]), where


class ErrorLog(logging.Handler):
    """Every record at ERROR or above, from any thread."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    errors = ErrorLog()
    logging.getLogger().addHandler(errors)
    try:
        with ThreadedApi(tmp_path_factory.mktemp("api-fuzz")) as s:
            yield s
            status, _, body = s.request("GET", "/health")
            assert (status, json.loads(body)) == (200, {"status": "ok"})
            stats = s.llm.stats()
            assert stats["running"] == stats["waiting"] == stats["loading"] == stats["failed_steps"] == 0, stats
            hot = s.llm.store.stats()["tiers"]["hot"]
            assert hot["referenced_pages"] == hot["allocated_pages"] == 0, hot
            assert s.llm.store.audit(cold=False)["problems"] == []
            print(f"\nOpenAI API fuzz: {s.requests} requests, statuses {sorted(s.statuses.items())}")
    finally:
        logging.getLogger().removeHandler(errors)
    assert not errors.records, [f"{r.name}: {r.getMessage()[:300]}" for r in errors.records]


PATHS = sorted(FIELDS)


@settings(SETTINGS, max_examples=1100)
@given(data=st.data())
def test_valid_and_mutated_requests_are_answered_or_refused(server, data):
    path = data.draw(st.sampled_from(PATHS), label="path")
    body = data.draw(st.one_of(valid_body(path).map(dumps), mutated(path)), label="body")
    status, _, data = server.request("POST", path, body)
    assert status in (200, 400) or wrong_model(status, data), (path, body[:300])


def wrong_model(status: int, data: bytes) -> bool:
    """404 is the answer to a model other than the served one, and only to that."""
    return status == 404 and json.loads(data)["error"]["code"] == "model_not_found"


def raw_bodies() -> st.SearchStrategy:
    fields = sorted(set(FIELDS["/v1/completions"]) | set(FIELDS["/v1/chat/completions"]))
    return st.one_of(
        st.binary(max_size=200),
        JSON.map(lambda v: json.dumps(v).encode()),
        st.dictionaries(st.sampled_from(fields), ANY, max_size=4).map(dumps),
        st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")),
        st.sampled_from([b"", b"{", b"[]", b"null", b'"x"', b"1e400", b"[" * 100_000, b"[" * 100_000 + b"]" * 100_000,
                         b'{"prompt": NaN}', b'{"prompt": "x", "temperature": Infinity}',
                         b'{"prompt": "x", "max_tokens": 1e400}', b'{"prompt": [1e400]}',
                         b'{"prompt": "abc\\ud800"}', b'{"prompt": ["ok", "\\udfff"]}',
                         b'{"messages": [{"role": "user", "content": "abc\\ud800"}]}',
                         b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
                         b'{"prompt": "x", "user": "\\ud800"}', b'{"prompt": "x", "stop": "\\ud800"}',
                         b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
                         "{\"prompt\": \"\u00e9\"}".encode("utf-16"), b'\xff\xfe{"prompt": 1}']))


@settings(SETTINGS, max_examples=700)
@given(data=st.data())
def test_raw_bodies_are_client_errors(server, data):
    path = data.draw(st.sampled_from(PATHS), label="path")
    body = data.draw(raw_bodies(), label="body")
    status, _, data = server.request("POST", path, body)
    assert status in (200, 400) or wrong_model(status, data), (path, body[:300])


@settings(SETTINGS, max_examples=300)
@given(data=st.data())
def test_headers_methods_and_paths(server, data):
    kind = data.draw(st.sampled_from(["tenant", "content-type", "method", "path"]), label="kind")
    body = dumps({"prompt": "hi", "max_tokens": 2})
    if kind == "tenant":     # any bytes HTTP allows in a header value, UTF-8 or not
        value = data.draw(st.binary(min_size=1, max_size=20).map(lambda b: bytes(c for c in b if c >= 32 and c != 127)
                                                                  or b"t"), label="X-Tenant")
        status, _, _ = server.request("POST", "/v1/completions", body, {"X-Tenant": value})
        assert status in (200, 400), value
    elif kind == "content-type":
        value = data.draw(st.sampled_from(["text/plain", "application/x-www-form-urlencoded", "", "multipart/form-data",
                                           "application/json; charset=latin-1"]), label="Content-Type")
        status, _, _ = server.request("POST", "/v1/completions", body, {"Content-Type": value})
        assert status == 200, value
    elif kind == "method":
        method = data.draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]), label="method")
        status, _, _ = server.request(method, data.draw(st.sampled_from(PATHS)), body)
        assert status == 405, method
    else:
        segment = data.draw(st.text(max_size=30).map(lambda s: re.sub(r"[^A-Za-z0-9._~-]", "%2F", s)), label="path")
        status, _, _ = server.request("POST", f"/v1/{segment}", body)
        assert status in (404, 405) or segment in ("completions", "chat%2Fcompletions"), segment


# the inputs reported broken, one by one
REPORTED = [
    ("deep nesting", "/v1/completions", b"[" * 100_000, None, "nested too deeply"),
    ("deep nesting in a field", "/v1/completions", dumps({"prompt": "x", "stop": nested(100_000)}), None,
     "nested too deeply"),
    ("lone surrogate in the prompt", "/v1/completions", b'{"prompt": "abc\\ud800"}', "prompt",
     "prompt is not valid Unicode: a lone surrogate at character 3"),
    ("lone surrogate in one of the prompts", "/v1/completions", b'{"prompt": ["ok", "\\udfff"]}', "prompt",
     "prompt[1] is not valid Unicode"),
    ("lone surrogate in a message", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "abc\\ud800"}]}', "messages[1]",
     "messages[1].content is not valid Unicode"),
    ("lone surrogate in a text part", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}', "messages[0]",
     "messages[0].content is not valid Unicode"),
    ("lone surrogate in the user", "/v1/completions", b'{"prompt": "x", "user": "\\ud800"}', "user",
     "user is not valid Unicode"),
    ("NaN", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', None, "NaN is not JSON"),
    ("1e400", "/v1/completions", b'{"prompt": "x", "max_tokens": 1e400}', "max_tokens",
     "max_tokens = Infinity: input should be a valid integer"),
    ("10**30", "/v1/completions", b'{"prompt": "x", "max_tokens": 1000000000000000000000000000000}', "max_tokens",
     "maximum context length is 64 tokens"),
    ("true as top_k", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "0"}], "top_k": true}',
     "top_k", "top_k = true: input should be a valid integer"),
    ("true as temperature", "/v1/completions", b'{"prompt": "x", "temperature": true}', "temperature",
     "temperature = true: input should be a valid number"),
    ("true in stop_token_ids", "/v1/completions", b'{"prompt": "x", "stop_token_ids": [true]}', "stop_token_ids",
     "stop_token_ids[0] = true: input should be a valid integer"),
]


@pytest.mark.parametrize("case, path, body, param, message", REPORTED, ids=[c[0] for c in REPORTED])
def test_reported_inputs_are_400_naming_the_field(server, case, path, body, param, message):
    status, _, data = server.request("POST", path, body)
    error = json.loads(data)["error"]
    assert status == 400 and message in error["message"], (status, error)
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_non_utf8_tenant_header_is_400(server):
    status, _, data = server.request("POST", "/v1/completions", dumps({"prompt": "x", "max_tokens": 1}),
                                     {"X-Tenant": b"acme\xff"})
    assert status == 400 and "X-Tenant" in json.loads(data)["error"]["message"], data


def test_a_tiny_temperature_samples_greedily(server):
    """Found by the fuzz: logits / 5e-127 overflowed to a NaN distribution and failed the engine step
    (500) with every request batched with it."""
    body = {"prompt": "greedy", "max_tokens": 4, "ignore_eos": True, "return_token_ids": True}
    answers = [json.loads(server.request("POST", "/v1/completions", dumps({**body, "temperature": t}))[2])
               for t in (0, 5e-127, 1e-6)]
    assert answers[0]["choices"][0]["token_ids"] == answers[1]["choices"][0]["token_ids"] \
        == answers[2]["choices"][0]["token_ids"], answers
