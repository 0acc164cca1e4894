"""The context limit, checked as vLLM checks it: a prompt with max_tokens past max_seq_len is a 400
naming what to shorten, never a completion cut short; a max_tokens left out is what fits."""

from __future__ import annotations

import openai
import pytest
import pytest_asyncio
import aiohttp

from test_api import Api, make_llm, serving

pytestmark = pytest.mark.asyncio(loop_scope="module")

CONTEXT = 64
PROMPT = list(range(1, 41))     # 40 token ids
CHAT = [{"role": "user", "content": "x" * 10}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tmp_path_factory):
    llm = make_llm(tmp_path_factory.mktemp("limits"), max_seq_len=str(CONTEXT))
    async with serving(llm) as server:
        yield server
    llm.close()


@pytest_asyncio.fixture(loop_scope="module")
async def api(server):
    async with aiohttp.ClientSession() as session:
        yield Api(server, session)


def assert_refused(status, body, param, *parts):
    assert status == 400, body
    error = body["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert error["message"].startswith(f"This model's maximum context length is {CONTEXT} tokens. "), error
    for part in parts:
        assert part in error["message"], error


async def chat_prompt_tokens(api) -> int:
    status, body, _ = await api.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1})
    assert status == 200, body
    return body["usage"]["prompt_tokens"]


@pytest.mark.parametrize("stream", [False, True])
async def test_max_tokens_past_the_context_is_400(api, stream):
    for max_tokens in (10**12, CONTEXT - len(PROMPT) + 1):
        status, body, _ = await api.post("/v1/completions", {"prompt": PROMPT, "max_tokens": max_tokens,
                                                             "stream": stream})
        assert_refused(status, body, "max_tokens", f"you requested {len(PROMPT) + max_tokens} tokens "
                       f"({len(PROMPT)} in the prompt, {max_tokens} in the completion). Please reduce the length "
                       "of the prompt or completion.")
    prompt = await chat_prompt_tokens(api)
    for field in ("max_tokens", "max_completion_tokens"):
        status, body, _ = await api.post("/v1/chat/completions", {"messages": CHAT, field: 10**12, "stream": stream})
        assert_refused(status, body, field, f"({prompt} in the messages, {10**12} in the completion)")


async def test_the_longest_of_several_prompts_counts(api):
    status, body, _ = await api.post("/v1/completions", {"prompt": [[1, 2], PROMPT], "max_tokens": 30})
    assert_refused(status, body, "max_tokens", f"({len(PROMPT)} in the prompt, 30 in the completion)")


async def test_max_tokens_that_fits_exactly_is_served_in_full(api):
    status, body, _ = await api.post("/v1/completions", {"prompt": PROMPT, "max_tokens": CONTEXT - len(PROMPT),
                                                         "ignore_eos": True})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == CONTEXT - len(PROMPT)
    assert body["choices"][0]["finish_reason"] == "length"


async def test_prompt_alone_past_the_context_is_400(api):
    for length in (CONTEXT, CONTEXT + 1, 5000):
        status, body, _ = await api.post("/v1/completions", {"prompt": [1] * length})
        assert_refused(status, body, "prompt", f"you requested {length} tokens in the prompt")
    status, body, _ = await api.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 200}]})
    assert_refused(status, body, "messages", "tokens in the messages", "Please reduce the length of the messages.")
    status, body, _ = await api.post("/v1/completions", {"prompt": [1] * (CONTEXT - 1), "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 1, body   # room for one token


async def test_max_tokens_left_out_is_what_fits(api):
    # chat: the rest of the context (as vLLM)
    prompt = await chat_prompt_tokens(api)
    status, body, _ = await api.post("/v1/chat/completions", {"messages": CHAT, "ignore_eos": True})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == CONTEXT - prompt and body["choices"][0]["finish_reason"] == "length"
    # completions: OpenAI's 16, or less when less fits
    for length, expected in ((10, 16), (CONTEXT - 5, 5)):
        status, body, _ = await api.post("/v1/completions", {"prompt": [1] * length, "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == expected, body


async def test_openai_client_sees_the_limit(api):
    async with api.openai() as client:
        with pytest.raises(openai.BadRequestError, match="maximum context length is 64 tokens") as caught:
            await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10**6)
        assert caught.value.param == "max_tokens"
