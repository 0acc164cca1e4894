"""A hypothesis state machine over the real engine: Scheduler + TieredStore (tiny pools, real
LMDB) + the tiny model. Random arrivals with shared prefixes, engine steps, aborts, evictions
to warm and cold (so that admissions load from cold), rebalances. After every step: each
request in one state, the batch holds each request once and no request preempted in it, page
references balanced, the store's audit clean. At the end every request finishes exactly once,
and every one that was not aborted has exactly the tokens of its reference run alone.
"""

from __future__ import annotations

import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine import LLM, SamplingParams
from engine.request import Status

from test_engine import make_llm, prompt_ids

PREFIXES = [prompt_ids(1, 48), prompt_ids(2, 32), prompt_ids(3, 20)]
PROMPTS = [PREFIXES[i % 3] + prompt_ids(10 + i, 5 + (i * 11) % 23) for i in range(8)]
PROMPTS.append(prompt_ids(4, 140))   # longer than the hot tier: it runs alone, spilling its head to warm
MAX_TOKENS = (4, 12, 30)
def pages_state(llm) -> list:
    """The hot and warm pages' holds and flags, for the failure message of a request that did not run."""
    s = llm.store
    out = []
    for name, slots in (("hot", s.index.hot_slots), ("warm", s.index.warm_slots)):
        out.append((name, (s.hot.pool if name == "hot" else s.warm.pool).num_free,
                    [(e.key.hex()[:4], e.refcount, e.leases, e.writing, e.cold, len(e.kids), e.hot, e.warm,
                      e.pinned(s.index.now())) for e in slots.values()]))
    out.append((s.core.owned, s.core.warm_owned, s.mover.reading, len(llm.scheduler.waiting), len(llm.scheduler.running)))
    return out


_reference: dict[tuple[int, int], list[int]] = {}


def reference(prompt: int, max_tokens: int) -> list[int]:
    """The prompt's tokens computed alone, nothing cached (shared by all examples)."""
    key = (prompt, max_tokens)
    if key not in _reference:
        d = tempfile.mkdtemp(prefix="kvstore-ref-")
        llm = make_llm(d, hot__pool="8MiB", cold__enabled="false")
        try:
            _reference[key] = llm.generate([PROMPTS[prompt]], SamplingParams(max_tokens=max_tokens,
                                                                              temperature=0.0))[0].token_ids
        finally:
            llm.close()
            shutil.rmtree(d, ignore_errors=True)
    return _reference[key]


class EngineMachine(RuleBasedStateMachine):
    backend = "torch"   # the exactness reference; it copies a prefix in warm up to hot

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvstore-em-")
        self.llm: LLM | None = None
        self.reqs = []            # (request, prompt index, max_tokens)
        self.aborted: set[str] = set()
        self.finishes: dict[str, int] = {}
        self.problems: list[str] = []

    @precondition(lambda self: self.llm is None)
    @rule(policy=st.sampled_from(["fcfs", "priority", "preemptive"]),
          prefetch=st.sampled_from(["wait", "timeout", "best_effort"]),
          eviction=st.sampled_from(["lru", "prefix_aware"]))
    def open(self, policy, prefetch, eviction):
        # 8 hot pages, 8 warm: a few requests at a time, preemptions and spills
        self.llm = make_llm(self.dir, attention_backend=self.backend, hot__pool="64KiB", warm__bytes="64KiB",
                            scheduler__policy=policy,
                            prefetch__policy=prefetch, prefetch__timeout_s="0.01", eviction_policy=eviction,
                            prefill_chunk_tokens=32, check_invariants=True)
        sched = self.llm.scheduler
        schedule, finish = sched.schedule, sched.finish

        def checked_schedule():
            before = {id(r): r.preemptions for r in sched.running + sched.waiting + sched.loading + list(sched.inbox)}
            batch = schedule()
            ids = [id(r) for r, _ in batch]
            if len(ids) != len(set(ids)):
                self.problems.append("a request twice in one batch")
            for r, n in batch:
                if r.preemptions != before.get(id(r), r.preemptions) or r.status is not Status.RUNNING or n < 1:
                    self.problems.append(f"{r.id} scheduled while {r.status.value} or preempted in the step")
            return batch

        def counted_finish(req, reason):
            self.finishes[req.id] = self.finishes.get(req.id, 0) + 1
            return finish(req, reason)

        sched.schedule, sched.finish = checked_schedule, counted_finish

    @precondition(lambda self: self.llm is not None and len(self.reqs) < 16)
    @rule(burst=st.lists(st.tuples(st.integers(0, len(PROMPTS) - 1), st.sampled_from(MAX_TOKENS),
                                   st.integers(0, 2)), min_size=1, max_size=4))
    def arrive(self, burst):
        for prompt, max_tokens, priority in burst:
            req = self.llm.make_request(PROMPTS[prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                        priority=priority)
            self.llm.submit(req)
            self.reqs.append((req, prompt, max_tokens))

    @precondition(lambda self: self.llm is not None)
    @rule(n=st.integers(1, 12))
    def step(self, n):
        for _ in range(n):
            self.llm.step()

    @precondition(lambda self: self.llm is not None and self.reqs)
    @rule(data=st.data())
    def abort(self, data):
        req, _, _ = data.draw(st.sampled_from(self.reqs))
        if req.status is not Status.FINISHED:
            self.aborted.add(req.id)
            self.llm.abort(req.id)

    @precondition(lambda self: self.llm is not None)
    @rule(prefix=st.integers(0, 2), to=st.sampled_from(["warm", "cold", None]))
    def evict(self, prefix, to):
        store = self.llm.store
        store.evict(store.match(PREFIXES[prefix], store.namespace()).keys, to=to)

    @precondition(lambda self: self.llm is not None)
    @rule(tier=st.sampled_from(["hot", "warm"]))
    def flush(self, tier):
        self.llm.store.flush(tier)

    @precondition(lambda self: self.llm is not None)
    @rule()
    def rebalance(self):
        self.llm.store.rebalance()

    @invariant()
    def consistent(self):
        if self.llm is None:
            return
        self.llm.store.daemon.drain()
        assert self.problems == []
        assert self.llm.scheduler.check() == []
        assert self.llm.failed_steps == 0
        assert all(n == 1 for n in self.finishes.values()), self.finishes

    def teardown(self):
        if self.llm is None:
            return
        try:
            for _ in range(5000):
                if all(r.status is Status.FINISHED for r, _, _ in self.reqs) and not self.llm.has_work():
                    break
                self.llm.step()
            assert self.problems == [] and self.llm.failed_steps == 0
            for req, prompt, max_tokens in self.reqs:
                assert req.status is Status.FINISHED, f"{req.id} never finished"
                assert self.finishes.get(req.id) == 1, f"{req.id} finished {self.finishes.get(req.id)} times"
                if req.id not in self.aborted:
                    assert req.finish_reason in ("stop", "length"), (req.id, req.finish_reason, req.error, pages_state(self.llm))
                    assert req.output_ids == reference(prompt, max_tokens), f"{req.id}: tokens differ from its run alone"
            audit = self.llm.store.audit()
            assert audit["problems"] == [] and audit["total_refcount"] == 0 and audit["allocated_slots"] == 0
        finally:
            self.llm.close()
            shutil.rmtree(self.dir, ignore_errors=True)


EngineMachine.TestCase.settings = settings(max_examples=15, stateful_step_count=30, deadline=None,
                                           suppress_health_check=list(HealthCheck))
TestEngineMachine = pytest.mark.timeout(900)(EngineMachine.TestCase)   # a slow example runs the model a lot


class NativeEngineMachine(EngineMachine):
    """The same machine on the CPU's own kernel (what `auto` picks without a GPU): a cached prefix mostly
    in warm is leased and attended there (admission's warm_in_place), its hot head copied down; the tokens
    are still those of the reference backend's run alone."""
    backend = "native"


NativeEngineMachine.TestCase.settings = EngineMachine.TestCase.settings
TestNativeEngineMachine = pytest.mark.timeout(900)(NativeEngineMachine.TestCase)
