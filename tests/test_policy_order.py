"""Victim order kept by PageIndex's queues against a brute-force scan of the tier, for every policy.

Random operations (entries added in chains, moved between tiers, touched, hit, referenced,
leased, pinned, removed) run on a real PageIndex; after each one, PageMover.victims and
PageIndex.oldest_leaves must return exactly what sorting every eligible entry would: the same
entries in the same order, ties broken by insertion order.
"""

from __future__ import annotations

import heapq

from hypothesis import HealthCheck, given, settings, strategies as st

from kvstore.movement.mover import TIERS, PageMover
from kvstore.placement.index import PageEntry, PageIndex
from kvstore.placement.policy import POLICIES, policy_names

POLICY_NAMES = policy_names()
OPS = ("add", "add", "orphan", "hot", "warm", "cold", "touch", "hit", "acquire", "commit_ref", "release",
       "lease", "unlease", "pin", "unpin", "writing", "remove", "depths")


def in_tier(e: PageEntry, tier: str) -> bool:
    return e.hot is not None if tier == "hot" else e.warm is not None if tier == "warm" else e.cold


def brute_victims(mover: PageMover, policy: str, tier: str, n: int, exclude: set, leaving: bool,
                  outside: bool) -> list:
    """The scan PageMover.victims did before the queues, with the same tie-break. `leaving`: a copy
    elsewhere, or a droppable leaf (this mover has no durable tier); `outside`: no copy in memory."""
    index, now, key = mover.index, mover.index.now(), POLICIES.get(policy)
    cands = [e for e in index.entries.values() if in_tier(e, tier) and mover.evictable(e, tier, now)
             and e.key not in exclude
             and not (leaving and e.residency <= 1 and (e.kids or e.writing))
             and not (outside and (e.hot is not None or e.warm is not None))]
    return heapq.nsmallest(n, cands, key=lambda e: (key(e), e.seq))


def brute_leaves(index: PageIndex, n: int, ok) -> list:
    return sorted((e for e in index.entries.values() if not e.kids and ok(e)),
                  key=lambda e: (e.last_access, e.seq))[:n]


class Model:
    """Drives a PageIndex the way the store does, keeping the store's invariants."""

    def __init__(self, policy: str):
        self.index = PageIndex(policy)
        self.mover = PageMover(None, [], self.index, policy, lambda *a: None)
        self.next_slot = 0
        self.next_key = 0

    def pick(self, a: int) -> PageEntry | None:
        entries = list(self.index.entries.values())
        return entries[a % len(entries)] if entries else None

    def slot(self) -> int:
        self.next_slot += 1
        return self.next_slot

    def drop(self, e: PageEntry, tier: str) -> None:
        """Remove e's copy in tier, and e itself when no copy is left (PageMover.remove_copies)."""
        if tier == "hot" and not e.refcount:
            self.index.set_hot(e, None)
        elif tier == "warm" and not e.leases and not e.writing:
            self.index.set_warm(e, None)
        elif tier == "cold":
            self.index.set_cold(e, False)
        if not e.residency:
            self.index.remove(e)

    def gain(self, e: PageEntry, tier: str) -> None:
        if tier == "hot":
            self.index.set_hot(e, self.slot())
        elif tier == "warm":
            self.index.set_warm(e, self.slot())
        else:
            self.index.set_cold(e, True)

    def apply(self, op: str, a: int, b: int) -> None:
        index, e = self.index, self.pick(a)
        if op == "add" or e is None:
            parent = e if e is not None and b % 4 else None   # mostly chains, some new roots
            self.next_key += 1
            key = self.next_key.to_bytes(4, "little")
            new = index.add(PageEntry(key, parent.key if parent else b"root", b"ns", b"",
                                      depth=parent.depth + 1 if parent else 0))
            self.gain(new, TIERS[b % 3])
        elif op == "orphan":   # its parent is the next page added: linked when that arrives
            self.next_key += 1
            parent = (self.next_key + 1).to_bytes(4, "little")
            self.gain(index.add(PageEntry(self.next_key.to_bytes(4, "little"), parent, b"ns", b"")), TIERS[b % 3])
        elif op in TIERS:
            if in_tier(e, op):
                self.drop(e, op)
            else:
                self.gain(e, op)
        elif op == "touch":
            index.touch(e)
        elif op == "hit":
            e.hits += 1
            index.touch(e)
        elif op == "acquire":
            if e.hot is None:
                self.gain(e, "hot")
            e.refcount += 1
            e.hits += 1
            index.touch(e)
        elif op == "commit_ref" and e.hot is not None:   # commit: a reference without a touch
            e.refcount += 1
        elif op == "release" and e.refcount:
            e.refcount -= 1
            index.touch(e)
        elif op == "lease" and e.warm is not None:
            e.leases += 1
            e.hits += 1
            index.touch(e)
        elif op == "unlease" and e.leases:
            e.leases -= 1
            index.touch(e)
        elif op == "pin":
            e.pin_until = index.now() + 1000
        elif op == "unpin":
            e.pin_until = 0.0
        elif op == "writing" and e.warm is not None:    # write-behind marks a page without a touch
            e.writing = not e.writing
        elif op == "remove":
            for tier in TIERS:
                if in_tier(e, tier):
                    self.drop(e, tier)
        elif op == "depths":
            index.compute_depths()

    def check(self, n: int, a: int) -> None:
        index, mover = self.index, self.mover
        assert set(index.in_tier("cold")) == {e for e in index.entries.values() if e.cold}
        exclude = {e.key for i, e in enumerate(index.entries.values()) if (i + a) % 5 == 0}
        cases = ((n, set(), False, False), (len(index) + 1, set(), False, False), (n, exclude, True, False),
                 (n, exclude, False, True), (n, set(), True, True))
        for policy in POLICY_NAMES:
            mover.policy = policy
            for tier in TIERS:
                for k, ex, leaving, outside in cases:
                    got = mover.victims(tier, k, ex, leaving, outside)
                    want = brute_victims(mover, policy, tier, k, ex, leaving, outside)
                    assert [e.key for e in got] == [e.key for e in want], (policy, tier, k, leaving, outside)
        now = index.now()
        ok = lambda e: not e.refcount and not e.pinned(now)  # noqa: E731  (TieredStore._trim_index)
        for k in (n, len(index) + 1):
            assert [e.key for e in index.oldest_leaves(k, ok)] == [e.key for e in brute_leaves(index, k, ok)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(POLICY_NAMES),
       ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 11), st.integers(0, 11)),
                    min_size=1, max_size=80),
       n=st.integers(1, 6))
def test_victims_match_a_sorted_scan(policy, ops, n):
    model = Model(policy)
    for op, a, b in ops:
        model.apply(op, a, b)
        model.check(n, a)


def test_stale_items_are_compacted_and_order_survives():
    """Many re-pushes of few entries: the heap stays within twice the tier (plus slack), order exact."""
    model = Model("lfu")
    for i in range(40):
        model.apply("add", i, 1 + i % 3)   # a chain; hot, warm or cold
    queues = [(tier, q) for queues in model.index._orders.values() for tier, q in queues.items()]
    longest = 0
    for i in range(5000):
        model.apply("hit" if i % 3 else "touch", i * 7919, 0)
        model.mover.victims(TIERS[i % 3], 1)   # the queues take the change when next read
        for tier, q in queues:
            longest = max(longest, len(q) - 2 * len(model.index._members[tier]))
    assert longest <= 65
    model.check(4, 0)


def count_key_calls(q) -> list[int]:
    calls, key = [0], q.key

    def counting(e):
        calls[0] += 1
        return key(e)
    q.key = counting
    return calls


def test_victims_never_scan_the_tier():
    """Choosing 8 victims among 20K cold entries pops about 8 items, not the tier."""
    model = Model("lru")
    for i in range(20_000):
        model.index.add(PageEntry(i.to_bytes(4, "little"), b"root", b"ns", b"", where={"cold": True}))
    model.mover.victims("cold", 8)   # the first read takes in the 20K additions
    calls = count_key_calls(model.index._queue("lru", "cold"))
    got = model.mover.victims("cold", 8)
    assert [e.seq for e in got] == list(range(1, 9)) and calls[0] <= 16


def test_referenced_pages_are_not_popped_again_and_again():
    """10K referenced hot pages ahead in LRU order cost one pop each, once; after that they are skipped."""
    model = Model("lru")
    for i in range(10_010):
        e = model.index.add(PageEntry(i.to_bytes(4, "little"), b"root", b"ns", b""))
        model.index.set_hot(e, i)
        if i < 10_000:
            e.refcount += 1   # referenced without a touch, as commit does
    calls = count_key_calls(model.index._queue("lru", "hot"))
    assert [e.seq for e in model.mover.victims("hot", 8)] == list(range(10_001, 10_009))
    first, calls[0] = calls[0], 0
    assert [e.seq for e in model.mover.victims("hot", 8)] == list(range(10_001, 10_009))
    assert first <= 10_016 and calls[0] <= 16


def test_a_reference_taken_without_a_touch_still_reorders():
    """commit() adds a reference without touching: the queue finds the grown key when it pops it."""
    model = Model("refcount")
    model.apply("add", 0, 1)            # 1: a root in warm
    model.apply("add", 0, 4)            # 2: a root in warm
    e = model.index.entries[(1).to_bytes(4, "little")]
    model.gain(e, "hot")
    assert [x.seq for x in model.mover.victims("warm", 2)] == [1, 2]
    e.refcount += 1
    assert [x.seq for x in model.mover.victims("warm", 2)] == [2, 1]
    model.check(2, 0)


def test_a_cold_parent_returns_when_its_last_cold_child_leaves():
    model = Model("lru")
    model.apply("add", 0, 2)            # 1: a root in cold
    model.apply("add", 0, 2)            # 2: its child in cold
    parent, child = model.index.entries.values()
    model.gain(parent, "warm")
    model.gain(child, "warm")
    model.index.touch(child)
    model.index.touch(parent)           # the parent is now the newer one
    assert model.mover.victims("cold", 2) == [child]   # the parent waits for its child
    model.drop(child, "cold")
    assert model.mover.victims("cold", 2) == [parent]
    model.check(2, 0)
