"""The remote tier on a real Mooncake Store (a mooncake_master with its HTTP metadata server, TCP):
pages store A computed, a fresh store B (its own data directory, lending no memory, its warm
tier leaving room for each record's head) finds byte-exact, and another namespace finds nothing;
a read that outlives its wait (a hung master) keeps its warm slots until it ends. Mooncake keeps values in the memory its clients
lend (segment=): A lends it, so A stays up while B reads."""

from __future__ import annotations

import time

import pytest

import mooncakeutil
from kvstore.pages import record
from storeutil import expected_page, fill_and_commit, make_store, settle, tokens_for

needs = (not mooncakeutil.missing(), mooncakeutil.missing())
pytestmark = pytest.mark.usefixtures("requires_part")
PAGES = 6


def test_a_fresh_store_finds_what_another_wrote_on_a_mooncake_master(tmp_path):
    master = mooncakeutil.MooncakeMaster(tmp_path / "master")
    a = b = None
    try:
        a = make_store(tmp_path / "a", **{"remote.url": master.url_with("256MiB"), "remote.timeout_ms": "2000"})
        ns, tokens = a.namespace(), tokens_for(1, PAGES)
        slots, keys = fill_and_commit(a, ns, tokens)
        a.release(slots)
        settle(a)
        assert a.remote.wait_written(10)
        assert a.stats()["tiers"]["remote"]["written_pages"] == PAGES
        b = make_store(tmp_path / "b", **{"remote.url": master.url_with("0"), "remote.timeout_ms": "2000"})
        # warm leaves room for a record's head before each page (a value lands whole, in one
        # transfer), within warm.bytes
        assert b.warm.head_room >= record.head_bound(b.spec) and b.warm.head_room % 64 == 0
        assert 0 < b.warm.num_slots * b.warm.stride <= b.config.warm.bytes
        assert b.fetch_remote(tokens, ns.with_tenant("other")) == (0, 0)
        assert b.fetch_remote(tokens, ns) == (0, PAGES)
        for key in keys:
            page = b.warm.payloads([b.index.get(key).warm])[0]
            assert bytes(page) == expected_page(key).numpy().tobytes()
        assert b.stats()["tiers"]["remote"]["hits"] == PAGES and b.stats()["corrupt_pages"] == 0
    finally:
        for s in (b, a):
            if s is not None:
                s.close()
        master.stop()


def _reserved(store) -> int:
    """Warm slots in use that hold no indexed page and no caller's allocation: a fetch's reservations."""
    with store.core.lock:
        used = store.warm.pool.num_slots - store.warm.pool.num_free
        return used - len(store.index.warm_slots) - len(store.core.warm_owned)


def test_a_read_that_outlives_its_wait_keeps_its_warm_slots_until_it_ends(tmp_path):
    """A hung master: the fetch is a miss in bounded time, but the read it gave up on may still
    land in its reserved slots, so they are not handed to anything else until it ends; then they
    are freed, and a later fetch finds the pages."""
    master = mooncakeutil.MooncakeMaster(tmp_path / "master")
    a = b = None
    try:
        a = make_store(tmp_path / "a", **{"remote.url": master.url_with("256MiB"), "remote.timeout_ms": "2000"})
        ns, tokens = a.namespace(), tokens_for(2, PAGES)
        slots, keys = fill_and_commit(a, ns, tokens)
        a.release(slots)
        settle(a)
        assert a.remote.wait_written(10)
        b = make_store(tmp_path / "b", **{"remote.url": master.url_with("0"), "remote.timeout_ms": "500",
                                          "cold.enabled": "false", "remote.write": "false"})
        master.freeze()
        try:
            start = time.monotonic()
            assert b.fetch_remote(tokens, ns) == (0, 0)
            assert time.monotonic() - start < 5
            assert _reserved(b) == PAGES     # still the read's: it may write them yet
        finally:
            master.thaw()
        deadline = time.monotonic() + 30
        while _reserved(b) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _reserved(b) == 0
        while b.fetch_remote(tokens, ns) != (0, PAGES):   # the tier comes back after its backoff
            assert time.monotonic() < deadline
            time.sleep(0.2)
        for key in keys:
            assert bytes(b.warm.payloads([b.index.get(key).warm])[0]) == expected_page(key).numpy().tobytes()
    finally:
        for s in (b, a):
            if s is not None:
                s.close()
        master.stop()
