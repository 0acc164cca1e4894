"""The store's daemon: concurrent clients under eviction pressure through the one door (handles,
run on the daemon's worker threads), write-behind from the moment of commit, loads, the
watermark round, backpressure, and a close that drains."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from kvstore.errors import OutOfCapacity
from kvstore.pages.keys import page_keys
from storeutil import SPEC, expected_page, fill_and_commit, make_store, settle, stall_writes, tokens_for

PS = SPEC.page_size


def start_request(store, ns, tokens: list[int], stats: dict):
    """One request through a handle (a worker thread): its cold pages up, its prefix held, the rest
    computed and committed; the handle, or None when the store had no room (counted as a wait)."""
    keys = page_keys(ns, tokens, PS)
    h = store.handle(ns)
    m = h.match(tokens)
    store.promote(m.keys, "warm")
    try:
        h.attach(m)
    except OutOfCapacity:
        stats["waits"] += 1
        return None
    for slot, key in zip(h.slots, keys):
        if not torch.equal(store.hot.read_page(slot), expected_page(key)):
            stats["bad"] += 1
    held = h.num_pages
    deadline = time.monotonic() + 2.0
    while True:
        try:
            h.grow(len(tokens) // PS)
            break
        except OutOfCapacity as exc:
            if not exc.pending or time.monotonic() > deadline:
                stats["waits"] += 1
                h.release()
                return None
            store.daemon.wait_progress(0.05)
    for i, slot in enumerate(h.slots[held:], start=held):
        store.hot.write_page(slot, expected_page(keys[i]))
    h.commit(tokens, len(tokens) // PS)
    stats["hits"] += held
    stats["requests"] += 1
    return h


async def client(store, ns, rng: random.Random, until: float, stats: dict):
    while time.monotonic() < until:
        doc = rng.randrange(12)
        pages = rng.randint(1, 4)
        # documents 0-5 and 6-11 share their first two pages: overlapping prefixes
        tokens = tokens_for(doc % 6, 2)[:min(pages, 2) * PS] + tokens_for(100 + doc, 2)[:max(pages - 2, 0) * PS]
        h = await store.daemon.run(start_request, store, ns, tokens, stats)
        if h is None:
            await asyncio.sleep(0.01)
            continue
        await asyncio.sleep(rng.random() * 0.005)
        await store.daemon.run(h.release)


@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
async def test_eight_clients_ten_seconds_under_pressure(tmp_path, write_policy):
    store = make_store(tmp_path, hot=12, warm=8, cold=16, write_policy=write_policy,
                       **{"daemon.interval_s": 0.01})
    ns = store.namespace()
    stats = dict.fromkeys(("requests", "hits", "waits", "bad"), 0)
    until = time.monotonic() + 10.0
    await asyncio.wait_for(asyncio.gather(*(client(store, ns, random.Random(i), until, stats)
                                            for i in range(8))), timeout=60)
    assert store.daemon.maintenance_errors == 0
    audit = store.audit()
    st = store.stats()
    store.close(persist=False)
    assert stats["bad"] == 0
    assert stats["requests"] > 100 and stats["hits"] > 0
    assert audit == {"referenced_pages": 0, "total_refcount": 0, "allocated_slots": 0, "problems": []}
    assert st["tiers"]["hot"]["evictions"] > 0 and st["tiers"]["warm"]["evictions"] > 0
    # cold (16 records) is smaller than the 36 pages: only what it refused may have left the store
    assert {r for r, n in st["dropped_by_reason"].items() if n} <= {"cold_full"}


def test_a_committed_page_is_written_behind_without_pressure(tmp_path):
    store = make_store(tmp_path, hot=8, warm=8)   # the watermark round never comes (interval: an hour)
    try:
        slots, keys = fill_and_commit(store, store.namespace(), tokens_for(1, 3))
        settle(store, timeout=5)
        assert all(store.index.get(k).cold for k in keys)   # while still referenced in hot
        wb = store.stats()["write_behind"]
        assert wb["written_pages"] == 3 and wb["dirty_pages"] == 0 and wb["write_batches"] >= 1
        store.release(slots)
    finally:
        store.close(persist=False)


def test_a_load_ticket_brings_cold_pages_to_warm_and_holds_them(tmp_path):
    store = make_store(tmp_path)
    try:
        ns = store.namespace()
        tokens = tokens_for(20, 4)
        slots, keys = fill_and_commit(store, ns, tokens)
        store.release(slots)
        store.evict(keys, to="cold")
        ticket = store.daemon.load(keys)
        assert ticket.wait(10) == 4 and store.match(tokens, ns).tiers == ["warm"] * 4
        with store.core.lock:
            assert all(store.index.get(k).leases == 1 for k in keys)   # held for the ticket's holder
            store.daemon.end_load(ticket)
            assert all(store.index.get(k).leases == 0 for k in keys)
    finally:
        store.close(persist=False)


def test_watermark_round_demotes_in_background(tmp_path):
    store = make_store(tmp_path, hot=8, **{"daemon.interval_s": 0.01})
    try:
        ns = store.namespace()
        tokens = tokens_for(30, 8)
        slots, _ = fill_and_commit(store, ns, tokens)
        store.release(slots)
        for _ in range(200):
            if store.hot.pool.num_used <= 6:
                break
            time.sleep(0.01)
        assert store.hot.pool.num_used <= 6  # low watermark 0.75 of 8
        assert store.match(tokens, ns).num_pages == 8
    finally:
        store.close(persist=False)


def test_a_producer_waits_for_write_behind_then_stores_what_fits(tmp_path):
    """The dirty bound (here 4 pages: half the warm tier) with the writer held back: allocate_warm
    waits its bound, then hands out what fits; once the writer runs, room comes back."""
    store = make_store(tmp_path, warm=8, **{"daemon.backpressure_timeout_s": 0.3})
    ns = store.namespace()
    gate = stall_writes(store)   # a disk that stalls
    try:
        assert store.daemon.max_dirty_pages == 4
        slots = store.allocate_warm(4)
        store.commit_warm(ns, tokens_for(1, 4), slots)
        t0 = time.monotonic()
        assert store.allocate_warm(2, partial=True) == []
        assert time.monotonic() - t0 >= 0.3   # waited its bound first
        with pytest.raises(OutOfCapacity, match="wait for write-behind"):
            store.allocate_warm(1)
        wb = store.stats()["write_behind"]
        assert wb["backpressure_waits"] == 2 and wb["refused_pages"] == 3 and wb["dirty_pages"] == 4
        gate.set()
        more = store.allocate_warm(2, wait_s=10)
        assert len(more) == 2
        store.release_warm(more)
        assert store.stats()["dropped_pages"] == 0
    finally:
        gate.set()
        store.close(persist=False)


def test_close_writes_every_queued_page(tmp_path):
    store = make_store(tmp_path, warm=16)
    ns = store.namespace()
    stall_writes(store, up_to_s=0.5)   # a slow disk: each batch waits half a second
    for doc in range(3):
        tokens = tokens_for(40 + doc, 2)
        store.commit_warm(ns, tokens, store.allocate_warm(2))
    assert store.stats()["write_behind"]["dirty_pages"] > 0
    store.close(persist=True)
    store = make_store(tmp_path, warm=16)
    try:
        assert all(store.match(tokens_for(40 + doc, 2), ns).tiers == ["cold"] * 2 for doc in range(3))
    finally:
        store.close(persist=False)


def test_the_engine_side_counts_dirty_pages_and_never_waits(tmp_path):
    """With the writer held back, hot fills with dirty pages: admission offers nothing once they pass
    the bound, an allocation fails at once with `pending` (wait, do not preempt) instead of dropping
    them, and room comes back once they are written."""
    store = make_store(tmp_path, hot=8, warm=4, **{"hot.high_watermark": "1.0"})
    ns = store.namespace()
    gate = stall_writes(store)
    try:
        assert store.daemon.max_dirty_pages == 2 and store.admission_budget() == 8
        slots, _ = fill_and_commit(store, ns, tokens_for(1, 8))
        store.release(slots)
        assert store.stats()["write_behind"]["dirty_pages"] == 8
        assert store.admission_budget() == 0                 # past the bound: no new request
        assert store.hot_budget() == 4                       # what warm's free slots can take, not the disk's
        t0 = time.monotonic()
        with pytest.raises(OutOfCapacity) as err:
            store.allocate(8)
        assert err.value.pending and time.monotonic() - t0 < 1.0
        assert store.stats()["dropped_pages"] == 0 and len(store.index) == 8
        gate.set()
        settle(store)
        assert store.admission_budget() == 8
        store.release(store.allocate(8))
    finally:
        gate.set()
        store.close(persist=False)


def test_evicting_pages_whose_cold_write_is_in_flight_waits_for_the_write(tmp_path):
    """A page write-behind has picked up (its write in flight) leaves when asked to, once written: clear
    and evict wait for the write instead of keeping the page by chance of timing."""
    import threading
    store = make_store(tmp_path, warm=8)
    ns = store.namespace()
    gate = threading.Event()   # the disk stalls once the pages are marked writing (stall_writes stalls before)
    write = store.core.mover.write
    store.core.mover.write = lambda plan: (gate.wait(30), write(plan))[1]
    try:
        keys = store.commit_warm(ns, tokens_for(1, 3), store.allocate_warm(3))
        deadline = time.monotonic() + 10
        while not all(store.index.get(k).writing for k in keys):   # the writer holds all three
            assert time.monotonic() < deadline, "write-behind did not pick the pages up"
            time.sleep(0.01)
        threading.Timer(0.3, gate.set).start()
        assert store.clear_namespace(ns.digest) == (3, 0)
        assert all(k not in store.index for k in keys) and store.stats()["dropped_pages"] == 0
    finally:
        gate.set()
        store.close(persist=False)
