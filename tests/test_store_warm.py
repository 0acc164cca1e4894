"""The store's warm-tier door for another process (the sidecar): allocate_warm, commit_warm,
lease_warm, release_warm. Leased warm pages stay put; committed pages behave like any other."""

from __future__ import annotations

import pytest
import torch

from kvstore.errors import KVStoreError, OutOfCapacity
from kvstore.pages.keys import page_keys
from storeutil import SPEC, expected_page, fill_and_commit, make_store, settle, tokens_for

PS = SPEC.page_size


@pytest.fixture
def store(tmp_path):
    s = make_store(tmp_path, hot=4, warm=6, cold=32)
    yield s
    s.close(persist=False)


def put_warm(store, ns, tokens, start_page=0, pages=None):
    """Write the expected content of pages start_page.. into fresh warm slots and commit them."""
    keys = page_keys(ns, tokens, PS)
    n = (len(keys) if pages is None else start_page + pages) - start_page
    slots = store.allocate_warm(n)
    for i, slot in enumerate(slots, start=start_page):
        store.warm.pages[slot].copy_(expected_page(keys[i]))
    return slots, store.commit_warm(ns, tokens, slots, start_page)


def warm_bytes_match(store, slots, keys):
    return all(torch.equal(store.warm.pages[s], expected_page(k)) for s, k in zip(slots, keys))


def test_commit_then_lease_serves_the_same_bytes(store):
    ns = store.namespace()
    tokens = tokens_for(1, 3) + [7] * 5  # the partial last page gets no key
    slots, keys = put_warm(store, ns, tokens)
    assert keys == page_keys(ns, tokens, PS) and len(keys) == 3
    m = store.match(tokens, ns)
    assert m.tiers == ["warm"] * 3
    leased = store.lease_warm(m.keys, ns)
    assert leased == slots and warm_bytes_match(store, leased, keys)
    st = store.stats()["tiers"]["warm"]
    assert st["leased_pages"] == 3 and st["allocated_pages"] == 0
    store.release_warm(leased)
    assert store.stats()["tiers"]["warm"]["leased_pages"] == 0
    assert store.audit()["problems"] == []


def test_commit_in_two_puts_needs_the_parent(store):
    ns = store.namespace()
    tokens = tokens_for(2, 4)
    slots = store.allocate_warm(2)
    with pytest.raises(KVStoreError, match="parent of page 2"):
        store.commit_warm(ns, tokens, slots, start_page=2)
    with pytest.raises(KVStoreError, match="need 80 tokens"):
        store.commit_warm(ns, tokens, slots, start_page=3)
    assert store.match(tokens, ns).num_pages == 0
    assert store.stats()["tiers"]["warm"]["allocated_pages"] == 2  # nothing changed
    assert store.audit()["problems"] == []
    store.release_warm(slots)
    put_warm(store, ns, tokens, 0, pages=2)
    put_warm(store, ns, tokens, 2, pages=2)
    m = store.match(tokens, ns)
    assert m.num_pages == 4 and warm_bytes_match(store, store.lease_warm(m.keys), m.keys)


def test_pages_cached_already_free_their_slot(store):
    ns = store.namespace()
    tokens = tokens_for(3, 2)
    first, _ = put_warm(store, ns, tokens)
    used = store.warm.pool.num_used
    again, keys = put_warm(store, ns, tokens)
    assert store.warm.pool.num_used == used and len(keys) == 2
    assert store.lease_warm(keys) == first
    assert store.audit()["problems"] == []


def test_foreign_or_repeated_slots_are_refused(store):
    ns = store.namespace()
    tokens = tokens_for(4, 2)
    slots = store.allocate_warm(1)
    for bad in ([slots[0], slots[0]], [slots[0], 5]):
        with pytest.raises(KVStoreError, match="not all allocated"):
            store.commit_warm(ns, tokens, bad)
    with pytest.raises(KVStoreError, match="not leased or allocated"):
        store.release_warm([5])
    store.release_warm(slots)
    assert store.warm.pool.num_used == 0


def test_leased_pages_never_leave_warm(store):
    ns = store.namespace()
    slots, keys = put_warm(store, ns, tokens_for(5, 4))
    leased = store.lease_warm(keys)
    assert store.flush("warm") == 0 and store.evict(keys, to="cold") == 0
    store.allocate_warm(2)  # the two free slots
    with pytest.raises(OutOfCapacity, match="out of warm capacity"):
        store.allocate_warm(1)
    assert store.rebalance()["warm"] == 0 and warm_bytes_match(store, leased, keys)
    store.release_warm(leased[2:])  # the tail's leases end: those pages may go to cold now
    more = store.allocate_warm(2)
    assert len(more) == 2 and store.match(tokens_for(5, 4), ns).tiers == ["warm", "warm", "cold", "cold"]
    with pytest.raises(KVStoreError, match="not leased or allocated"):
        store.release_warm(leased[:2] + leased[:1])  # one lease each: all or nothing
    store.release_warm(leased[:2])
    assert store.audit()["problems"] == []


def test_lease_copies_hot_and_cold_pages_to_warm(store):
    ns = store.namespace()
    hot_tokens = tokens_for(6, 2)
    held, keys = fill_and_commit(store, ns, hot_tokens)
    store.release(held)
    assert store.match(hot_tokens, ns).tiers == ["hot", "hot"]
    from_hot = store.lease_warm(keys)
    assert len(from_hot) == 2 and warm_bytes_match(store, from_hot, keys)
    store.release_warm(from_hot)
    store.evict(keys, to="cold")
    assert store.match(hot_tokens, ns).tiers == ["cold", "cold"]
    from_cold = store.lease_warm(keys)
    assert len(from_cold) == 2 and warm_bytes_match(store, from_cold, keys)
    assert store.stats()["bytes_moved"]["cold_to_warm"] == 2 * SPEC.page_bytes
    assert store.lease_warm(keys, store.namespace(tenant="b")) == []  # another tenant's key: no lease
    store.release_warm(from_cold)
    assert store.audit()["problems"] == []


def test_committed_warm_pages_persist_and_write_through(tmp_path):
    s = make_store(tmp_path, warm=6, write_policy="write_through")
    ns = s.namespace()
    tokens = tokens_for(7, 3)
    _, keys = put_warm(s, ns, tokens[:2 * PS])
    settle(s)   # written behind as they were put
    assert s.match(tokens, ns).num_pages == 2
    assert all(s.index.get(k).cold for k in keys)
    put_warm(s, ns, tokens, start_page=2)
    s.close(persist=True)  # page 2 only in warm until now
    s = make_store(tmp_path, warm=6)
    try:
        m = s.match(tokens, ns)
        assert m.tiers == ["cold"] * 3
        assert warm_bytes_match(s, s.lease_warm(m.keys), m.keys)
    finally:
        s.close(persist=False)
