"""kvstore.heap: the startup heap frozen out of the collector's full passes, and its pauses counted."""

from __future__ import annotations

import gc

import pytest

from kvstore import heap
from kvstore.server.metrics import HeapCollector


@pytest.fixture
def unfrozen():
    """Freezing in the test process would keep every later test's garbage: thaw afterwards."""
    yield
    heap.thaw()


class Node:
    def __init__(self):
        self.me = self   # a reference cycle: only a collection frees it


def test_freeze_startup_moves_live_objects_out_of_reach(unfrozen, caplog):
    caplog.set_level("INFO", logger="kvstore.heap")
    kept = [Node() for _ in range(1000)]
    before = heap.pauses().snapshot()["collections"][2]
    frozen = heap.freeze_startup("a test")
    assert heap.pauses().snapshot()["collections"][2] == before   # its own collection is the startup's
    assert frozen >= 1000 and gc.get_freeze_count() > 0   # frozen objects may still be freed by refcount
    assert any("a test: froze" in r.getMessage() for r in caplog.records)
    # frozen objects are out of every generation a collection walks; what is made later is collected
    walked = {id(o) for g in (0, 1, 2) for o in gc.get_objects(g)}
    assert not any(id(n) in walked for n in kept)
    later = [Node() for _ in range(100)]
    del later
    assert gc.collect() >= 100


def test_pauses_count_each_generation():
    pauses = heap.pauses()
    assert pauses is heap.pauses() and pauses._callback in gc.callbacks
    before = pauses.snapshot()
    gc.collect(0)
    gc.collect(2)
    after = pauses.snapshot()
    assert after["collections"][0] > before["collections"][0]
    assert after["collections"][2] > before["collections"][2]
    assert after["pause_seconds"][2] > before["pause_seconds"][2]
    assert after["longest_pause_seconds"][2] > 0


def test_the_collector_reports_them():
    gc.collect(1)
    families = {f.name: f for f in HeapCollector().collect()}
    assert set(families) == {"kvstore_gc_collections", "kvstore_gc_pause_seconds",
                             "kvstore_gc_longest_pause_seconds", "kvstore_gc_frozen_objects"}
    collections = {s.labels["generation"]: s.value for s in families["kvstore_gc_collections"].samples
                   if s.name.endswith("_total")}
    assert set(collections) == {"0", "1", "2"} and collections["1"] > 0


def test_frozen_thaws_when_the_block_ends():
    with heap.frozen("a test"):
        assert gc.get_freeze_count() > 0
        assert heap.pauses().snapshot()["frozen_objects"] > 0
    assert gc.get_freeze_count() == 0 and heap.pauses().snapshot()["frozen_objects"] == 0
