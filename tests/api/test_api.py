"""The OpenAI-compatible API: a real aiohttp server on loopback over the real engine (tiny preset),
spoken to with aiohttp and with the official `openai` client; and `kvstore serve` as a process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import sys

import aiohttp
import openai
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer

from engine import LLM, AsyncLLM, SamplingParams
from app.api.server import create_app, warm_up
from engine.config import load_config

pytestmark = pytest.mark.asyncio(loop_scope="module")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECRET = "zebra-quartz-7731 confidential prompt"   # must never reach the logs
LONG_TEXT = "The quarterly report shows revenue growth across all regions. " * 3   # ~190 tokens


def make_llm(tmp_path, **overrides) -> LLM:
    config = load_config(None, {}, {"data_dir": str(tmp_path), "hot.device": "cpu", "hot.pool": "8MiB",
                                    "warm.bytes": "8MiB", **overrides})
    return LLM("tiny", config=config)


class Api:
    """A running server and a client session to it."""

    def __init__(self, server: TestServer, session: aiohttp.ClientSession):
        self.server, self.session = server, session
        self.url = str(server.make_url("")).rstrip("/")

    async def post(self, path: str, body=None, data: bytes | None = None, headers: dict | None = None):
        async with self.session.post(self.url + path, json=body if data is None else None, data=data,
                                     headers=headers) as r:
            return r.status, await r.json(), r.headers

    async def get(self, path: str):
        async with self.session.get(self.url + path) as r:
            return r.status, await r.json()

    async def stream(self, path: str, body: dict) -> list:
        """The server-sent events of a streaming request: JSON chunks, then the string '[DONE]'."""
        events = []
        async with self.session.post(self.url + path, json={**body, "stream": True}) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            async for line in r.content:
                line = line.decode().strip()
                if line:
                    assert line.startswith("data: ")
                    payload = line[len("data: "):]
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
        return events

    def openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0)


async def start_api(llm: LLM, **app_options):
    engine = AsyncLLM(llm)
    await engine.start()
    app = create_app(engine, **app_options)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    return engine, app, server


@contextlib.asynccontextmanager
async def serving(llm: LLM, **app_options):
    """The API over `llm`, started and warmed up; stopped on exit."""
    engine, app, server = await start_api(llm, **app_options)
    await warm_up(engine, app)
    try:
        yield server
    finally:
        await server.close()
        await engine.stop()


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    llm = make_llm(tmp_path_factory.mktemp("api"))
    yield llm
    llm.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(llm):
    async with serving(llm) as server:
        yield server


@pytest_asyncio.fixture(loop_scope="module")
async def api(server):
    async with aiohttp.ClientSession() as session:
        yield Api(server, session)


def completion(prompt, **fields) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, **fields}


# completions
async def test_completion_of_text_and_of_token_ids(api):
    status, body, _ = await api.post("/v1/completions", completion("Hello there", return_token_ids=True))
    assert status == 200, body
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == "tiny"
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and len(choice["token_ids"]) == 12
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(body["prompt_token_ids"]) == 12   # BOS + 11 bytes
    assert usage["completion_tokens"] == 12 and usage["total_tokens"] == 24
    assert "cached_tokens" in usage["prompt_tokens_details"]

    status, by_ids, _ = await api.post("/v1/completions", completion(body["prompt_token_ids"], return_token_ids=True))
    assert status == 200, by_ids
    assert by_ids["prompt_token_ids"] == body["prompt_token_ids"]
    assert by_ids["choices"][0]["token_ids"] == choice["token_ids"]
    assert by_ids["choices"][0]["text"] == choice["text"]


async def test_return_token_ids_match_llm_generate(api, tmp_path):
    prompt = "Token ids must match the offline engine"
    status, body, _ = await api.post("/v1/completions", completion(prompt, max_tokens=20, return_token_ids=True))
    assert status == 200, body
    offline = make_llm(tmp_path)      # same preset and seed: the same weights
    try:
        [ref] = offline.generate([prompt], SamplingParams(max_tokens=20))
    finally:
        offline.close()
    assert body["prompt_token_ids"] == ref.prompt_token_ids
    assert body["choices"][0]["token_ids"] == ref.token_ids
    assert body["choices"][0]["text"] == ref.text


async def test_repeated_long_prompt_is_served_from_the_cache_whatever_the_user(api):
    """`user` is only recorded: without API keys every request is in one tenant, so a shared
    prompt is shared between users (tenants by key: test_api_vllm.py)."""
    body = completion(LONG_TEXT + "first", max_tokens=2)
    _, first, _ = await api.post("/v1/completions", {**body, "user": "alice"})
    _, again, _ = await api.post("/v1/completions", {**body, "user": "alice"})
    _, other, _ = await api.post("/v1/completions", {**body, "user": "bob"})
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert prompt_tokens > 150
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) // 16 * 16
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) // 16 * 16
    assert again["choices"][0]["text"] == first["choices"][0]["text"] == other["choices"][0]["text"]


async def test_several_prompts_and_n(api):
    prompts = ["alpha beta", "gamma delta"]
    _, batch, _ = await api.post("/v1/completions", completion(prompts))
    singles = [(await api.post("/v1/completions", completion(p)))[1] for p in prompts]
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert [c["text"] for c in batch["choices"]] == [s["choices"][0]["text"] for s in singles]
    assert batch["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)

    status, sampled, _ = await api.post("/v1/completions", completion("alpha beta", n=3, temperature=1.0, seed=5))
    assert status == 200 and [c["index"] for c in sampled["choices"]] == [0, 1, 2]
    assert len({c["text"] for c in sampled["choices"]}) > 1      # seed + j per sample
    _, again, _ = await api.post("/v1/completions", completion("alpha beta", n=3, temperature=1.0, seed=5))
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in sampled["choices"]]


async def test_logprobs(api):
    _, body, _ = await api.post("/v1/completions", completion("log probs", max_tokens=6, logprobs=2))
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert all(v <= 0 for v in lp["token_logprobs"]) and lp["text_offset"][0] == 0
    assert all(2 <= len(top) <= 3 for top in lp["top_logprobs"])   # the top 2, and the sampled token


# streaming
async def test_stream_concatenates_to_the_full_text(api):
    body = completion("Streaming should match", max_tokens=32)
    _, full, _ = await api.post("/v1/completions", body)
    events = await api.stream("/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 32
    assert usage["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"]
    assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] == 16    # the first request's full page
    chunks = events[:-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert all(c["id"] == chunks[0]["id"] and c["object"] == "text_completion" for c in chunks)


async def test_stop_string_is_cut_alike_streamed_or_not(api):
    body = completion("Stop strings", max_tokens=32)
    _, full, _ = await api.post("/v1/completions", body)
    text = full["choices"][0]["text"]
    at = next(i for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    stop = text[at:at + 2]
    expected = text[:text.find(stop)]
    _, cut, _ = await api.post("/v1/completions", {**body, "stop": stop})
    assert cut["choices"][0]["text"] == expected and cut["choices"][0]["finish_reason"] == "stop"
    events = await api.stream("/v1/completions", {**body, "stop": [stop]})
    assert "".join(c["choices"][0]["text"] for c in events[:-1]) == expected
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


# chat
async def test_chat_completion(api):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 10, "temperature": 0, "return_token_ids": True}
    status, chat, _ = await api.post("/v1/chat/completions", body)
    assert status == 200, chat
    assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-")
    [choice] = chat["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    # the chat template, then the same generation as a completion of the rendered prompt
    _, as_completion, _ = await api.post("/v1/completions", completion(chat["prompt_token_ids"], max_tokens=10))
    assert choice["message"]["content"] == as_completion["choices"][0]["text"]

    events = await api.stream("/v1/chat/completions", body)
    chunks = events[:-1]
    assert events[-1] == "[DONE]" and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == choice["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_client_going_away_mid_stream(api, caplog):
    body = completion("going away", max_tokens=200, ignore_eos=True, stream=True)
    async with api.session.post(api.url + "/v1/completions", json=body) as r:
        assert (await r.content.readline()).startswith(b"data: {")
    status, ok, _ = await api.post("/v1/completions", completion("still here", max_tokens=2))
    assert status == 200, ok
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


# the official client
async def test_openai_client_completions(api):
    client = api.openai()
    async with client:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        done = await client.completions.create(model="tiny", prompt="OpenAI client", max_tokens=16,
                                               temperature=0, extra_body={"return_token_ids": True})
        assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 16
        stream = await client.completions.create(model="tiny", prompt="OpenAI client", max_tokens=16,
                                                 temperature=0, stream=True)
        text = "".join([chunk.choices[0].text async for chunk in stream])
        assert text == done.choices[0].text


async def test_openai_client_chat(api):
    client = api.openai()
    messages = [{"role": "user", "content": "Say something."}]
    async with client:
        done = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                    logprobs=True, top_logprobs=2)
        message = done.choices[0].message
        assert message.role == "assistant" and done.usage.completion_tokens == 12
        assert len(done.choices[0].logprobs.content) == 12
        stream = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
        assert chunks[-1].usage.completion_tokens == 12


async def test_openai_client_sees_errors(api):
    async with api.openai() as client:
        with pytest.raises(openai.BadRequestError, match="temperature"):
            await client.completions.create(model="tiny", prompt="x", temperature=-1)


# errors
BAD_REQUESTS = [
    ("prompt longer than max_seq_len", completion([1] * 5000), "maximum context length is 4096 tokens", "prompt"),
    ("temperature -1", completion("x", temperature=-1), "temperature = -1.0: must be", "temperature"),
    ("top_p 0", completion("x", top_p=0), "top_p = 0.0: must be", "top_p"),
    ("max_tokens 0", completion("x", max_tokens=0), "max_tokens = 0: must be", "max_tokens"),
    ("max_tokens of a wrong type", completion("x", max_tokens="ten"), "max_tokens = 'ten': input should be a valid "
     "integer", "max_tokens"),
    ("a boolean for a number", completion("x", temperature=True), "temperature = true: input should be a valid "
     "number", "temperature"),
    ("malformed JSON", b'{"model": "tiny", "prompt": ', "not valid JSON", None),
    ("not an object", [1, 2], "must be a JSON object", None),
    ("missing prompt", {"model": "tiny", "max_tokens": 4}, "prompt is required", "prompt"),
    ("empty prompt", completion(""), "prompt must not be empty", "prompt"),
    ("prompt of a wrong type", completion({"text": "x"}), "prompt must be a string", "prompt"),
    ("unknown field", completion("x", frobnicate=1), "frobnicate: unknown field", "frobnicate"),
    ("an unknown field named with a line break", completion("x", **{"a\nb": 1}), "['a\\nb']: unknown field",
     "['a\\nb']"),
    ("a logit_bias key with a line break", completion("x", logit_bias={"\n": None}),
     "logit_bias['\\n'] = null: input should be a valid number", "logit_bias"),
    ("a logit_bias token id as text", completion("x", logit_bias={"50256": "x"}),
     "logit_bias.50256 = 'x': input should be a valid number", "logit_bias"),
    ("unsupported response_format", completion("x", response_format={"type": "json_object"}),
     'response_format = {"type": "json_object"}: not supported', "response_format"),
    ("tools", completion("x", tools=[{"type": "function"}]), "tools = [", "tools"),
    ("token id out of the vocabulary", completion([1, 99999]), "token ids must be integers", None),
]


@pytest.mark.parametrize("case, body, message, param", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
async def test_bad_completion_requests_are_400(api, case, body, message, param):
    data = body if isinstance(body, bytes) else None
    status, error, _ = await api.post("/v1/completions", None if data else body, data=data)
    assert status == 400, error
    assert message in error["error"]["message"] and "\n" not in error["error"]["message"]
    assert error["error"]["type"] == "invalid_request_error" and error["error"]["param"] == param
    status, ok, _ = await api.post("/v1/completions", completion("still serving", max_tokens=2))
    assert status == 200 and ok["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("messages, message", [
    (None, "messages must be a non-empty list"),
    ([], "messages must be a non-empty list"),
    ([{"role": "wizard", "content": "hi"}], "messages[0] must be an object with a role"),
    ([{"role": "user", "content": 5}], "messages[0] must be an object with a role"),
])
async def test_bad_chat_requests_are_400(api, messages, message):
    status, error, _ = await api.post("/v1/chat/completions", {"model": "tiny", "messages": messages})
    assert status == 400 and message in error["error"]["message"], error


async def test_unknown_path_and_models(api):
    status, error, _ = await api.post("/v1/embeddings", {"model": "tiny", "input": "x"})
    assert status == 404 and "error" in error
    assert (await api.get("/v1/models/tiny"))[1]["id"] == "tiny"
    assert (await api.get("/v1/models/other"))[0] == 404


async def test_logs_hold_no_prompt_content(api, caplog):
    caplog.set_level(logging.DEBUG)
    await api.post("/v1/completions", completion(SECRET, logprobs=1))
    await api.stream("/v1/completions", completion(SECRET))
    await api.post("/v1/completions", completion(SECRET, temperature=-1))
    await api.post("/v1/completions", completion(SECRET, model="unknown"))
    await api.post("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": SECRET}],
                                            "max_tokens": 4})
    await api.post("/v1/completions", completion(SECRET * 200))     # too long
    assert "POST /v1/completions" in caplog.text                    # the access log was captured
    assert "zebra" not in caplog.text and "quartz" not in caplog.text


# a server of its own: warm-up, queue depth, body limit
@pytest_asyncio.fixture(loop_scope="module")
async def small_api(tmp_path):
    llm = make_llm(tmp_path, **{"scheduler.max_queue_depth": "1"})
    engine, app, server = await start_api(llm, max_body_bytes=64 * 1024)
    try:
        async with aiohttp.ClientSession() as session:
            yield Api(server, session), engine, app
    finally:
        await server.close()
        await engine.stop()
        llm.close()


async def test_health_is_503_until_warm_up_is_done(small_api):
    api, engine, app = small_api
    status, body = await api.get("/health")
    assert status == 503 and body["status"] != "ok"
    await warm_up(engine, app)
    assert await api.get("/health") == (200, {"status": "ok"})


async def test_full_queue_is_429_with_retry_after(small_api):
    api, _, _ = small_api
    body = completion("fill the queue", max_tokens=64, ignore_eos=True)
    results = await asyncio.gather(*(api.post("/v1/completions", body) for _ in range(12)))
    refused = [(b, h) for s, b, h in results if s == 429]
    served = [b for s, b, _ in results if s == 200]
    assert refused and served and len(refused) + len(served) == 12, [s for s, _, _ in results]
    for error, headers in refused:
        assert int(headers["Retry-After"]) >= 1
        assert error["error"]["type"] == "rate_limit_error" and "max_queue_depth" in error["error"]["message"]
    assert all(b["usage"]["completion_tokens"] == 64 for b in served)
    status, ok, _ = await api.post("/v1/completions", completion("after the rush", max_tokens=2))
    assert status == 200, ok


async def test_body_over_the_limit_is_413(small_api):
    api, _, _ = small_api
    status, error, _ = await api.post("/v1/completions", completion("x" * 100_000))
    assert status == 413 and "over the limit of 65536 bytes" in error["error"]["message"]
    assert (await api.post("/v1/completions", completion("small", max_tokens=2)))[0] == 200


# the command
async def run_kvstore(*args: str, cwd) -> asyncio.subprocess.Process:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    return await asyncio.create_subprocess_exec(sys.executable, "-m", "app", *args, cwd=cwd, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)


async def test_kvstore_serve_answers_and_stops_on_sigterm(tmp_path):
    proc = await run_kvstore("serve", "--model", "tiny", "--port", "0", "--admin-port", "0",
                             "--data-dir", str(tmp_path / "data"), "--set", "hot.pool=8MiB", cwd=tmp_path)
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
        m = re.fullmatch(r"kvstore serve: tiny ready on (http://127\.0\.0\.1:\d+) \(OpenAI API: /v1/completions, "
                         r"/v1/chat/completions\); admin API on (http://127\.0\.0\.1:\d+)\n", line)
        assert m, (line, (await proc.stderr.read()).decode()[-2000:] if not line else "")
        async with aiohttp.ClientSession() as session:
            api = Api.__new__(Api)
            api.session, api.url = session, m.group(1)
            assert await api.get("/health") == (200, {"status": "ok"})
            status, body, _ = await api.post("/v1/completions", completion(SECRET, max_tokens=4))
            assert status == 200 and body["usage"]["completion_tokens"] == 4
            admin = Api.__new__(Api)
            admin.session, admin.url = session, m.group(2)
            assert (await admin.get("/readyz"))[0] == 200
            status, stats = await admin.get("/v1/stats")
            assert status == 200 and stats["engine"]["running"] == 0
            async with session.get(m.group(2) + "/metrics") as resp:
                assert "kvstore_request_latency_seconds_count 4.0" in await resp.text()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
        err = (await proc.stderr.read()).decode()
        assert "Traceback" not in err and "zebra" not in err
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.parametrize("args, message", [
    (["--port", "99999"], "server.port = '99999': must be a port number"),
    (["--model", "no-such-model"], "model = 'no-such-model'"),
    (["--set", "scheduler.max_queue_depth=0"], "scheduler.max_queue_depth"),
])
async def test_kvstore_serve_bad_options_exit_2(tmp_path, args, message):
    proc = await run_kvstore("serve", "--data-dir", str(tmp_path), *args, cwd=tmp_path)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 2 and message in err.decode(), err.decode()
    assert err.decode().count("\n") == 1 and out == b""
