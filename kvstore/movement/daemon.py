"""Daemon: the store's one background component. Every move between tiers that waits for a disk
or a timer runs on its threads, so that no caller (the engine thread least of all) waits for one:

- write-behind (thread kvstore-write-behind): a page joins the write-behind queue (index.dirty)
  as soon as it is committed in hot or put in warm; the writer takes what is queued, oldest first
  (parents before children), up to WRITE_BATCH_BYTES per cold transaction, as fast as the disk
  commits them: the next batch is planned and checksummed while the disk commits the last
  (PIPELINE batches in flight, PageIO.start_write / finish_write). Under `write_through` it
  also copies hot pages to warm first, so that evicting them from hot is only a free.
- stranded pages: a page that cold refused (full even after evicting, or failing) is stranded:
  it may be dropped from memory, counted by reason, and the idle writer tries it again every
  RETRY_STRANDED_S (or at once when an operator evicts it), so a disk that had a bad moment
  loses nothing that memory could keep.
- the dirty bound: at most `max_dirty_pages` pages wait to be written (daemon.max_dirty_bytes,
  and never more than half the warm tier, or of hot without warm), so memory always has clean
  pages to free. Producers off the engine thread (sidecar puts, peer imports) wait for room,
  bounded by daemon.backpressure_timeout_s (`room_for`), and then store what fits and say
  what they did not; the engine thread never waits: its admission counts dirty pages
  (`over_bound`) and a request that needs room only the writer can free waits in its queue.
- watermarks and trims (thread kvstore-daemon): every daemon.interval_s, or at once when
  kicked, the `rebalance` given to start (TierMaintenance.rebalance): tiers above their high
  watermark come down to their low one at memory speed (clean pages leave, dirty ones are
  already queued), the cold tier is trimmed to its low watermark, the prefix index to
  prefix_cache_max_entries.
- loads (threads kvstore-read): `load(keys)` brings a chain's cold pages up to warm and returns
  a LoadTicket at once (PageIO.load); the engine polls it, worker threads may wait on it.
- the door for event loops: `await daemon.run(fn, ...)` runs a store call on a worker thread.

`close(persist=True)` drains: loads stop, then the writer writes every queued page before it
stops. Counters and gauges are in `stats()` (store.stats()["write_behind"]). It is given the
store's core (kvstore.store.core), whose lock its condition shares.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Sequence

from kvstore.movement.pageio import LoadTicket, PageIO
from kvstore.placement.index import PageEntry
from kvstore.store.core import StoreCore

log = logging.getLogger("kvstore.daemon")

WRITE_BATCH_BYTES = 32 << 20   # page bytes per write-behind transaction, at most
PIPELINE = 2                   # write-behind batches in flight at once
WAIT_SLICE_S = 0.05            # a waiter looks again at least this often (wake-ups may be missed)
BACKOFF_S = (0.05, 1.0)        # the writer's pause after a failed batch: first and longest
LOAD_ROOM_WAIT_S = 0.5         # a load that finds no warm room waits this long for write-behind
RETRY_STRANDED_S = 5.0         # the idle writer tries the pages cold refused again this often


class Daemon:
    def __init__(self, core: StoreCore, read_threads: int = 2, workers: int = 4):
        self.core, self.config = core, core.config
        self.index = core.index
        self.io = PageIO(core, self.wake)
        self._cond = threading.Condition(core.lock)   # queue, writer progress, releases
        self._rebalance: Callable[[], Any] | None = None   # set by start
        self._kick = threading.Event()
        self._reads = ThreadPoolExecutor(max_workers=max(1, read_threads), thread_name_prefix="kvstore-read")
        self._calls = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvstore")
        self._stopping = False
        self._drain = True
        self.closed = False
        page_bytes = core.spec.page_bytes
        memory = core.warm.num_slots or core.hot.num_pages
        self.max_dirty_pages = max(1, min(self.config.daemon.max_dirty_bytes // page_bytes, memory // 2))
        # counters
        self.written_pages = 0
        self.write_batches = 0
        self.progress = 0           # writer batches done and slots released: what a waiter waits for
        self.waits = 0              # producers that had to wait for room
        self.wait_s = 0.0
        self.refused_pages = 0      # pages producers did not store: no room within their bound
        self.maintenance_errors = 0
        self._threads = [threading.Thread(target=self._write_loop, name="kvstore-write-behind", daemon=True),
                         threading.Thread(target=self._maintain_loop, name="kvstore-daemon", daemon=True)]

    def start(self, rebalance: Callable[[], Any]) -> "Daemon":
        """Start the writer and the watermark thread, which calls `rebalance` when due."""
        self._rebalance = rebalance
        for t in self._threads:
            t.start()
        return self

    def close(self, persist: bool = True) -> None:
        """Stop: loads end, the watermark thread stops, and the writer stops once every queued page
        is written (persist) or at once. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._reads.shutdown(wait=True)
        with self._cond:
            self._stopping, self._drain = True, persist
            self._cond.notify_all()
        self._kick.set()
        for t in self._threads:
            if t.is_alive():
                t.join()
        self._calls.shutdown(wait=True)

    # the door for event loops
    async def run(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run a (blocking) store call on a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._calls, functools.partial(fn, *args, **kwargs))

    # loads
    def load(self, keys: Sequence[bytes]) -> LoadTicket:
        """Start bringing the cold pages of this chain up to warm; returns at once."""
        ticket = LoadTicket(keys)
        try:
            self._reads.submit(self.io.load, ticket, self._wait_warm_room)
        except RuntimeError:   # closed
            ticket.future.set_result(0)
        return ticket

    def end_load(self, ticket: LoadTicket) -> None:
        """The holder is done with the ticket (call under the store's lock)."""
        self.io.end_load(ticket)

    def _wait_warm_room(self) -> bool:
        self.kick()
        return self.wait_progress(LOAD_ROOM_WAIT_S)

    # the dirty bound and backpressure
    def over_bound(self, n: int = 0) -> bool:
        """Whether n more dirty pages would pass the bound (call under the store's lock)."""
        dirty = len(self.index.dirty)
        return self.core.cold is not None and dirty > 0 and dirty + n > self.max_dirty_pages

    def room(self, n: int) -> int:
        """How many of n more dirty pages fit under the bound now (call under the store's lock)."""
        if not self.over_bound(n):
            return n
        return max(0, self.max_dirty_pages - len(self.index.dirty))

    @contextlib.contextmanager
    def room_for(self, n: int, timeout: float, room: Callable[[], bool] | None = None) -> Iterator[bool]:
        """Hold the store's lock once n more dirty pages fit under the bound and room() holds, or
        `timeout` has passed (waiting releases the lock); yields whether they fit, so that the caller
        takes the room before anyone else can. For a producer's worker thread."""
        def ready() -> bool:
            return not self.over_bound(n) and (room is None or room())

        with self._cond:
            ok = ready()
            if not ok:
                started = time.monotonic()
                self.waits += 1
                deadline = started + timeout
                while not (ok := ready()) and not self._stopping and (left := deadline - time.monotonic()) > 0:
                    self.kick()
                    self._cond.wait(min(left, WAIT_SLICE_S))
                self.wait_s += time.monotonic() - started
            yield ok

    def wait_progress(self, timeout: float) -> bool:
        """Block until the writer finishes a batch or slots are released; False after `timeout`."""
        with self._cond:
            seen, deadline = self.progress, time.monotonic() + timeout
            while self.progress == seen and not self._stopping and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(min(left, WAIT_SLICE_S))
            return self.progress != seen

    def wait_clean(self, entries: Sequence[PageEntry], timeout: float | None = None) -> bool:
        """Block until none of `entries` waits to be written (written, stranded or gone)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while any(e.key in self.index.dirty for e in entries):
                if self._stopping or (deadline is not None and time.monotonic() >= deadline):
                    return False
                self._cond.wait(WAIT_SLICE_S)
            return True

    def retry(self, entries: Sequence[PageEntry]) -> None:
        """Queue stranded pages for write-behind again (call under the store's lock)."""
        for e in entries:
            if e.key in self.index.stranded:
                self.index.unstrand(e)
        self.wake()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until the loads queued so far are done and write-behind has caught up (tests, tools)."""
        try:
            self._reads.submit(lambda: None).result(timeout)
        except RuntimeError:   # closed
            return True
        with self._cond:
            pending = list(self.index.dirty.values())
        return self.wait_clean(pending, timeout)

    def take_room(self, n: int, timeout: float, add: Callable[[int], int]) -> int:
        """For a producer of n new dirty pages: once they fit (room_for), add(k) caches at most k of
        them under the store's lock and says how many it did; the writer is woken for them and the
        rest are counted as refused. Returns add's answer."""
        with self.room_for(n, timeout):
            done = add(self.room(n))
            if done:
                self.wake()
        if done < n:
            self.refused(n - done)
        return done

    def refused(self, pages: int) -> None:
        """A producer did not store `pages` pages for lack of room within its bound (counted)."""
        with self._cond:
            self.refused_pages += pages

    def wake(self) -> None:
        """Pages joined the queue, or slots were freed (call under the store's lock): wake the writer
        and anyone waiting."""
        self.progress += 1
        self._cond.notify_all()

    def kick(self) -> None:
        """Ask for a rebalance soon (non-blocking, coalesced)."""
        self._kick.set()

    # the writer
    def _write_loop(self) -> None:
        """Keep up to PIPELINE batches in flight (the next one is planned and checksummed while the
        disk commits the last), finishing them in order."""
        inflight: collections.deque = collections.deque()
        failures, retry_at = 0, time.monotonic() + RETRY_STRANDED_S
        while True:
            with self._cond:
                batch = self._batch() if len(inflight) < PIPELINE else []
                while not batch and not inflight and not self._stopping:
                    if self.index.stranded and time.monotonic() >= retry_at:
                        retry_at = time.monotonic() + RETRY_STRANDED_S
                        self.retry(list(self.index.stranded.values()))
                    else:
                        self._cond.wait(WAIT_SLICE_S)
                    batch = self._batch()
                if self._stopping and not self._drain:
                    batch = []
                if not batch and not inflight:
                    return
            if batch:
                job = self._guarded(self.io.start_write, batch)
                if job is not None:
                    inflight.append(job)
                    continue
            if not inflight:
                continue
            done = self._guarded(self.io.finish_write, inflight.popleft()) or []
            with self._cond:
                self.written_pages += len(done)
                self.write_batches += 1
                self.progress += 1
                self._cond.notify_all()
            failures = 0 if done else failures + 1
            if failures and not inflight:   # the disk refused the batch: do not spin on it
                time.sleep(min(BACKOFF_S[0] * 2 ** (failures - 1), BACKOFF_S[1]))

    @staticmethod
    def _guarded(fn: Callable, arg: Any) -> Any:
        try:
            return fn(arg)
        except Exception:  # noqa: BLE001 - a bug must not stop write-behind; the pages stay queued
            log.exception("write-behind batch failed")
            return None

    def _batch(self) -> list[PageEntry]:
        """The oldest queued pages not being written, up to WRITE_BATCH_BYTES (under the lock)."""
        if self.core.cold is None:
            return []
        out, limit = [], max(1, WRITE_BATCH_BYTES // self.core.spec.page_bytes)
        for e in self.index.dirty.values():
            if not e.writing:
                out.append(e)
                if len(out) >= limit:
                    break
        if out and self.config.write_policy == "write_through":
            self._stage_in_warm(out)
        return out

    def _stage_in_warm(self, entries: list[PageEntry]) -> None:
        """write_through: copy hot pages to warm ahead of eviction (not counted as bytes moved)."""
        mover, warm = self.core.mover, self.core.warm
        to_warm = [e for e in entries if e.warm is None and e.hot is not None]
        if to_warm and mover.make_room("warm", len(to_warm), {e.key for e in entries}):
            mover.copy(to_warm, "hot", "warm", warm.alloc(len(to_warm)), counted=False)

    # watermarks
    def _maintain_loop(self) -> None:
        interval = self.config.daemon.interval_s
        while not self._stopping:
            self._kick.wait(interval)
            self._kick.clear()
            if self._stopping:
                return
            try:
                self._rebalance()
            except Exception:  # noqa: BLE001 - the next round retries
                self.maintenance_errors += 1
                if self.maintenance_errors == 1 or self.maintenance_errors % 100 == 0:
                    log.exception("background rebalance failed (%d times)", self.maintenance_errors)

    # observability
    def stats(self) -> dict:
        """The write-behind queue and backpressure now (call under the store's lock)."""
        dirty = self.index.dirty
        oldest = next(iter(dirty.values()), None)
        writing = sum(1 for e in dirty.values() if e.writing)
        return {"dirty_pages": len(dirty), "dirty_bytes": len(dirty) * self.core.spec.page_bytes,
                "max_dirty_pages": self.max_dirty_pages if self.core.cold is not None else 0,
                "queued_pages": len(dirty) - writing, "writing_pages": writing,
                "lag_s": round(time.monotonic() - oldest.dirty_since, 3) if oldest is not None else 0.0,
                "written_pages": self.written_pages, "write_batches": self.write_batches,
                "stranded_pages": len(self.index.stranded),
                "backpressure_waits": self.waits, "backpressure_wait_s": round(self.wait_s, 3),
                "refused_pages": self.refused_pages}
