"""A drop-in for vLLM's server: the official `openai` client against real `kvstore serve` processes,
with and without API keys, streaming and not.

- every endpoint: /v1/completions, /v1/chat/completions, /v1/models (vLLM's fields), /tokenize,
  /detokenize, /version, /health, /metrics on the API port; a wrong model is 404;
- every sampling parameter honoured (penalties, logit_bias, min_p, echo) against a reference
  computed here from transformers' logits, or refused with 400 naming it (response_format, tools,
  unknown fields);
- API keys: 401 without one, tenants by key (a prompt cached for one key is not for another), the
  X-Tenant header refused unless server.trust_tenant_header; `user` only recorded;
- flags: --served-model-name, --max-model-len, --api-key, --host; a busy port fails before the model loads.
"""

from __future__ import annotations

import re
import select
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import openai
import pytest
import torch

from conftest import clean_env, terminate
from kvstore import __version__

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from hfutil import write_hf_model  # noqa: E402

KEY, ALICE, BOB = "sk-default-0d1e", "sk-alice-93ab", "sk-bob-71c2"
DOC = "The quick brown fox jumps over the lazy dog. Pages move between the hot, warm and cold tiers. " * 2
READY = re.compile(r"kvstore serve: .* ready on (http://\S+) .*admin API on (http://\S+)\n")


class Serve:
    """A `kvstore serve` process: its API and admin URLs."""

    def __init__(self, tmp_path, *args: str, env: dict | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app", "serve", "--host", "127.0.0.1", "--port", "0", "--admin-port", "0",
             "--data-dir", str(tmp_path / "data"), "--set", "hot.pool=8MiB", "--set", "warm.bytes=8MiB", *args],
            cwd=tmp_path, env=clean_env(**(env or {})), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 180)
        line = self.proc.stdout.readline() if ready else ""
        m = READY.fullmatch(line)
        if not m:
            self.stop()
            raise AssertionError(f"kvstore serve did not start: {line!r} {self.proc.stderr.read()[-2000:]}")
        self.url, self.admin = m.group(1), m.group(2)

    def client(self, key: str = "unused", root: bool = False) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + ("" if root else "/v1"), api_key=key, max_retries=0)

    def stop(self) -> str:
        terminate(self.proc)
        return self.proc.stderr.read()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_hf_model(tmp_path_factory.mktemp("model") / "llama-test", "llama")


@pytest.fixture(scope="module")
def open_server(tmp_path_factory, model_dir):
    serve = Serve(tmp_path_factory.mktemp("open"), "--model", str(model_dir), "--served-model-name", "my-llama",
                  "--max-model-len", "200")
    yield serve
    err = serve.stop()
    assert "Traceback" not in err and "quick brown" not in err   # logs hold no prompt text


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    serve = Serve(tmp_path_factory.mktemp("keyed"), "--model", "tiny", "--api-key", KEY,
                  env={"KVSTORE_SERVER_API_KEYS": f"{ALICE}=alice,{BOB}=bob"})
    yield serve
    err = serve.stop()
    assert "Traceback" not in err
    assert KEY not in err and ALICE not in err and BOB not in err      # keys never logged
    assert "user='carol'" in err                                       # `user` is recorded


@pytest.fixture(scope="module")
def reference(model_dir):
    """(prompt ids, n, penalties) -> the greedy tokens vLLM's definitions give on transformers' logits."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = len(transformers.AutoTokenizer.from_pretrained(model_dir))

    def run(prompt: list[int], n: int, presence=0.0, frequency=0.0, repetition=1.0, bias=None) -> list[int]:
        out: list[int] = []
        for _ in range(n):
            with torch.no_grad():
                row = model(torch.tensor([prompt + out])).logits[0, -1, :vocab].double().numpy().copy()
            for token, b in (bias or {}).items():
                row[token] += b
            seen = set(prompt + out)
            for token in seen:      # repetition: prompt and output
                row[token] = row[token] / repetition if row[token] > 0 else row[token] * repetition
            counts = np.bincount(np.array(out, dtype=np.int64), minlength=vocab)[:vocab]
            row -= frequency * counts + presence * (counts > 0)     # presence, frequency: output only
            out.append(int(row.argmax()))
        return out
    return run


def get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.status, r.read().decode()


def tokenize(serve: Serve, **body) -> dict:
    return serve.client(root=True).post("/tokenize", body=body, cast_to=object)


# endpoints
def test_models_lists_vllm_fields_under_the_served_name(open_server, model_dir):
    client = open_server.client()
    [card] = client.models.list().data
    assert card.id == "my-llama" and card.owned_by == "kvstore"
    extra = card.model_extra
    assert extra["root"] == str(model_dir) and extra["max_model_len"] == 200 and extra["parent"] is None
    assert client.models.retrieve("my-llama").id == "my-llama"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("llama-test")


def test_a_wrong_model_is_404_with_the_openai_error(open_server):
    with pytest.raises(openai.NotFoundError) as info:
        open_server.client().completions.create(model="gpt-4o", prompt="x", max_tokens=2)
    error = info.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model" and "gpt-4o" in error["message"]
    with pytest.raises(openai.NotFoundError):
        open_server.client().chat.completions.create(model="llama-test", messages=[{"role": "user", "content": "x"}])


def test_tokenize_detokenize_and_version(open_server, model_dir):
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    out = tokenize(open_server, model="my-llama", prompt=DOC, return_token_strs=True)
    assert out["tokens"] == hf(DOC)["input_ids"] and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 200 and out["token_strs"] == hf.convert_ids_to_tokens(out["tokens"])
    assert tokenize(open_server, prompt=DOC, add_special_tokens=False)["tokens"] == out["tokens"][1:]
    assert tokenize(open_server, prompt="x")["token_strs"] is None
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    chat = tokenize(open_server, messages=messages)
    rendered = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == hf(rendered, add_special_tokens=False)["input_ids"]
    root = open_server.client(root=True)
    assert root.post("/detokenize", body={"tokens": out["tokens"]}, cast_to=object) == {"prompt": DOC}
    assert root.get("/version", cast_to=object) == {"version": __version__}
    with pytest.raises(openai.BadRequestError, match="tokens"):
        root.post("/detokenize", body={"tokens": [10 ** 6]}, cast_to=object)
    with pytest.raises(openai.BadRequestError, match="frobnicate: unknown field"):
        root.post("/tokenize", body={"prompt": "x", "frobnicate": True}, cast_to=object)


def test_metrics_on_the_api_port(open_server):
    open_server.client().completions.create(model="my-llama", prompt="metrics", max_tokens=2)
    text = get(open_server.url + "/metrics")[1]
    assert "kvstore_requests_total" in text and "kvstore_tier_used_bytes" in text
    assert get(open_server.url + "/health") == (200, '{"status": "ok"}')


def test_max_model_len_is_the_context(open_server):
    with pytest.raises(openai.BadRequestError, match="maximum context length is 200 tokens"):
        open_server.client().completions.create(model="my-llama", prompt=DOC * 3, max_tokens=150)


# parameters
def completion(serve: Serve, stream: bool, **fields):
    """(text, token ids) of one choice, streamed or not."""
    client = serve.client()
    extra = {k: fields.pop(k) for k in ("top_k", "min_p", "repetition_penalty", "ignore_eos", "return_token_ids")
             if k in fields}
    body = {"model": "my-llama", "max_tokens": 12, "temperature": 0, **fields}
    if not stream:
        out = client.completions.create(**body, extra_body={**extra, "return_token_ids": True})
        return out.choices[0].text, out.choices[0].model_extra["token_ids"]
    text, ids = "", []
    for chunk in client.completions.create(**body, stream=True, extra_body={**extra, "return_token_ids": True}):
        text += chunk.choices[0].text
        ids += chunk.choices[0].model_extra["token_ids"]
    return text, ids


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("penalties", [
    dict(frequency_penalty=1.5),
    dict(presence_penalty=1.8),
    dict(repetition_penalty=1.6),
    dict(frequency_penalty=0.7, presence_penalty=-0.5, repetition_penalty=1.3, logit_bias={"5": 0.4}),
], ids=["frequency", "presence", "repetition", "all"])
def test_penalties_and_logit_bias_match_the_reference(open_server, reference, stream, penalties):
    prompt = tokenize(open_server, prompt=DOC)["tokens"]
    names = {"frequency_penalty": "frequency", "presence_penalty": "presence", "repetition_penalty": "repetition"}
    args = {names[k]: v for k, v in penalties.items() if k in names}
    bias = {int(k): v for k, v in penalties.get("logit_bias", {}).items()}
    _, plain = completion(open_server, stream, prompt=prompt, ignore_eos=True, max_tokens=16)
    expected = reference(prompt, 16, bias=bias, **args)
    assert plain == reference(prompt, 16), "the engine's greedy tokens differ from transformers'"
    assert expected != plain, "a case that cannot tell penalties from none"
    _, got = completion(open_server, stream, prompt=prompt, ignore_eos=True, max_tokens=16, **penalties)
    assert got == expected


def test_logit_bias_forces_a_token_and_min_p_one_is_greedy(open_server):
    _, forced = completion(open_server, False, prompt="Hello", ignore_eos=True, logit_bias={"42": 100})
    assert forced == [42] * 12
    _, greedy = completion(open_server, False, prompt=DOC, ignore_eos=True)
    _, sampled = completion(open_server, True, prompt=DOC, ignore_eos=True, temperature=1.5, seed=3)
    _, kept = completion(open_server, True, prompt=DOC, ignore_eos=True, temperature=1.5, seed=3, min_p=1.0)
    assert kept == greedy and sampled != greedy     # min_p = 1 keeps only the top token


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_echo_starts_each_choice_with_its_prompt(open_server, stream):
    text, ids = completion(open_server, stream, prompt="Pages move", max_tokens=6, echo=True)
    _, plain_ids = completion(open_server, False, prompt="Pages move", max_tokens=6)
    assert text.startswith("Pages move") and ids == plain_ids
    ids_prompt = tokenize(open_server, prompt="Pages move", add_special_tokens=False)["tokens"]
    text, _ = completion(open_server, stream, prompt=ids_prompt, max_tokens=6, echo=True)
    assert text.startswith("Pages move")


def test_echo_without_echo_does_not_repeat_the_prompt(open_server):
    text, _ = completion(open_server, False, prompt="Pages move", max_tokens=6)
    echoed, _ = completion(open_server, False, prompt="Pages move", max_tokens=6, echo=True)
    assert echoed == "Pages move" + text


@pytest.mark.parametrize("fields, param", [
    (dict(response_format={"type": "json_object"}), "response_format"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), "tools"),
    (dict(extra_body={"guided_json": {"type": "object"}}), "guided_json"),
    (dict(extra_body={"min_p": 2}), "min_p"),
    (dict(presence_penalty=3), "presence_penalty"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(logit_bias={"x": 1}), "logit_bias"),
])
def test_unsupported_or_invalid_parameters_are_refused_naming_them(open_server, fields, param):
    client = open_server.client()
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="my-llama", messages=messages, max_tokens=2, **fields)
    assert info.value.body["param"] == param and param in info.value.body["message"]


def test_chat_streamed_and_not_with_the_openai_client(open_server):
    client = open_server.client()
    messages = [{"role": "user", "content": "Say something about tiers."}]
    whole = client.chat.completions.create(model="my-llama", messages=messages, max_completion_tokens=10,
                                           temperature=0, frequency_penalty=0.5, extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model="my-llama", messages=messages, max_completion_tokens=10,
                                                 temperature=0, frequency_penalty=0.5, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 10


# keys and tenants
def test_without_a_key_every_v1_endpoint_is_401_and_the_open_ones_answer(keyed_server):
    request = urllib.request.Request(keyed_server.url + "/v1/completions", data=b'{"prompt": "x"}',
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:     # no Authorization header at all
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == 401 and info.value.headers["WWW-Authenticate"] == "Bearer"
    for client in (keyed_server.client("sk-wrong"), keyed_server.client(KEY[:-1])):
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model="tiny", prompt="x", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        keyed_server.client("sk-wrong", root=True).post("/tokenize", body={"prompt": "x"}, cast_to=object)
    for path in ("/health", "/version", "/metrics"):
        assert get(keyed_server.url + path)[0] == 200, path
    assert keyed_server.client(KEY).models.list().data[0].id == "tiny"


def cached(serve: Serve, key: str, stream: bool = False, **fields) -> int:
    client = serve.client(key)
    body = dict(model="tiny", prompt=DOC + "shared system prompt", max_tokens=2, temperature=0, **fields)
    if not stream:
        return client.completions.create(**body).usage.prompt_tokens_details.cached_tokens
    chunks = list(client.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    return chunks[-1].usage.prompt_tokens_details.cached_tokens


def test_tenants_are_the_keys(keyed_server):
    assert cached(keyed_server, ALICE) == 0
    assert cached(keyed_server, ALICE, stream=True, user="carol") > 150     # same key: cached; user only recorded
    assert cached(keyed_server, BOB) == 0                                   # another tenant: not shared
    assert cached(keyed_server, KEY) == 0                                   # the default tenant
    assert cached(keyed_server, KEY, user="dave") > 150


def test_x_tenant_naming_another_tenant_is_refused(keyed_server):
    with pytest.raises(openai.PermissionDeniedError) as info:
        keyed_server.client(ALICE).completions.create(model="tiny", prompt="x", max_tokens=2,
                                                      extra_headers={"X-Tenant": "bob"})
    assert info.value.body["code"] == "tenant_forbidden"
    ok = keyed_server.client(ALICE).completions.create(model="tiny", prompt="x", max_tokens=2,
                                                       extra_headers={"X-Tenant": "alice"})
    assert ok.usage.completion_tokens == 2


def test_a_trusted_gateway_chooses_the_tenant_by_header(tmp_path):
    serve = Serve(tmp_path, "--model", "tiny", "--set", "server.trust_tenant_header=true")
    try:
        def with_header(tenant: str) -> int:
            out = serve.client().completions.create(model="tiny", prompt=DOC, max_tokens=2,
                                                    extra_headers={"X-Tenant": tenant})
            return out.usage.prompt_tokens_details.cached_tokens
        first, again, other = with_header("acme"), with_header("acme"), with_header("globex")
        assert first == 0 and again > 150 and other == 0
    finally:
        assert "Traceback" not in serve.stop()


# the command
def busy_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


@pytest.mark.parametrize("flag, key", [("--port", "server.port"), ("--admin-port", "admin.port")])
def test_a_busy_port_fails_before_the_model_loads(tmp_path, model_dir, flag, key):
    with busy_port() as sock:
        port = str(sock.getsockname()[1])
        args = ["--port", "0", "--admin-port", "0"]
        args[args.index(flag) + 1] = port
        proc = subprocess.run([sys.executable, "-m", "app", "serve", "--model", str(model_dir), *args,
                               "--data-dir", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120, env=clean_env())
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"kvstore: error: {key} = {port}")
    assert "in use" in proc.stderr or "another process" in proc.stderr, proc.stderr
    assert not (tmp_path / "kvstore.lock").exists()     # nothing was opened: the check came first
