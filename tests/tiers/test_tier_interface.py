"""The tier interface: a tier registered by name through the registry, placed between warm and
cold, walked by the mover (pages demote into it and are read back exactly), and the read-only
peer source."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.errors import ConfigError
from kvstore.store.tiered import TieredStore
from kvstore.tiers.base import TIER_BACKENDS, SlotPool, SlotTier
from kvstore.tiers.peer_pages import PeerPages
from tests.storeutil import QUIET, SPEC, expected_page, fill_and_commit, hold, make_config, tokens_for


class ArrayTier(SlotTier):
    """A second in-memory tier: page-first slots in one numpy array."""

    def __init__(self, role, spec, num_slots):
        super().__init__(spec)
        self.name = role
        self.data = np.zeros((num_slots, spec.page_bytes), dtype=np.uint8)   # [slots, page_bytes]
        self.pool = SlotPool(num_slots)

    def payloads(self, slots):
        return [self.data[s] for s in slots]

    def store_pages(self, slots, payloads):
        for s, p in zip(slots, payloads):
            self.data[s] = np.frombuffer(memoryview(p).cast("B"), dtype=np.uint8)


TIER_BACKENDS.register("test-array")(lambda role, spec, num_slots: ArrayTier(role, spec, num_slots))


def spill_store(tmp_path, cold: bool, spill: int = 8, **kw) -> TieredStore:
    config = make_config(tmp_path, **{"cold.enabled": str(cold).lower(), **kw})
    s = TieredStore(config, extra_tiers=[("spill", "test-array", {"num_slots": spill})])
    s.wait_indexed()
    return s


def test_the_registry_knows_the_built_in_backends_and_refuses_unknown_ones():
    assert {"device", "host", "lmdb", "test-array"} <= set(TIER_BACKENDS.names())
    with pytest.raises(ConfigError, match="tier backend"):
        TIER_BACKENDS.get("no-such-tier")


@pytest.mark.parametrize("cold", [False, True])
def test_pages_demote_into_a_middle_tier_and_come_back_exactly(tmp_path, cold):
    s = spill_store(tmp_path, cold, hot=4, warm=4, **QUIET)
    try:
        assert [t.name for t in s.tiers] == ["hot", "warm", "spill", *(["cold"] if cold else [])]
        ns = s.namespace()
        tokens = tokens_for(1, 4)
        slots, keys = fill_and_commit(s, ns, tokens)
        s.release(slots)
        assert s.evict(keys, to="spill") == 8   # out of hot, then out of warm
        assert {s.index.get(k).tier for k in keys} == {"spill"}
        assert s.match(tokens, ns).tiers == ["spill"] * 4
        st = s.stats()
        assert st["tiers"]["spill"]["pages"] == 4
        assert st["bytes_moved"]["warm_to_spill"] == 4 * SPEC.page_bytes
        assert s.audit()["problems"] == []

        held = hold(s, keys)   # read back up to warm through the interface, then into hot
        assert len(held) == 4
        for key, slot in zip(keys, held):
            assert torch.equal(s.hot.read_page(slot), expected_page(key))
        st = s.stats()
        assert st["bytes_moved"]["spill_to_warm"] == 4 * SPEC.page_bytes
        assert st["tiers"]["spill"]["hits"] == 4 and st["tiers"]["warm"]["promotions"] == 4
        s.release(held)
        assert s.audit()["problems"] == []
    finally:
        s.close()


def test_a_full_middle_tier_drops_leaves_without_a_cold_tier(tmp_path):
    s = spill_store(tmp_path, False, spill=2, hot=4, warm=1)
    try:
        ns = s.namespace()
        slots, keys = fill_and_commit(s, ns, tokens_for(2, 4))
        s.release(slots)
        s.evict(keys, to="spill")
        st = s.stats()
        assert st["tiers"]["spill"]["pages"] + st["tiers"]["warm"]["pages"] + st["tiers"]["hot"]["pages"] \
            == len(s.index) < 4
        assert st["dropped_pages"] == 4 - len(s.index)
        assert s.audit()["problems"] == []
    finally:
        s.close()


def test_peer_pages_are_a_read_only_source_read_into_warm(tmp_path):
    a = TieredStore(make_config(tmp_path / "a", **{"cold.enabled": "false"}))
    b = TieredStore(make_config(tmp_path / "b", **{"cold.enabled": "false"}))
    try:
        ns = a.namespace()
        tokens = tokens_for(3, 3)
        slots, keys = fill_and_commit(a, ns, tokens)
        records = [(h, bytes(p)) for h, p in ((r[0], r[1]) for r in _decode(a.export_records(ns.digest, keys)))]
        source = PeerPages(SPEC, records)
        assert source.contains(keys + [b"x" * 32]) == [True, True, True, False]
        with pytest.raises(NotImplementedError):
            source.evict(keys)
        slot = b.warm.alloc(1)   # a page that is not exactly the one asked for is not read
        assert source.read_into([records[1][0]._replace(tokens=records[2][0].tokens)], b.warm, slot).result() == [False]
        b.warm.evict(slot)
        assert b.import_records(records[1:]) == 0   # its parent is not cached: nothing is taken
        assert b.import_records(records) == 3
        assert b.stats()["bytes_moved"]["peer_to_warm"] == 3 * SPEC.page_bytes
        assert b.match(tokens, ns).tiers == ["warm"] * 3
        held = b.acquire(keys)
        for key, slot in zip(keys, held):
            assert torch.equal(b.hot.read_page(slot), expected_page(key))
        b.release(held)
        a.release(slots)
    finally:
        a.close()
        b.close()


def _decode(blobs):
    from kvstore.pages import record
    return [record.decode(blob) for blob in blobs]


def test_the_config_chooses_each_tier_backend_by_name(tmp_path):
    """hot.backend, warm.backend and cold.backend name registered backends; one that is not
    registered is refused naming the key (the tiers built by then are closed)."""
    built = []

    def counting_host(role, spec, **settings):
        built.append((role, sorted(settings)))
        return TIER_BACKENDS.get("host")(role, spec, **settings)

    TIER_BACKENDS.register("test-counting-host")(counting_host)
    s = TieredStore(make_config(tmp_path / "a", **{"warm.backend": "test-counting-host"}))
    try:
        assert built == [("warm", ["num_slots", "shared", "shm_name"])] and s.tiers[1].name == "warm"
    finally:
        s.close()
    for key in ("hot.backend", "warm.backend", "cold.backend"):
        with pytest.raises(ConfigError, match=f"^{key} = 'no-such-tier': must be a tier backend registered"):
            TieredStore(make_config(tmp_path / key, **{key: "no-such-tier"}))
