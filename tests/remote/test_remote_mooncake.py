"""The remote tier on a real Mooncake Store (a mooncake_master with its HTTP metadata server, TCP):
pages store A computed, a fresh store B (its own data directory, lending no memory) finds
byte-exact, and another namespace finds nothing. Mooncake keeps values in the memory its clients
lend (segment=): A lends it, so A stays up while B reads."""

from __future__ import annotations

import pytest

import mooncakeutil
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
