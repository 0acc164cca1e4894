"""SamplingParams.prompt_logprobs: every prompt token but the first gets the logprob the model gives
it after the tokens before it, computed across prefill chunks, cached prefixes and preemptions
exactly as one forward over the whole prompt."""

from __future__ import annotations

import pytest
import torch

from engine import InvalidRequest, SamplingParams
from hfutil import run_prefill
from test_engine import make_llm, prompt_ids


def reference(llm, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab] logprobs of each next prompt token, over the ids the tokenizer can produce."""
    return run_prefill(llm.loaded.model, ids)[:-1, :llm.runner.vocab_limit].float().log_softmax(-1)


def assert_exact(llm, out, k: int) -> None:
    ids = out.prompt_token_ids
    want = reference(llm, ids)
    entries = out.prompt_logprobs
    assert len(entries) == len(ids) and entries[0] is None
    assert [e["token_id"] for e in entries[1:]] == ids[1:]
    got = torch.tensor([e["logprob"] for e in entries[1:]])
    assert torch.allclose(got, want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], atol=1e-4)
    top = want.topk(k)
    assert [[t for t, _ in e["top"]] for e in entries[1:]] == top.indices.tolist()


def test_chunks_and_a_cached_prefix_give_the_logprobs_of_one_forward(tmp_path):
    llm = make_llm(tmp_path, engine__prefill_chunk_tokens=5)
    ids = prompt_ids(3, 45)
    plain = llm.generate([ids], SamplingParams(max_tokens=4))[0]
    again = llm.generate([ids], SamplingParams(max_tokens=4, prompt_logprobs=3))[0]
    assert_exact(llm, again, 3)
    assert again.prefill_tokens == len(ids) and sum(again.cached_tokens.values()) == 0   # no prefix reused
    assert again.token_ids == plain.token_ids and plain.prompt_logprobs is None
    llm.close()


def test_preempted_requests_keep_exact_prompt_logprobs(tmp_path):
    prompts = [prompt_ids(300 + i, 30 + 9 * i) for i in range(4)]
    probe = make_llm(tmp_path / "probe")
    page = probe.store.spec.page_bytes
    probe.close()
    llm = make_llm(tmp_path / "small", hot__pool=str(8 * page), warm__bytes=str(8 * page),
                   engine__prefill_chunk_tokens=8)
    preempt, mid_prompt = llm.scheduler.preempt, []

    def recording(req):
        mid_prompt.append(len(req.prompt_logprobs) < len(req.prompt))
        preempt(req)
    llm.scheduler.preempt = recording
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, prompt_logprobs=1, ignore_eos=True))
    assert any(mid_prompt), mid_prompt      # one was preempted before its prompt was all scored
    for out in outs:
        assert out.finish_reason == "length"
        assert_exact(llm, out, 1)
    llm.close()


def test_a_request_resumes_scoring_where_it_stopped():
    from engine.request import Request

    req = Request("r", list(range(10)), SamplingParams(prompt_logprobs=0), namespace=None)
    assert req.cacheable == 0 and req.scored(0, 4) == range(0, 4)
    req.prompt_logprobs += [{}] * 4           # positions 0..3 scored tokens 1..4
    assert req.cacheable == 4 and req.scored(0, 8) == range(4, 8) and req.scored(8, 2) == range(8, 9)
    req.prompt_logprobs += [{}] * 5
    assert req.cacheable == 9 and not req.scored(9, 1)


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_prompt_logprobs_out_of_range_is_refused(value):
    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value).validate()
