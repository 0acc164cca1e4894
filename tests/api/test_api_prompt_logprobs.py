"""A completion with `echo` and `logprobs`: the prompt's tokens get their logprobs (the first none,
as in OpenAI and vLLM), equal to a log_softmax of the model's own forward over the whole prompt,
streamed or not, also when the prompt is cached (such a request computes it all)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from app.api.responses import LOGPROB_FLOOR
from test_api import Api, make_llm, serving

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from hfutil import run_prefill  # noqa: E402

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "Pages move between the hot, warm and cold tiers of the KV cache."   # ASCII: one token a byte
TOP = 2


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    llm = make_llm(tmp_path_factory.mktemp("prompt-logprobs"), **{"engine.prefill_chunk_tokens": "16"})
    yield llm
    llm.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def api(llm):
    import aiohttp

    async with serving(llm) as server, aiohttp.ClientSession() as session:
        yield Api(server, session)


def reference(llm, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab] logprobs of each next prompt token from one forward over the whole
    prompt, over the ids the tokenizer can produce (the distribution the engine samples from)."""
    return run_prefill(llm.loaded.model, ids)[:-1, :llm.runner.vocab_limit].float().log_softmax(-1)


def body(prompt, **extra) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": TOP,
            "return_token_ids": True, **extra}


def assert_prompt_logprobs(llm, logprobs: dict, ids: list[int]) -> None:
    want = reference(llm, ids)
    got = logprobs["token_logprobs"][:len(ids)]
    assert got[0] is None and logprobs["top_logprobs"][0] is None      # the first token has none
    chosen = want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(torch.tensor(got[1:]), chosen, atol=1e-4), (got[1:6], chosen[:5])
    best = want.topk(TOP)
    decode = llm.tokenizer.decode
    for i, top in enumerate(logprobs["top_logprobs"][1:len(ids)]):
        # the top ids and the prompt's token by their text (ids of one text share an entry)
        allowed = [*best.values[i].tolist(), float(chosen[i])]
        assert set(top) == {decode([t]) for t in best.indices[i].tolist()} | {decode([ids[i + 1]])}
        assert all(min(abs(v - a) for a in allowed) < 1e-4 for v in top.values()), (top, allowed)
    assert logprobs["tokens"][:len(ids)] == [llm.tokenizer.decode([t]) for t in ids]


async def test_echo_with_logprobs_gives_the_prompt_logprobs_of_a_full_forward(api, llm):
    status, data, _ = await api.post("/v1/completions", body(PROMPT))
    assert status == 200, data       # refused with 400 before prompt logprobs were computed
    choice, ids = data["choices"][0], data["prompt_token_ids"]
    assert choice["text"].startswith(PROMPT)
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + len(choice["token_ids"])
    assert_prompt_logprobs(llm, logprobs, ids)
    assert all(lp is not None for lp in logprobs["token_logprobs"][len(ids):])   # the generated ones follow
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])
    assert data["usage"]["kvstore"]["prefill_tokens"] == len(ids)


async def test_a_cached_prompt_is_computed_again_for_its_logprobs(api, llm):
    prompt = PROMPT + " Long documents, many questions."
    status, first, _ = await api.post("/v1/completions", body(prompt, echo=False, logprobs=None))
    assert status == 200
    status, plain, _ = await api.post("/v1/completions", body(prompt, echo=False, logprobs=None))
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] > 0    # the prefix is cached
    status, data, _ = await api.post("/v1/completions", body(prompt))
    ids = data["prompt_token_ids"]
    assert status == 200 and data["usage"]["kvstore"]["prefill_tokens"] == len(ids)
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert_prompt_logprobs(llm, data["choices"][0]["logprobs"], ids)
    assert data["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]


async def test_streamed_echo_starts_with_the_prompt_logprobs(api, llm):
    status, whole, _ = await api.post("/v1/completions", body(PROMPT, n=2))
    events = await api.stream("/v1/completions", body(PROMPT, n=2))
    assert events[-1] == "[DONE]"
    for index in range(2):
        chunks = [e["choices"][0] for e in events[:-1] if e["choices"] and e["choices"][0]["index"] == index]
        streamed = [lp for c in chunks for lp in c["logprobs"]["token_logprobs"]]
        want = whole["choices"][index]["logprobs"]["token_logprobs"]
        assert streamed[0] is None and streamed == pytest.approx(want, abs=1e-5)
        assert "".join(c["text"] for c in chunks) == whole["choices"][index]["text"]
    assert_prompt_logprobs(llm, whole["choices"][1]["logprobs"], whole["prompt_token_ids"])


async def test_a_prompt_token_the_tokenizer_cannot_produce_gets_the_floor(api, llm):
    vocab = llm.runner.vocab_limit
    assert vocab < llm.loaded.shape.vocab_size      # the tiny preset's model has ids past its tokenizer's
    ids = [256, 72, vocab + 5, 105]
    async with api.session.post(api.url + "/v1/completions", json=body(ids)) as r:
        assert r.status == 200
        data = json.loads(await r.text(), parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    logprobs = data["choices"][0]["logprobs"]["token_logprobs"]
    assert logprobs[2] == LOGPROB_FLOOR and logprobs[1] < 0 and logprobs[3] < 0
    assert logprobs[3] == pytest.approx(float(reference(llm, ids)[2, 105]), abs=1e-4)
