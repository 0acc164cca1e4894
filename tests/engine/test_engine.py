"""The engine over the tiered store: exact prefix reuse from every tier, exact batching,
a hot tier far too small for the load, tenant isolation. CPU, fp32, the tiny preset."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from kvstore.pages.keys import page_keys

PARAMS = SamplingParams(max_tokens=24, logprobs=3)


def make_llm(tmp_path, **options):
    opts = dict(dtype="float32", attention_backend="torch", data_dir=str(tmp_path), hot__device="cpu",
                hot__pool="4MiB", warm__bytes="4MiB")
    opts.update(options)
    return LLM("tiny", **opts)


def prompt_ids(seed: int, n: int) -> list[int]:
    return [256] + [(seed * 131 + i * 17 + (i * i) % 7) % 256 for i in range(n - 1)]


def assert_same_generation(a, b, tol=1e-4):
    assert a.token_ids == b.token_ids
    for la, lb in zip(a.logprobs, b.logprobs):
        assert la["token_id"] == lb["token_id"]
        assert abs(la["logprob"] - lb["logprob"]) < tol
        for (ia, va), (ib, vb) in zip(la["top"], lb["top"]):
            assert ia == ib and abs(va - vb) < tol


def test_prefix_from_hot_warm_and_cold_gives_identical_tokens(tmp_path):
    llm = make_llm(tmp_path)
    try:
        prompt = prompt_ids(1, 100)             # 6 full pages + 4 tokens
        cached = (len(prompt) - 1) // 16 * 16  # the last token is always computed
        [cold_start] = llm.generate([prompt], PARAMS)
        assert cold_start.prefill_tokens == 100 and sum(cold_start.cached_tokens.values()) == 0
        ns = llm.store.namespace()
        keys = page_keys(ns, prompt, 16)
        for tier in ("hot", "warm", "cold"):
            if tier != "hot":
                llm.store.evict(keys, to=tier)
                assert set(llm.store.match(prompt, ns).tiers) == {tier}
            before = llm.stats()["computed_tokens"]
            [out] = llm.generate([prompt], PARAMS)
            assert out.cached_tokens[tier] == cached, (tier, out.cached_tokens)
            assert out.prefill_tokens == len(prompt) - cached
            # computed: the uncached suffix, then one token per decode step
            assert llm.stats()["computed_tokens"] - before == len(prompt) - cached + PARAMS.max_tokens - 1
            assert_same_generation(out, cold_start)
    finally:
        llm.close()


def test_shared_prefix_with_different_suffixes(tmp_path):
    llm = make_llm(tmp_path)
    try:
        doc = prompt_ids(2, 80)
        questions = [doc + prompt_ids(10 + q, 12)[1:] for q in range(4)]
        alone = [make_llm(tmp_path / f"alone{q}").generate([p], PARAMS)[0] for q, p in enumerate(questions)]
        llm.generate([doc], SamplingParams(max_tokens=1))
        outs = llm.generate(questions, PARAMS)
        for out, ref in zip(outs, alone):
            assert out.cached_tokens["hot"] == 80 // 16 * 16
            assert_same_generation(out, ref)
    finally:
        llm.close()


def test_batching_is_exact(tmp_path):
    prompts = [prompt_ids(100 + i, 5 + 13 * i) for i in range(16)]
    params = SamplingParams(max_tokens=16)
    batched = make_llm(tmp_path / "batch").generate(prompts, params)
    for p, out in zip(prompts, batched):
        [alone] = make_llm(tmp_path / "alone", cold__enabled="false").generate([p], params)
        assert out.token_ids == alone.token_ids


def test_hot_tier_far_too_small_queues_and_preempts_but_stays_correct(tmp_path):
    prompts = [prompt_ids(200 + i, 20 + 7 * i) for i in range(12)]
    params = SamplingParams(max_tokens=40)
    ref_llm = make_llm(tmp_path / "ref")
    refs = [ref_llm.generate([p], params)[0] for p in prompts]
    page = ref_llm.store.spec.page_bytes
    small = make_llm(tmp_path / "small", hot__pool=str(14 * page), warm__bytes=str(8 * page))
    outs = small.generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    assert all(o.finish_reason == "length" for o in outs)
    assert small.stats()["preemptions"] > 0
    assert small.store.audit()["total_refcount"] == 0


@pytest.mark.parametrize("policy", ["fcfs", "priority", "preemptive"])
def test_every_scheduler_policy_finishes_everything_correctly(tmp_path, policy):
    prompts = [prompt_ids(300 + i, 30 + 5 * i) for i in range(8)]
    params = SamplingParams(max_tokens=20)
    refs = make_llm(tmp_path / "ref").generate(prompts, params)
    page_bytes = 2 * 2 * 2 * 16 * 16 * 4
    llm = make_llm(tmp_path / policy, hot__pool=str(12 * page_bytes), scheduler__policy=policy)
    reqs = [llm.make_request(p, params, priority=i % 3) for i, p in enumerate(prompts)]
    for r in reqs:
        llm.submit(r)
    while llm.has_work():
        llm.step()
    assert [r.output().token_ids for r in reqs] == [r.token_ids for r in refs]


def test_two_tenants_share_no_pages(tmp_path):
    llm = make_llm(tmp_path)
    try:
        prompt = prompt_ids(3, 64)
        [a1] = llm.generate([prompt], PARAMS, tenant="a")
        hits = llm.store.stats()["tiers"]["hot"]["hits"]
        [b1] = llm.generate([prompt], PARAMS, tenant="b")
        assert sum(b1.cached_tokens.values()) == 0
        assert llm.store.stats()["tiers"]["hot"]["hits"] == hits
        [a2] = llm.generate([prompt], PARAMS, tenant="a")
        assert a2.cached_tokens["hot"] == 48
        assert a1.token_ids == b1.token_ids == a2.token_ids
    finally:
        llm.close()


def test_stop_conditions_and_sampling(tmp_path):
    llm = make_llm(tmp_path)
    try:
        prompt = prompt_ids(4, 20)
        [greedy] = llm.generate([prompt], SamplingParams(max_tokens=12))
        stop_at = greedy.token_ids[5]
        [stopped] = llm.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=[stop_at]))
        assert stopped.token_ids == greedy.token_ids[:greedy.token_ids.index(stop_at) + 1]
        assert stopped.finish_reason == "stop"
        s1 = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=7))
        s2 = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=7))
        assert s1[0].token_ids == s2[0].token_ids
    finally:
        llm.close()


def test_invalid_requests_are_refused_clearly(tmp_path):
    from engine import InvalidRequest
    llm = make_llm(tmp_path, max_seq_len="256")
    try:
        with pytest.raises(InvalidRequest, match="maximum sequence length is 256"):
            llm.make_request(prompt_ids(5, 300))
        with pytest.raises(InvalidRequest, match="temperature"):
            llm.make_request([1, 2], SamplingParams(temperature=-1))
        with pytest.raises(InvalidRequest, match="token ids"):
            llm.make_request([1, 10**9])
    finally:
        llm.close()


async def test_async_engine_streams_and_aborts(tmp_path):
    from engine import AsyncLLM
    llm = make_llm(tmp_path)
    engine = AsyncLLM(llm)
    await engine.start()
    try:
        prompt = prompt_ids(6, 40)
        [ref] = make_llm(tmp_path / "ref").generate([prompt], SamplingParams(max_tokens=10))
        outs = [o async for o in engine.generate(prompt, SamplingParams(max_tokens=10))]
        assert [len(o.token_ids) for o in outs] == list(range(1, 11))
        assert outs[-1].token_ids == ref.token_ids and outs[-1].finish_reason == "length"
        agen = engine.generate(prompt, SamplingParams(max_tokens=10_000, ignore_eos=True))
        await agen.__anext__()
        await agen.aclose()                     # the client went away
        for _ in range(100):
            if not llm.has_work():
                break
            await __import__("asyncio").sleep(0.02)
        assert not llm.has_work()
        assert llm.store.audit()["total_refcount"] == 0
    finally:
        await engine.stop()
        llm.close()


def test_sequence_longer_than_the_hot_tier_spills_to_warm_and_stays_exact(tmp_path):
    prompt = prompt_ids(7, 150)                        # 10 pages; the hot tier holds 6
    params = SamplingParams(max_tokens=40, logprobs=2)  # and it grows to 12 pages
    [ref] = make_llm(tmp_path / "ref").generate([prompt], params)
    page = 2 * 2 * 2 * 16 * 16 * 4
    llm = make_llm(tmp_path / "small", hot__pool=str(6 * page), warm__bytes=str(32 * page))
    try:
        [out] = llm.generate([prompt], params)
        assert_same_generation(out, ref)
        assert llm.stats()["spilled_pages"] > 0
        [again] = llm.generate([prompt], params)        # its cached prefix is longer than hot too
        assert_same_generation(again, ref)
        assert sum(again.cached_tokens.values()) == (len(prompt) - 1) // 16 * 16
        assert llm.store.audit()["problems"] == [] and llm.store.audit()["total_refcount"] == 0
    finally:
        llm.close()


def test_without_a_cold_tier_full_tiers_still_make_room(tmp_path):
    llm = make_llm(tmp_path, hot__pool="256KiB", warm__bytes="256KiB", cold__enabled="false")
    try:
        for tenant in "abcdef":
            [out] = llm.generate([prompt_ids(8, 300)], SamplingParams(max_tokens=4), tenant=tenant)
            assert out.finish_reason == "length" and len(out.token_ids) == 4, tenant
    finally:
        llm.close()


def test_a_request_that_cannot_be_scheduled_fails_alone_and_once(tmp_path, monkeypatch):
    """Scheduling raises for one waiting request: that request ends with "error", once; the request
    already running is not failed with it and keeps the tokens of its run alone."""
    llm = make_llm(tmp_path, hot__pool="16MiB", warm__bytes="16MiB")
    alone = llm.generate([prompt_ids(1, 40)], SamplingParams(max_tokens=12))[0].token_ids
    good = llm.make_request(prompt_ids(1, 40), SamplingParams(max_tokens=12), tenant="g")
    bad = llm.make_request(prompt_ids(2, 40), SamplingParams(max_tokens=12), tenant="b")
    admit = llm.scheduler.admission.admit

    def admit_or_raise(req, budget, running):
        if req is bad:
            raise RuntimeError("this request cannot be scheduled")
        return admit(req, budget, running)

    monkeypatch.setattr(llm.scheduler.admission, "admit", admit_or_raise)
    llm.submit(good)
    llm.step()                       # good runs first
    llm.submit(bad)
    for _ in range(200):
        if not llm.has_work():
            break
        llm.step()
    assert not llm.has_work()
    assert bad.finish_reason == "error" and "cannot be scheduled" in bad.error
    assert llm.failed_steps == 1
    assert good.finish_reason == "length" and good.tokens[len(good.prompt):] == alone
