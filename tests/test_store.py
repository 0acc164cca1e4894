"""TieredStore behaviour on CPU with real tiers (LMDB in a temp dir)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import lmdb
import pytest
import torch

from kvstore.errors import KVStoreError, OutOfCapacity
from kvstore.pages.keys import Namespace, page_keys, tokens_bytes
from kvstore.pages.record import RecordHeader
from kvstore.pages.spec import KVSpec
from storeutil import SPEC, expected_page, fill_and_commit, hold, make_store, settle, tokens_for


@pytest.fixture
def store(tmp_path):
    s = make_store(tmp_path)
    yield s
    s.close(persist=False)


def held_pages_match(store, slots, keys):
    return all(torch.equal(store.hot.read_page(s), expected_page(k)) for s, k in zip(slots, keys))


def test_demote_to_cold_and_promote_back_is_byte_identical(store):
    ns = store.namespace()
    tokens = tokens_for(1, 6)
    slots, keys = fill_and_commit(store, ns, tokens)
    store.release(slots)
    settle(store)   # written behind from hot, as they were committed
    assert store.match(tokens, ns).tiers == ["hot"] * 6
    store.evict(keys, to="warm")
    assert store.match(tokens, ns).tiers == ["warm"] * 6
    store.evict(keys, to="cold")
    m = store.match(tokens, ns)
    assert m.tiers == ["cold"] * 6 and m.num_tokens == 6 * SPEC.page_size
    got = hold(store, m.keys)
    assert len(got) == 6 and held_pages_match(store, got, keys)
    store.release(got)
    st = store.stats()
    assert st["bytes_moved"]["hot_to_warm"] == 6 * SPEC.page_bytes
    assert st["bytes_moved"]["hot_to_cold"] == 6 * SPEC.page_bytes and st["bytes_moved"]["warm_to_cold"] == 0
    assert st["tiers"]["cold"]["hits"] == 6
    assert store.audit()["problems"] == []


def test_partial_match_and_suffix_only(store):
    ns = store.namespace()
    base = tokens_for(2, 4)
    slots, _ = fill_and_commit(store, ns, base)
    store.release(slots)
    longer = base + tokens_for(3, 2)
    assert store.match(longer, ns).num_pages == 4
    diverged = base[:SPEC.page_size * 2] + [499] * (SPEC.page_size * 2)
    assert store.match(diverged, ns).num_pages == 2
    assert store.match(base[:SPEC.page_size * 3 + 5], ns).num_pages == 3  # only full pages


def test_other_tenant_salt_or_model_never_matches(store):
    ns = store.namespace()
    tokens = tokens_for(4, 3)
    slots, _ = fill_and_commit(store, ns, tokens)
    store.release(slots)
    assert store.match(tokens, ns).num_pages == 3
    for other in (store.namespace(tenant="b"), store.namespace(salt="s"),
                  Namespace.for_spec("other-model", SPEC), Namespace("tiny", "bfloat16")):
        assert store.match(tokens, other).num_pages == 0


def _forge(store, header: RecordHeader):
    """Write a record straight into the cold LMDB (as a buggy or malicious writer might)."""
    payload = expected_page(header.key).view(torch.uint8).reshape(-1).numpy()
    store.cold.put_many([(header, payload)]).result()


def test_forged_records_with_other_tokens_namespace_or_spec_are_never_served(tmp_path):
    s = make_store(tmp_path)
    ns = s.namespace()
    tokens = tokens_for(5, 3)
    keys = page_keys(ns, tokens, SPEC.page_size)
    ps = SPEC.page_size
    wrong_tokens = tokens_bytes([t + 1 for t in tokens[:ps]])
    other_ns = s.namespace(tenant="mallory").digest
    other_spec = KVSpec(2, 2, 16, "float16", 16).fingerprint
    _forge(s, RecordHeader(keys[0], ns.digest, ns.digest, wrong_tokens, SPEC.fingerprint, SPEC.page_bytes))
    _forge(s, RecordHeader(keys[1], keys[0], other_ns, tokens_bytes(tokens[ps:2 * ps]), SPEC.fingerprint,
                           SPEC.page_bytes))
    _forge(s, RecordHeader(keys[2], keys[1], ns.digest, tokens_bytes(tokens[2 * ps:]), other_spec,
                           SPEC.page_bytes))
    s.close(persist=False)
    s = make_store(tmp_path)
    try:
        assert s.match(tokens, ns).num_pages == 0
        assert s.acquire(keys) == []
        assert s.mismatched_pages >= 1
    finally:
        s.close(persist=False)


def test_flipped_byte_in_cold_record_is_a_counted_miss_and_fsck_reports_it(tmp_path):
    from kvstore.tools import fsck
    s = make_store(tmp_path)
    ns = s.namespace()
    tokens = tokens_for(6, 4)
    slots, keys = fill_and_commit(s, ns, tokens)
    s.release(slots)
    s.close(persist=True)
    env = lmdb.open(str(tmp_path / "cold"), max_dbs=4, subdir=True)
    db = env.open_db(b"pages")
    with env.begin(write=True, db=db) as txn:
        rec = bytearray(txn.get(keys[2]))
        rec[len(rec) // 2] ^= 0x40
        txn.put(keys[2], bytes(rec))
    env.close()
    report = fsck.check(tmp_path / "cold")
    assert [k for k, _ in report.damaged] == [keys[2].hex()]
    s = make_store(tmp_path)
    try:
        m = s.match(tokens, ns)
        assert m.num_pages == 4  # the index knows the key; the bytes are checked on load
        got = hold(s, m.keys)
        assert len(got) == 2 and held_pages_match(s, got, keys[:2])
        assert s.stats()["corrupt_pages"] == 1
        assert s.stats()["tiers"]["cold"]["misses"] == 1
        s.release(got)
        assert s.match(tokens, ns).num_pages == 2  # never offered again
    finally:
        s.close(persist=False)


def test_reopen_in_new_process_serves_same_pages(tmp_path):
    s = make_store(tmp_path)
    ns = s.namespace()
    tokens = tokens_for(7, 5)
    slots, keys = fill_and_commit(s, ns, tokens)
    s.release(slots)
    s.close(persist=True)  # hot pages are written to cold on a clean shutdown
    code = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
        from storeutil import make_store, hold, tokens_for, expected_page
        s = make_store({str(tmp_path)!r})
        ns = s.namespace()
        tokens = tokens_for(7, 5)
        m = s.match(tokens, ns)
        got = hold(s, m.keys)
        ok = len(got) == 5 and all(torch.equal(s.hot.read_page(g), expected_page(k)) for g, k in zip(got, m.keys))
        print(m.tiers, ok)
        s.release(got)
        s.close(persist=False)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['cold', 'cold', 'cold', 'cold', 'cold'] True"


def test_allocation_never_oversubscribes(store):
    ns = store.namespace()
    slots, _ = fill_and_commit(store, ns, tokens_for(8, 6))  # held
    extra = store.allocate(2)
    with pytest.raises(OutOfCapacity, match="out of KV capacity"):
        store.allocate(1)
    store.release(extra)
    store.release(slots)
    assert len(store.allocate(8)) == 8  # cached pages are evicted to make room


def test_released_pages_stay_cached_and_tail_goes_first(tmp_path):
    s = make_store(tmp_path, hot=4, warm=0, cold=64)
    try:
        ns = s.namespace()
        tokens = tokens_for(9, 4)
        slots, keys = fill_and_commit(s, ns, tokens)
        s.release(slots)
        assert s.match(tokens, ns).tiers == ["hot"] * 4
        settle(s)       # written behind to cold as they were committed
        s.rebalance()   # the daemon's round: above the high watermark, the tail leaves hot
        assert s.match(tokens, ns).tiers == ["hot", "hot", "hot", "cold"]
        fresh = s.allocate(1)  # one cached page must go: the tail
        assert s.match(tokens, ns).tiers == ["hot", "hot", "hot", "cold"]
        s.release(fresh)
    finally:
        s.close(persist=False)


def test_pinned_pages_are_not_evicted_until_unpinned(store):
    ns = store.namespace()
    tokens = tokens_for(10, 4)
    slots, keys = fill_and_commit(store, ns, tokens)
    store.release(slots)
    assert store.pin(keys) == 4
    assert store.evict(keys, to=None) == 0
    assert store.flush("hot") == 0
    assert store.match(tokens, ns).tiers == ["hot"] * 4
    store.unpin(keys)
    assert store.evict(keys, to="cold") > 0
    assert store.match(tokens, ns).tiers == ["cold"] * 4


def test_pin_expires(store):
    ns = store.namespace()
    slots, keys = fill_and_commit(store, ns, tokens_for(11, 2))
    store.release(slots)
    store.pin(keys, ttl_s=0.0)
    assert store.evict(keys, to="warm") > 0


def test_referenced_pages_are_never_evicted(store):
    ns = store.namespace()
    slots, keys = fill_and_commit(store, ns, tokens_for(12, 3))
    assert store.evict(keys, to=None) == 0
    assert store.flush("hot") == 0
    store.release(slots)


def test_release_of_unheld_slot_is_an_error(store):
    with pytest.raises(KVStoreError, match="not held"):
        store.release([3])


def test_evict_out_of_store_removes_leaves_then_parents(store):
    ns = store.namespace()
    tokens = tokens_for(13, 3)
    slots, keys = fill_and_commit(store, ns, tokens)
    store.release(slots)
    store.evict(keys[1:2], to=None)  # a parent with a cached child: stays
    assert store.match(tokens, ns).num_pages == 3
    store.evict(keys, to=None)
    assert store.match(tokens, ns).num_pages == 0
    assert len(store.index) == 0 and store.audit()["problems"] == []


def test_rebalance_brings_hot_below_low_watermark(store):
    ns = store.namespace()
    slots, _ = fill_and_commit(store, ns, tokens_for(14, 8))
    store.release(slots)
    store.rebalance()
    assert store.hot.pool.num_used <= int(0.75 * store.hot.num_pages)
    assert store.match(tokens_for(14, 8), ns).num_pages == 8


@pytest.mark.parametrize("policy", ["lru", "lfu", "refcount", "prefix_aware"])
def test_every_policy_keeps_the_invariants(tmp_path, policy):
    s = make_store(tmp_path, hot=6, warm=4, cold=8, eviction_policy=policy)
    try:
        ns = s.namespace()
        for doc in range(10):
            slots, _ = fill_and_commit(s, ns, tokens_for(doc, 3))
            s.release(slots)
            s.rebalance()
            assert s.audit()["problems"] == []
        for doc in range(10):
            m = s.match(tokens_for(doc, 3), ns)
            got = hold(s, m.keys)
            assert held_pages_match(s, got, m.keys)
            s.release(got)
    finally:
        s.close(persist=False)


def test_write_through_copies_committed_pages_down(tmp_path):
    s = make_store(tmp_path, write_policy="write_through")
    try:
        ns = s.namespace()
        slots, keys = fill_and_commit(s, ns, tokens_for(15, 3))
        s.release(slots)
        settle(s)   # write-behind copies them to warm on the way to cold
        assert all(e.warm is not None and e.cold for e in map(s.index.get, keys))
        moved_before = dict(s.stats()["bytes_moved"])
        s.evict(keys, to="cold")  # only frees: copies exist already
        assert s.stats()["bytes_moved"] == moved_before
    finally:
        s.close(persist=False)


def test_open_serves_at_once_and_indexes_cold_in_the_background(tmp_path):
    from kvstore.store.tiered import TieredStore
    from storeutil import make_config
    s = make_store(tmp_path, hot=8, warm=8, cold=64)
    ns = s.namespace()
    chains = [tokens_for(40 + d, 4) for d in range(6)]
    for tokens in chains:
        slots, _ = fill_and_commit(s, ns, tokens)
        s.release(slots)
        s.rebalance()   # the daemon's round: writes behind what no longer fits in memory
    s.close(persist=True)
    s = TieredStore(make_config(tmp_path, hot=8, warm=8, cold=64))
    try:
        slots = s.allocate(2)          # usable before the index is complete
        s.release(slots)
        assert s.wait_indexed(30) and s.indexing == {"done": True, "pages": 24}
        for tokens in chains:
            m = s.match(tokens, ns)
            assert m.tiers == ["cold"] * 4
            got = hold(s, m.keys)
            assert held_pages_match(s, got, m.keys)
            s.release(got)
        assert s.audit()["problems"] == []
    finally:
        s.close(persist=False)


def test_rebalance_brings_cold_below_its_low_watermark(tmp_path):
    """Above cold.high_watermark, rebalance frees cold down to cold.low_watermark: as many bytes as
    the excess, whatever room the tier still has (it once subtracted that room from the excess, and
    with the room larger than the excess freed nothing)."""
    probe = make_store(tmp_path / "probe")
    try:
        slots, keys = fill_and_commit(probe, probe.namespace(), tokens_for(50, 1))
        probe.release(slots)
        probe.evict(keys, to="cold")
        record = probe.cold.used_bytes      # one record's bytes, header included
    finally:
        probe.close()
    s = make_store(tmp_path / "s", hot=16, warm=16, **{
        "cold.max_bytes": str(int(19.2 * record)), "cold.map_size_max": "64MiB",   # the room is max_bytes'
        "cold.high_watermark": "0.5", "cold.low_watermark": "0.15"})
    try:
        ns = s.namespace()
        for doc in range(10):           # 10 records: 52% of the tier, above its high watermark
            slots, keys = fill_and_commit(s, ns, tokens_for(60 + doc, 1))
            s.release(slots)
            s.evict(keys, to="cold")
        assert s.cold.used_bytes == 10 * record
        s.rebalance()
        assert s.cold.used_bytes <= 0.15 * s.cold.capacity_bytes, s.cold.used_bytes / record
        assert s.audit()["problems"] == []
    finally:
        s.close()


def test_a_prefix_in_warm_comes_up_to_hot_in_one_batched_copy(store, monkeypatch):
    """acquire of a chain whose pages are in warm: one DeviceTier.load_from for all of them (runs of
    slots, not a copy a page), the bytes identical, counted as that many warm hits and promotions."""
    ns = store.namespace()
    tokens = tokens_for(5, 6)
    slots, keys = fill_and_commit(store, ns, tokens)
    store.release(slots)
    settle(store)
    store.evict(keys, to="warm")
    assert store.match(tokens, ns).tiers == ["warm"] * 6
    calls = []
    load_from = store.hot.load_from
    monkeypatch.setattr(store.hot, "load_from", lambda *a: (calls.append(len(a[0])), load_from(*a))[1])
    before = store.stats()
    got = store.acquire(keys)
    after = store.stats()
    assert calls == [6]
    assert len(got) == 6 and held_pages_match(store, got, keys)
    assert got == list(range(got[0], got[0] + 6))   # one run of hot slots: attention reads it in place
    assert after["tiers"]["warm"]["hits"] - before["tiers"]["warm"]["hits"] == 6
    assert after["tiers"]["hot"]["promotions"] - before["tiers"]["hot"]["promotions"] == 6
    store.release(got)
    assert store.audit()["problems"] == []


def test_tier_pages_are_the_pages_stats_reports(tmp_path):
    s = make_store(tmp_path, hot=4, warm=4)
    try:
        ns = s.namespace()
        for doc in range(3):   # 9 pages through 4 hot and 4 warm: some reach cold
            slots, _ = fill_and_commit(s, ns, tokens_for(doc, 3))
            s.release(slots)
            settle(s)
        tiers = s.stats()["tiers"]
        assert s.tier_pages() == {t: tiers[t]["pages"] for t in s.tier_pages()}
        assert set(s.tier_pages()) >= {"hot", "warm", "cold"} and sum(s.tier_pages().values()) >= 9
    finally:
        s.close()
