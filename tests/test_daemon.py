"""The daemon: concurrent asyncio clients under eviction pressure, prefetch policies, bounded waits."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from kvstore.daemon import Daemon
from kvstore.errors import OutOfCapacity
from kvstore.keys import page_keys
from storeutil import SPEC, expected_page, make_store, tokens_for

PS = SPEC.page_size


async def client(daemon: Daemon, ns, rng: random.Random, until: float, stats: dict):
    while time.monotonic() < until:
        doc = rng.randrange(12)
        pages = rng.randint(1, 4)
        # documents 0-5 and 6-11 share their first two pages: overlapping prefixes
        tokens = tokens_for(doc % 6, 2)[:min(pages, 2) * PS] + tokens_for(100 + doc, 2)[:max(pages - 2, 0) * PS]
        keys = page_keys(ns, tokens, PS)
        m = await daemon.match(tokens, ns)
        try:
            held = await daemon.acquire(m.keys)
        except OutOfCapacity:
            stats["waits"] += 1
            await asyncio.sleep(0.01)
            continue
        for slot, key in zip(held, keys):
            if not torch.equal(daemon.store.hot.read_page(slot), expected_page(key)):
                stats["bad"] += 1
        try:
            fresh = await daemon.allocate(pages - len(held), timeout=2.0)
        except OutOfCapacity:
            stats["waits"] += 1
            await daemon.release(held)
            continue
        for i, slot in enumerate(fresh, start=len(held)):
            daemon.store.hot.write_page(slot, expected_page(keys[i]))
        await daemon.commit(ns, tokens, held + fresh)
        stats["hits"] += len(held)
        stats["requests"] += 1
        await asyncio.sleep(rng.random() * 0.005)
        await daemon.release(held + fresh)


@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
async def test_eight_clients_ten_seconds_under_pressure(tmp_path, write_policy):
    store = make_store(tmp_path, hot=12, warm=8, cold=16, write_policy=write_policy,
                       **{"daemon.interval_s": 0.01})
    ns = store.namespace()
    stats = dict.fromkeys(("requests", "hits", "waits", "bad"), 0)
    until = time.monotonic() + 10.0
    async with Daemon(store) as daemon:
        await asyncio.wait_for(asyncio.gather(*(client(daemon, ns, random.Random(i), until, stats)
                                                for i in range(8))), timeout=60)
        assert daemon.errors == 0
    audit = store.audit()
    st = store.stats()
    store.close(persist=False)
    assert stats["bad"] == 0
    assert stats["requests"] > 100 and stats["hits"] > 0
    assert audit == {"referenced_pages": 0, "total_refcount": 0, "allocated_slots": 0, "problems": []}
    assert st["tiers"]["hot"]["evictions"] > 0 and st["tiers"]["warm"]["evictions"] > 0


async def test_allocate_waits_for_a_release_then_succeeds(tmp_path):
    store = make_store(tmp_path, hot=4)
    async with Daemon(store) as daemon:
        held = await daemon.allocate(4)

        async def release_later():
            await asyncio.sleep(0.2)
            await daemon.release(held)

        task = asyncio.create_task(release_later())
        got = await daemon.allocate(2, timeout=5)
        assert len(got) == 2
        await task
        await daemon.release(got)
    store.close(persist=False)


async def test_allocate_gives_up_after_its_bound(tmp_path):
    store = make_store(tmp_path, hot=4)
    async with Daemon(store) as daemon:
        held = await daemon.allocate(4)
        t0 = time.monotonic()
        with pytest.raises(OutOfCapacity, match="out of KV capacity"):
            await daemon.allocate(1, timeout=0.3)
        assert time.monotonic() - t0 < 3
        await daemon.release(held)
    store.close(persist=False)


async def _cold_prefix(tmp_path, pages=4):
    store = make_store(tmp_path)
    ns = store.namespace()
    tokens = tokens_for(20, pages)
    slots = store.allocate(pages)
    keys = page_keys(ns, tokens, PS)
    for slot, key in zip(slots, keys):
        store.hot.write_page(slot, expected_page(key))
    store.commit(ns, tokens, slots)
    store.release(slots)
    store.evict(keys, to="cold")
    return store, ns, tokens, keys


async def test_prefetch_wait_brings_pages_up(tmp_path):
    store, ns, tokens, keys = await _cold_prefix(tmp_path)
    async with Daemon(store) as daemon:
        assert await daemon.prefetch(keys, to="warm", policy="wait") == 4
        assert store.match(tokens, ns).tiers == ["warm"] * 4
        assert await daemon.prefetch(keys, to="hot", policy="wait") == 4
        assert store.match(tokens, ns).tiers == ["hot"] * 4
    store.close(persist=False)


async def test_prefetch_best_effort_returns_at_once_and_completes(tmp_path):
    store, ns, tokens, keys = await _cold_prefix(tmp_path)
    async with Daemon(store) as daemon:
        assert await daemon.prefetch(keys, to="warm", policy="best_effort") is None
        for _ in range(100):
            if store.match(tokens, ns).tiers == ["warm"] * 4:
                break
            await asyncio.sleep(0.02)
        assert store.match(tokens, ns).tiers == ["warm"] * 4
    store.close(persist=False)


async def test_prefetch_timeout_policy_is_bounded(tmp_path):
    store, ns, tokens, keys = await _cold_prefix(tmp_path)
    async with Daemon(store) as daemon:
        got = await daemon.prefetch(keys, to="hot", policy="timeout", timeout=5)
        assert got == 4
        t0 = time.monotonic()
        assert await daemon.prefetch(keys, to="hot", policy="timeout", timeout=0) in (None, 4)
        assert time.monotonic() - t0 < 1
    store.close(persist=False)


async def test_watermark_loop_demotes_in_background(tmp_path):
    store = make_store(tmp_path, hot=8, **{"daemon.interval_s": 0.01})
    ns = store.namespace()
    async with Daemon(store) as daemon:
        tokens = tokens_for(30, 8)
        slots = await daemon.allocate(8)
        keys = page_keys(ns, tokens, PS)
        for slot, key in zip(slots, keys):
            store.hot.write_page(slot, expected_page(key))
        await daemon.commit(ns, tokens, slots)
        await daemon.release(slots)
        for _ in range(200):
            if store.hot.pool.num_used <= 6:
                break
            await asyncio.sleep(0.01)
        assert store.hot.pool.num_used <= 6  # low watermark 0.75 of 8
        assert (await daemon.match(tokens, ns)).num_pages == 8
    store.close(persist=False)
