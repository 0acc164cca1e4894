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
from storeutil import expected_page, fill_and_commit, make_store, reserved_warm_slots, settle, tokens_for

needs = (not mooncakeutil.missing(), mooncakeutil.missing())
pytestmark = pytest.mark.usefixtures("requires_part")
PAGES = 6


@pytest.fixture
def stores():
    """Stores a test opens, closed readers first (the one lending the memory last)."""
    opened: list = []
    yield opened
    for s in reversed(opened):
        s.close()


def written(tmp_path, mooncake_master, stores, doc: int):
    """Store A (lending the store 256 MiB) with document `doc`'s PAGES pages written to the remote:
    (A, namespace, tokens, keys)."""
    a = make_store(tmp_path / "a", **{"remote.url": mooncake_master.url_with("256MiB"), "remote.timeout_ms": "2000"})
    stores.append(a)
    ns, tokens = a.namespace(), tokens_for(doc, PAGES)
    slots, keys = fill_and_commit(a, ns, tokens)
    a.release(slots)
    settle(a)
    assert a.remote.wait_written(10)
    assert a.stats()["tiers"]["remote"]["written_pages"] == PAGES
    return a, ns, tokens, keys


def assert_exact(store, keys) -> None:
    for key in keys:
        assert bytes(store.warm.payloads([store.index.get(key).warm])[0]) == expected_page(key).numpy().tobytes()


def test_a_fresh_store_finds_what_another_wrote_on_a_mooncake_master(tmp_path, mooncake_master, stores):
    _, ns, tokens, keys = written(tmp_path, mooncake_master, stores, 1)
    b = make_store(tmp_path / "b", **{"remote.url": mooncake_master.url_with("0"), "remote.timeout_ms": "2000"})
    stores.append(b)
    # warm leaves room for a record's head before each page (a value lands whole, in one
    # transfer), within warm.bytes
    assert b.warm.head_room >= record.head_bound(b.spec) and b.warm.head_room % 64 == 0
    assert 0 < b.warm.num_slots * b.warm.stride <= b.config.warm.bytes
    assert b.fetch_remote(tokens, ns.with_tenant("other")) == (0, 0)
    assert b.fetch_remote(tokens, ns) == (0, PAGES)
    assert_exact(b, keys)
    assert b.stats()["tiers"]["remote"]["hits"] == PAGES and b.stats()["corrupt_pages"] == 0


def test_a_read_that_outlives_its_wait_keeps_its_warm_slots_until_it_ends(tmp_path, mooncake_master, stores):
    """A hung master: the fetch is a miss in bounded time, but the read it gave up on may still
    land in its reserved slots, so they are not handed to anything else until it ends; then they
    are freed, and a later fetch finds the pages."""
    _, ns, tokens, keys = written(tmp_path, mooncake_master, stores, 2)
    b = make_store(tmp_path / "b", **{"remote.url": mooncake_master.url_with("0"), "remote.timeout_ms": "500",
                                      "cold.enabled": "false", "remote.write": "false"})
    stores.append(b)
    mooncake_master.freeze()
    try:
        start = time.monotonic()
        assert b.fetch_remote(tokens, ns) == (0, 0)
        assert time.monotonic() - start < 5
        assert reserved_warm_slots(b) == PAGES     # still the read's: it may write them yet
    finally:
        mooncake_master.thaw()
    deadline = time.monotonic() + 30
    while reserved_warm_slots(b) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert reserved_warm_slots(b) == 0
    while b.fetch_remote(tokens, ns) != (0, PAGES):   # the tier comes back after its backoff
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert_exact(b, keys)
