"""The Python heap of a long-running process (`kvstore serve`, `kvstore sidecar`, `kvstore job`):
its startup objects frozen out of the collector's reach, and the collector's pauses counted.

A full collection (generation 2) walks every tracked object. After startup that is mostly what
importing PyTorch, transformers and aiohttp, loading the model and building the store left behind,
none of which ever becomes garbage: with the tiny model, `kvstore serve` paused its engine for
150-160 ms in each of those collections (two in a 40 s benchmark of cold admissions), and 5 ms
once the startup heap was frozen (BENCHMARKS.md). So each process freezes its heap once it is
ready (gc.freeze: those objects move to a permanent generation that no collection visits), as
vLLM's engine core does. Objects made later are collected as before.

GcPauses records every collection's duration by generation (gc.callbacks), for /metrics.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time

log = logging.getLogger("kvstore.heap")

GENERATIONS = (0, 1, 2)


def freeze_startup(what: str) -> int:
    """Collect once, then freeze every object left (gc.freeze); returns how many are frozen now.
    `what`: the process, for the log line. That one collection, before the process serves, is not
    counted among GcPauses' (it is the startup's, and as long as the pauses the freeze removes)."""
    started = time.perf_counter()
    with _PAUSES.skipping():
        gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: froze %d objects of the startup heap (full collections skip them; collecting first took "
             "%.0f ms)", what, frozen, (time.perf_counter() - started) * 1e3)
    return frozen


class GcPauses:
    """Collections by generation since install(): how many, their total and longest seconds. One
    per process (`pauses()`); thread-safe (a collection runs on whichever thread triggered it)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._started: dict[int, float] = {}   # by thread: a collection runs on one thread at a time anyway
        self.count = {g: 0 for g in GENERATIONS}
        self.seconds = {g: 0.0 for g in GENERATIONS}
        self.longest = {g: 0.0 for g in GENERATIONS}
        self.installed = False
        self._skip = threading.local()

    @contextlib.contextmanager
    def skipping(self):
        """Collections that the calling thread runs meanwhile are not counted."""
        self._skip.on = True
        try:
            yield
        finally:
            self._skip.on = False

    def install(self) -> None:
        with self._lock:
            if not self.installed:
                gc.callbacks.append(self._callback)
                self.installed = True

    def _callback(self, phase: str, info: dict) -> None:
        now, me = time.perf_counter(), threading.get_ident()
        if phase == "start":
            if not getattr(self._skip, "on", False):
                self._started[me] = now
            return
        began = self._started.pop(me, None)
        g = info.get("generation")
        if began is None or g not in self.count:
            return
        took = now - began
        with self._lock:
            self.count[g] += 1
            self.seconds[g] += took
            self.longest[g] = max(self.longest[g], took)

    def snapshot(self) -> dict:
        """{"collections": {gen: n}, "pause_seconds": {gen: s}, "longest_pause_seconds": {gen: s},
        "frozen_objects": n}."""
        with self._lock:
            return {"collections": dict(self.count), "pause_seconds": dict(self.seconds),
                    "longest_pause_seconds": dict(self.longest), "frozen_objects": gc.get_freeze_count()}


_PAUSES = GcPauses()


def pauses() -> GcPauses:
    """The process's GcPauses, installed on first use."""
    _PAUSES.install()
    return _PAUSES
