"""The store by composition: its parts hold the narrow core, never the store; its verbs are the
parts' own; readers that must not take the lock read one immutable snapshot."""

from __future__ import annotations

import pytest

from kvstore.server import views
from kvstore.server.history import tier_usage
from kvstore.store.tiered import TieredStore
from storeutil import SPEC, fill_and_commit, make_store, settle, tokens_for


@pytest.fixture
def store(tmp_path):
    s = make_store(tmp_path)
    yield s
    s.close(persist=False)


def test_no_part_holds_the_store(store):
    parts = [store.pages, store.sharing, store.maintenance, store.daemon, store.io, store.fetcher,
             store.handle(store.namespace())]
    for part in parts:
        held = [name for name, value in vars(part).items() if isinstance(value, TieredStore)]
        assert not held, f"{type(part).__name__} holds the store as {held}"
        assert getattr(part, "core", store.core) is store.core


def test_the_store_verbs_are_its_parts_methods(store):
    assert store.evict == store.maintenance.evict and store.lease_warm == store.sharing.lease_warm
    assert store.acquire == store.pages.acquire and store.match == store.core.match
    assert TieredStore.evict.part == "maintenance"   # on the class: the delegation itself


def test_a_snapshot_is_immutable_and_does_not_follow_the_store(store):
    ns = store.namespace()
    slots, keys = fill_and_commit(store, ns, tokens_for(1, 3))
    settle(store)
    snap = store.snapshot(pages=True)
    assert set(snap.pages) == set(keys) and snap.page_size == SPEC.page_size
    assert snap.tiers["hot"] == (store.hot.used_bytes, store.hot.capacity_bytes) and snap.tiers["cold"][0] > 0
    page = snap.pages[keys[0]]
    assert page.refcount == 1 and page.tiers == ("hot", "cold") and page.children == 1
    with pytest.raises(AttributeError):
        page.refcount = 0
    with pytest.raises(TypeError):
        snap.pages[b"x"] = page
    store.release(slots)
    store.evict(keys, None)
    assert snap.pages[keys[0]].refcount == 1 and len(snap.pages) == 3   # taken before: unchanged
    assert store.snapshot(pages=True).pages == {}
    assert store.snapshot().pages == {} and store.snapshot(pages=[keys[0]]).pages == {}


def test_a_snapshot_of_one_tier_copies_only_its_pages(store):
    ns = store.namespace()
    slots, keys = fill_and_commit(store, ns, tokens_for(1, 3))
    settle(store)
    store.release(slots)
    store.evict(keys[2:], "cold")   # the last page leaves memory, stays in cold
    assert set(store.snapshot(pages=True, tier="hot").pages) == set(keys[:2])
    assert set(store.snapshot(pages=True, tier="cold").pages) == set(keys)
    assert store.snapshot(pages=True, tier="remote").pages == {}   # not a built-in tier: no page


class SnapshotOnly:
    """A store that offers the views nothing but snapshot() (and the remote tier's state)."""

    remote = None

    def __init__(self, store):
        self.snapshot = store.snapshot


def test_views_and_the_sampler_read_only_the_snapshot(store):
    ns = store.namespace()
    slots, keys = fill_and_commit(store, ns, tokens_for(2, 2))
    store.release(slots)
    store.acquire(keys)   # a hit on each page
    only = SnapshotOnly(store)
    listed = views.list_pages(only, "hot", None, None, 10, None)
    assert listed["total"] == 2 and {p["key"] for p in listed["pages"]} == {k.hex() for k in keys}
    assert views.get_page(only, keys[1])["depth"] == 1 and views.get_page(only, b"\0" * 16) is None
    top = views.top_prefixes(only, 5)
    assert [p["key"] for p in top["prefixes"]] == [keys[1].hex()] and top["prefixes"][0]["pages"] == 2
    assert views.write_health(only)["write_behind"]["max_dirty_pages"] > 0
    used, moved = tier_usage(only)
    assert used["hot"][0] == store.hot.used_bytes and set(moved) == set(store.counts.bytes_moved)

