"""A hypothesis state machine over random request / pin / evict / rebalance sequences.

Requests go through the store's one door, a CacheHandle, as the engine's do; write-behind and the
daemon run in the background meanwhile. Invariants after every step: no tier exceeds its bytes;
referenced pages stay in hot with their bytes intact; pinned pages keep every copy they had; a
cold record is removed only when no child of it is in cold (leaves before parents); the audit
finds nothing; pages leave the store only when cold refused them (cold_full), and with a cold
tier that has room (the `roomy` stores) never: every committed page is kept until an operator
evicts it. At the end, once everything is released, no reference and no allocated slot is left.
"""

from __future__ import annotations

import shutil
import tempfile

import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.errors import OutOfCapacity
from kvstore.pages.keys import page_keys
from storeutil import SPEC, expected_page, make_store, settle

PS = SPEC.page_size
# Documents share prefixes: doc d's page i has tokens from (d // 3 if i < 2 else d, i).
DOCS = [[(((d // 3) if i < 2 else 10 + d) * 37 + i * 5 + t) % 500 for i in range(5) for t in range(PS)]
        for d in range(6)]


class StoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvstore-sm-")
        self.store = None
        self.requests: list = []   # the handles of running requests
        self.pinned: dict[bytes, set[str]] = {}
        self.violations: list[str] = []
        self.kept: set[bytes] = set()   # committed pages no operator has taken out of the store
        self.roomy = False

    @rule(policy=st.sampled_from(["lru", "lfu", "refcount", "prefix_aware"]),
          write=st.sampled_from(["write_back", "write_through"]), roomy=st.booleans())
    @precondition(lambda self: self.store is None)
    def open(self, policy, write, roomy):
        self.roomy = roomy   # cold holds every page (else 6 records: it must refuse some)
        self.store = make_store(self.dir, hot=6, warm=4, cold=200 if roomy else 6, eviction_policy=policy,
                                write_policy=write)
        self.ns = self.store.namespace()
        self.store.add_listener(self._on_event)
        self.kept = set(self.store.index.entries)

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
        h = self.store.handle(self.ns)
        m = h.match(tokens)
        try:
            h.attach(m)
        except OutOfCapacity:
            return
        for slot, key in zip(h.slots, keys):
            assert torch.equal(self.store.hot.read_page(slot), expected_page(key)), "cache hit differs"
        held = h.num_pages
        try:
            h.grow(pages)
        except OutOfCapacity:
            h.release()
            return
        for i, slot in enumerate(h.slots[held:], start=held):
            self.store.hot.write_page(slot, expected_page(keys[i]))
        h.commit(tokens, pages)
        self.kept.update(keys[:pages])
        self.requests.append(h)

    # Whether a request got its pages depends on the background writer's timing, so no
    # precondition or draw depends on how many run or what is pinned: hypothesis replays the same
    # choices as the same steps.
    @precondition(lambda self: self.store is not None)
    @rule(i=st.integers(0, 63))
    def finish(self, i):
        if self.requests:
            self.requests.pop(i % len(self.requests)).release()

    @precondition(lambda self: self.store is not None)
    @rule(doc=st.integers(0, 5))
    def pin(self, doc):
        m = self.store.match(DOCS[doc], self.ns)
        self.store.pin(m.keys, ttl_s=3600)
        for k in m.keys:
            self.pinned[k] = self._tiers(self.store.index.get(k))

    @precondition(lambda self: self.store is not None)
    @rule()
    def unpin_all(self):
        self.store.unpin(list(self.pinned))
        self.pinned.clear()

    @precondition(lambda self: self.store is not None)
    @rule(doc=st.integers(0, 5), to=st.sampled_from(["warm", "cold", None]))
    def evict(self, doc, to):
        keys = self.store.match(DOCS[doc], self.ns).keys
        self.store.evict(keys, to=to)
        self._forget_gone()

    @precondition(lambda self: self.store is not None)
    @rule(tier=st.sampled_from(["hot", "warm", "cold"]))
    def flush(self, tier):
        self.store.flush(tier)
        self._forget_gone()

    def _forget_gone(self):
        """Pages an operator took out of the store are no longer owed."""
        self.kept &= set(self.store.index.entries)

    @precondition(lambda self: self.store is not None)
    @rule()
    def rebalance(self):
        self.store.rebalance()

    @precondition(lambda self: self.store is not None)
    @rule()
    def settle(self):
        settle(self.store)

    @invariant()
    def bounded_and_consistent(self):
        if self.store is None:
            return
        s = self.store
        for tier in (s.hot, s.warm, s.cold):
            assert tier.used_bytes <= tier.capacity_bytes, f"{tier.name} over its bytes"
        assert s.audit()["problems"] == []
        assert not self.violations, self.violations
        for h in self.requests:
            for slot in h.slots:
                assert slot in s.core.owned or s.index.hot_slots[slot].refcount > 0, "held page lost"
        st = s.stats()
        drops = {r: n for r, n in st["dropped_by_reason"].items() if n}
        assert set(drops) <= {"cold_full"} and not (self.roomy and drops), f"pages dropped: {drops}"
        if self.roomy:
            lost = [k.hex()[:8] for k in self.kept if k not in s.index]
            assert not lost, f"committed pages lost with room in cold: {lost}"
        for key, tiers in self.pinned.items():
            e = s.index.get(key)
            assert e is not None and tiers <= self._tiers(e), "pinned page evicted"

    def teardown(self):
        if self.store is not None:
            for h in self.requests:
                h.release()
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
