"""Regression: under preemption a request is never twice in one step's batch, never both
preempted and scheduled in one step, and finished exactly once; its tokens stay exact.

Before the fix, `_grow` could preempt a request already in the step's batch, the admission
loop re-admitted it in the same call, and the batch held it two or three times (wrong tokens:
its first token repeated), then it finished twice and the engine loop died.
"""

from __future__ import annotations

import collections

from engine import LLM, SamplingParams

from test_engine import make_llm, prompt_ids


def watch(llm: LLM) -> dict:
    """Wrap schedule() and finish() to check every step; returns the counters."""
    seen = {"steps": 0, "preempted": 0, "finished": collections.Counter(), "problems": []}
    schedule, finish = llm.scheduler.schedule, llm.scheduler.finish

    def checked_schedule():
        queued = llm.scheduler.running + llm.scheduler.waiting + list(llm.scheduler.inbox)
        before = {id(r): r.preemptions for r in queued}
        batch = schedule()
        seen["steps"] += 1
        reqs = [r for r, _ in batch]
        if len(reqs) != len(set(map(id, reqs))):
            seen["problems"].append(f"step {seen['steps']}: a request twice in the batch")
        for r in reqs:
            if r.preemptions != before.get(id(r), r.preemptions):
                seen["problems"].append(f"step {seen['steps']}: {r.id} preempted and scheduled")
        seen["preempted"] += sum(r.preemptions - before[id(r)] for r in queued)
        return batch

    def counted_finish(req, *args, **kwargs):
        seen["finished"][req.id] += 1
        return finish(req, *args, **kwargs)

    llm.scheduler.schedule, llm.scheduler.finish = checked_schedule, counted_finish
    return seen


def test_preemption_never_duplicates_a_request(tmp_path):
    params = SamplingParams(max_tokens=40, temperature=0.0)
    prompts = [prompt_ids(i % 3, 40) + prompt_ids(100 + i, 8 + (i * 7) % 30) for i in range(12)]
    ref = make_llm(tmp_path / "ref", hot__pool="8MiB")
    try:
        want = [ref.generate([p], params)[0].token_ids for p in prompts]
    finally:
        ref.close()
    # 24 pages of 16 tokens: a few requests at once, many preemptions
    llm = make_llm(tmp_path / "small", hot__pool="192KiB", warm__bytes="64KiB")
    try:
        seen = watch(llm)
        got = llm.generate(prompts, params)
        assert seen["problems"] == []
        assert seen["preempted"] > 0, "the test must exercise preemption"
        assert all(n == 1 for n in seen["finished"].values()) and len(seen["finished"]) == len(prompts)
        assert [o.token_ids for o in got] == want
    finally:
        llm.close()
