"""engine.prefill_alone_tokens: on the CPU a step computes at most one prefill of a long prompt (its
attention over the long context is most of the step, and none of it is shared); short prompts
still join its steps, nothing jumps the queue, and the tokens are those of any other schedule."""

from __future__ import annotations

from engine import SamplingParams

from test_engine import make_llm, prompt_ids

PROMPTS = [prompt_ids(1, 20), prompt_ids(2, 100), prompt_ids(3, 120), prompt_ids(4, 20), prompt_ids(5, 90)]


def run(tmp_path, alone: int) -> tuple[list[list[int]], list[list[int]]]:
    """The tokens of PROMPTS and, step by step, the prompt lengths of the prefills in the step."""
    llm = make_llm(tmp_path, prefill_alone_tokens=alone)
    steps: list[list[int]] = []
    llm.fault = lambda batch: steps.append([len(r.prompt) for r, n in batch if n > 1 or r.num_computed == 0])
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6))
        return [o.token_ids for o in outs], [s for s in steps if s]
    finally:
        llm.close()


def test_a_step_holds_one_prefill_of_a_long_prompt_and_the_short_ones_beside_it(tmp_path):
    tokens, steps = run(tmp_path / "alone", 64)
    # in order of arrival: the short prompt joins the first long one, the second long one waits for
    # the next step (and the short one behind it with it: nothing passes a waiting request)
    assert steps == [[20, 100], [120, 20], [90]]
    plain_tokens, plain_steps = run(tmp_path / "plain", 0)
    assert plain_steps == [[20, 100, 120, 20]] + [[90]]   # off: prefill_concurrency (4) alone bounds a step
    assert tokens == plain_tokens
