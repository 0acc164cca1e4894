"""The Python heap of a long-running process (`kvstore serve`, `kvstore sidecar`, `kvstore job`):
its startup objects frozen out of the collector's reach, and the collector's pauses counted.

A full collection (generation 2) walks every tracked object. After startup that is mostly what
importing PyTorch, transformers and aiohttp, loading the model and building the store left behind,
none of which ever becomes garbage: with the tiny model, `kvstore serve` paused its engine for
150-160 ms in each of those collections (two in a 40 s benchmark of cold admissions), and 5 ms
once the startup heap was frozen (BENCHMARKS.md). So each process freezes its heap once it is
ready (gc.freeze: those objects move to a permanent generation that no collection visits), as
vLLM's engine core does, and thaws it when it stops serving (`frozen`), so that a process that
lives on (a test, a program that runs `kvstore job` in-process) collects it again. Objects made
meanwhile are collected as before.

GcPauses records every collection's duration by generation (gc.callbacks), for /metrics.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time

log = logging.getLogger("kvstore.heap")

GENERATIONS = (0, 1, 2)


def freeze_startup(what: str) -> int:
    """Collect once, then freeze every object left (gc.freeze); returns how many are frozen now.
    `what`: the process, for the log line. That one collection, before the process serves, is not
    counted among GcPauses' (it is the startup's, and as long as the pauses the freeze removes)."""
    started = time.perf_counter()
    _PAUSES.skip = True
    try:
        gc.collect()
    finally:
        _PAUSES.skip = False
    gc.freeze()
    frozen = _PAUSES.frozen = gc.get_freeze_count()   # counted once: the call walks every frozen object
    log.info("%s: froze %d objects of the startup heap (full collections skip them; collecting first took "
             "%.0f ms)", what, frozen, (time.perf_counter() - started) * 1e3)
    return frozen


def thaw() -> None:
    """Undo freeze_startup: the frozen objects are collectable again (gc.unfreeze)."""
    gc.unfreeze()
    _PAUSES.frozen = 0


@contextlib.contextmanager
def frozen(what: str):
    """The startup heap frozen while the block runs (a process serving), thawed after it."""
    freeze_startup(what)
    try:
        yield
    finally:
        thaw()


class GcPauses:
    """Collections by generation since install(): how many, their total and longest seconds. One
    per process (`pauses()`). A collection holds the GIL from its start callback to its stop
    callback and collections never overlap, so one start time is enough and no lock is taken (a
    lock here would deadlock: a snapshot's allocations may start a collection on its own thread)."""

    def __init__(self):
        self.count = {g: 0 for g in GENERATIONS}
        self.seconds = {g: 0.0 for g in GENERATIONS}
        self.longest = {g: 0.0 for g in GENERATIONS}
        self.frozen = 0                    # objects freeze_startup froze (0 after thaw)
        self.skip = False                  # freeze_startup's own collection is not counted
        self._began: float | None = None   # the running collection's start, when counted

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = None if self.skip else time.perf_counter()
            return
        g = info.get("generation")
        if self._began is None or g not in self.count:
            return
        took = time.perf_counter() - self._began
        self.count[g] += 1
        self.seconds[g] += took
        self.longest[g] = max(self.longest[g], took)

    def snapshot(self) -> dict:
        """{"collections": {gen: n}, "pause_seconds": {gen: s}, "longest_pause_seconds": {gen: s},
        "frozen_objects": n} (a collection that the copying itself starts may land in some of them)."""
        return {"collections": dict(self.count), "pause_seconds": dict(self.seconds),
                "longest_pause_seconds": dict(self.longest), "frozen_objects": self.frozen}


_PAUSES = GcPauses()


def pauses() -> GcPauses:
    """The process's GcPauses, installed on first use."""
    _PAUSES.install()
    return _PAUSES
