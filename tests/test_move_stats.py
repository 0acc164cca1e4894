"""MoveStats, the one place that counts: every counter of store.stats() for a scripted sequence."""

from __future__ import annotations

import logging

from kvstore.movement.move_stats import MoveStats, directions
from tests.storeutil import SPEC, fill_and_commit, hold, make_store, settle, tokens_for

PB = SPEC.page_bytes


def counters(stats: dict) -> dict:
    return {"tiers": {t: {k: stats["tiers"][t][k] for k in ("hits", "misses", "evictions", "promotions")}
                      for t in ("hot", "warm", "cold")},
            "bytes_moved": stats["bytes_moved"],
            **{k: stats[k] for k in ("corrupt_pages", "dropped_pages", "mismatched_pages")}}


def expect(hot=(0, 0, 0, 0), warm=(0, 0, 0, 0), cold=(0, 0, 0, 0), dropped=0, **moved) -> dict:
    names = ("hits", "misses", "evictions", "promotions")
    return {"tiers": {t: dict(zip(names, v)) for t, v in (("hot", hot), ("warm", warm), ("cold", cold))},
            "bytes_moved": {d: moved.get(d, 0) * PB for d in directions(("hot", "warm", "cold"))},
            "corrupt_pages": 0, "dropped_pages": dropped, "mismatched_pages": 0}


def test_the_directions_are_the_reported_ones():
    assert directions(("hot", "warm", "cold")) == ("hot_to_warm", "warm_to_hot", "warm_to_cold", "cold_to_warm",
                                                   "hot_to_cold", "cold_to_hot", "remote_to_warm", "peer_to_warm")
    m = MoveStats(("hot", "warm", "cold"), 10)
    m.count("move", "hot", 3, "warm")
    m.count("corrupt", "cold")
    m.count("drop", None, 2, reason="cold_full")
    snap = m.snapshot()
    assert snap["bytes_moved"]["hot_to_warm"] == 30 and snap["tiers"]["cold"]["misses"] == 1
    assert (snap["corrupt_pages"], snap["dropped_pages"]) == (1, 2)
    assert snap["dropped_by_reason"] == {"no_cold_tier": 0, "cold_full": 2, "write_error": 0}


def test_every_counter_moves_as_scripted(tmp_path):
    s = make_store(tmp_path, hot=4, warm=4)
    try:
        ns = s.namespace()
        slots, keys = fill_and_commit(s, ns, tokens_for(1, 2))
        s.release(slots)
        settle(s)   # written behind from hot as they were committed
        assert counters(s.stats()) == expect(hot_to_cold=2)
        s.evict(keys, to="warm")
        assert counters(s.stats()) == expect(hot=(0, 0, 2, 0), hot_to_warm=2, hot_to_cold=2)
        s.release(s.acquire(keys))
        s.release(s.acquire(keys))
        assert counters(s.stats()) == expect(hot=(2, 2, 2, 2), warm=(2, 0, 0, 0), hot_to_warm=2, warm_to_hot=2,
                                             hot_to_cold=2)
        s.evict(keys, to="cold")
        assert counters(s.stats()) == expect(hot=(2, 2, 4, 2), warm=(2, 0, 2, 0), hot_to_warm=2, warm_to_hot=2,
                                             hot_to_cold=2)
        s.release(hold(s, keys))
        assert counters(s.stats()) == expect(hot=(2, 4, 4, 4), warm=(4, 0, 2, 2), cold=(2, 0, 0, 0), hot_to_warm=2,
                                             warm_to_hot=4, hot_to_cold=2, cold_to_warm=2)
        s.evict(keys, to=None)
        assert len(s.index) == 0
        assert counters(s.stats()) == expect(hot=(2, 4, 6, 4), warm=(4, 0, 4, 2), cold=(2, 0, 2, 0), hot_to_warm=2,
                                             warm_to_hot=4, hot_to_cold=2, cold_to_warm=2)
    finally:
        s.close()


def test_dropped_pages_are_counted_once_each(tmp_path):
    s = make_store(tmp_path, hot=2, warm=0, **{"cold.enabled": "false"})
    try:
        slots, keys = fill_and_commit(s, s.namespace(), tokens_for(2, 2))
        s.release(slots)
        s.release(s.allocate(2))   # no room below hot: the cached chain leaves, leaf first
        assert len(s.index) == 0
        assert counters(s.stats()) == expect(hot=(0, 0, 2, 0), dropped=2)
    finally:
        s.close()


def test_drops_are_logged_once_then_with_the_count_since(caplog):
    caplog.set_level(logging.INFO, "kvstore.store")
    m = MoveStats(("hot", "warm", "cold"), 10)
    for _ in range(5):
        m.count("drop", None, 3, reason="cold_full")
    lines = [r for r in caplog.records if "pages dropped" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING and "3 cold_full" in lines[0].getMessage()
    m._drop_log.next = 0.0   # the interval has passed
    m.count("drop", None, 1, reason="write_error")
    lines = [r.getMessage() for r in caplog.records if "pages dropped" in r.getMessage()]
    assert len(lines) == 2 and "12 cold_full, 1 write_error" in lines[1] and "16 in all" in lines[1]
