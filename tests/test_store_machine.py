"""A hypothesis state machine over random request / pin / evict / rebalance sequences.

Invariants after every step: no tier exceeds its bytes; referenced pages stay in hot with
their bytes intact; pinned pages keep every copy they had; a cold record is removed only when
no child of it is in cold (leaves before parents); the audit finds nothing. At the end, once
everything is released, no reference and no allocated slot is left (nothing leaked).
"""

from __future__ import annotations

import shutil
import tempfile

import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.errors import OutOfCapacity
from kvstore.keys import page_keys
from storeutil import SPEC, expected_page, make_store

PS = SPEC.page_size
# Documents share prefixes: doc d's page i has tokens from (d // 3 if i < 2 else d, i).
DOCS = [[(((d // 3) if i < 2 else 10 + d) * 37 + i * 5 + t) % 500 for i in range(5) for t in range(PS)]
        for d in range(6)]


class StoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvstore-sm-")
        self.store = None
        self.requests: list[list[int]] = []   # hot slots held by running requests
        self.pinned: dict[bytes, set[str]] = {}
        self.violations: list[str] = []

    @rule(policy=st.sampled_from(["lru", "lfu", "refcount", "prefix_aware"]),
          write=st.sampled_from(["write_back", "write_through"]))
    @precondition(lambda self: self.store is None)
    def open(self, policy, write):
        self.store = make_store(self.dir, hot=6, warm=4, cold=6, eviction_policy=policy, write_policy=write)
        self.ns = self.store.namespace()
        self.store.add_listener(self._on_event)

    def _on_event(self, event, key, tier):
        if event == "remove" and tier == "cold":
            e = self.store.index.get(key)
            if e is not None and any(self.store.index.entries[k].cold for k in e.kids if k in self.store.index.entries):
                self.violations.append(f"cold parent {key.hex()[:8]} removed before its child")

    def _tiers(self, e):
        return {t for t, here in (("hot", e.hot is not None), ("warm", e.warm is not None), ("cold", e.cold)) if here}

    @precondition(lambda self: self.store is not None)
    @rule(doc=st.integers(0, 5), pages=st.integers(1, 5))
    def request(self, doc, pages):
        tokens = DOCS[doc][:pages * PS]
        keys = page_keys(self.ns, tokens, PS)
        m = self.store.match(tokens, self.ns)
        try:
            held = self.store.acquire(m.keys)
        except OutOfCapacity:
            return
        for slot, key in zip(held, keys):
            assert torch.equal(self.store.hot.read_page(slot), expected_page(key)), "cache hit differs"
        try:
            fresh = self.store.allocate(pages - len(held))
        except OutOfCapacity:
            self.store.release(held)
            return
        for i, slot in enumerate(fresh, start=len(held)):
            self.store.hot.write_page(slot, expected_page(keys[i]))
        self.store.commit(self.ns, tokens, held + fresh)
        self.requests.append(held + fresh)

    @precondition(lambda self: self.store is not None and self.requests)
    @rule(data=st.data())
    def finish(self, data):
        i = data.draw(st.integers(0, len(self.requests) - 1))
        self.store.release(self.requests.pop(i))

    @precondition(lambda self: self.store is not None)
    @rule(doc=st.integers(0, 5))
    def pin(self, doc):
        m = self.store.match(DOCS[doc], self.ns)
        self.store.pin(m.keys, ttl_s=3600)
        for k in m.keys:
            self.pinned[k] = self._tiers(self.store.index.get(k))

    @precondition(lambda self: self.store is not None and self.pinned)
    @rule()
    def unpin_all(self):
        self.store.unpin(list(self.pinned))
        self.pinned.clear()

    @precondition(lambda self: self.store is not None)
    @rule(doc=st.integers(0, 5), to=st.sampled_from(["warm", "cold", None]))
    def evict(self, doc, to):
        self.store.evict(self.store.match(DOCS[doc], self.ns).keys, to=to)

    @precondition(lambda self: self.store is not None)
    @rule(tier=st.sampled_from(["hot", "warm", "cold"]))
    def flush(self, tier):
        self.store.flush(tier)

    @precondition(lambda self: self.store is not None)
    @rule()
    def rebalance(self):
        self.store.rebalance()
        if self.store.config.write_policy == "write_through":
            self.store.write_through()

    @invariant()
    def bounded_and_consistent(self):
        if self.store is None:
            return
        s = self.store
        s.io.drain()   # background write-behind kicked by this step: let it land before checking
        for tier in (s.hot, s.warm, s.cold):
            assert tier.used_bytes <= tier.capacity_bytes, f"{tier.name} over its bytes"
        assert s.audit()["problems"] == []
        assert not self.violations, self.violations
        for slots in self.requests:
            for slot in slots:
                assert slot in s._owned or s.index.hot_slots[slot].refcount > 0, "held page lost"
        for key, tiers in self.pinned.items():
            e = s.index.get(key)
            assert e is not None and tiers <= self._tiers(e), "pinned page evicted"

    def teardown(self):
        if self.store is not None:
            for slots in self.requests:
                self.store.release(slots)
            audit = self.store.audit()
            try:
                assert audit["total_refcount"] == 0 and audit["allocated_slots"] == 0, audit
                assert audit["problems"] == []
            finally:
                self.store.close(persist=False)
                shutil.rmtree(self.dir, ignore_errors=True)


StoreMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestStoreMachine = StoreMachine.TestCase
