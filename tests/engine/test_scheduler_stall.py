"""The stall timer: a request alone that gets no page for stuck_limit_s is ended, and nothing else
is. A lone request that fits a tiny hot tier (16 pages) runs to its last token even when each
step takes longer than the limit; a request's stuck spell ends when a step passes without it
being stuck, so that an old spell never ends it at once."""

from __future__ import annotations

import time

import pytest

from engine import SamplingParams

from test_engine import make_llm, prompt_ids

MAX_TOKENS = 24
HOT = "128KiB"   # 16 pages of 16 tokens (the tiny preset)


def prompt_for(pages: int) -> list[int]:
    """A prompt that, with MAX_TOKENS, needs `pages` pages in all."""
    return prompt_ids(3, pages * 16 - MAX_TOKENS + 1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    llm = make_llm(tmp_path_factory.mktemp("ref"), hot__pool="4MiB")
    try:
        yield {pages: llm.generate([prompt_for(pages)], SamplingParams(max_tokens=MAX_TOKENS))[0].token_ids
               for pages in (14, 15, 16)}
    finally:
        llm.close()


@pytest.mark.parametrize("pages", [14, 15, 16])
@pytest.mark.parametrize("warm", ["0", "64KiB"])   # no spilling; a warm tier to spill to
def test_a_lone_request_that_fits_the_hot_tier_gets_all_its_tokens(tmp_path, reference, pages, warm):
    llm = make_llm(tmp_path, hot__pool=HOT, warm__bytes=warm)
    try:
        assert llm.store.hot.num_pages == 16
        llm.generate([prompt_ids(9, 100), prompt_ids(8, 120)], SamplingParams(max_tokens=8))   # hot holds pages
        llm.scheduler.stuck_limit_s = 0.05
        llm.fault = lambda batch: time.sleep(0.1)   # every step is slower than the limit
        [out] = llm.generate([prompt_for(pages)], SamplingParams(max_tokens=MAX_TOKENS))
        assert out.finish_reason == "length" and out.token_ids == reference[pages]
    finally:
        llm.close()


def test_a_stuck_spell_ends_with_the_first_step_that_does_not_find_it_stuck(tmp_path):
    llm = make_llm(tmp_path, hot__pool=HOT, warm__bytes="0", cold__enabled="false")
    try:
        sched = llm.scheduler
        sched.stuck_limit_s = 0.05
        req = llm.make_request(prompt_ids(1, 40), SamplingParams(max_tokens=4))
        sched.schedule()
        assert not sched.stuck(req)                   # a spell starts
        time.sleep(0.1)
        assert sched.stuck(req)                       # the same step: still stuck, past the limit
        sched.schedule()
        sched.schedule()                              # a step that did not find it stuck
        time.sleep(0.1)
        assert not sched.stuck(req)                   # a new spell: the old one does not count
        sched.schedule()
        time.sleep(0.1)
        assert sched.stuck(req)                       # stuck in the step before and in this one
    finally:
        llm.close()
