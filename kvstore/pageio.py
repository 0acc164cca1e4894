"""PageIO: the store's disk work, on its own threads, never under the store's lock.

- loads: `load(keys)` brings the cold pages of a prefix chain up to warm on the read threads
  and returns a LoadTicket at once; the pages it brought (and those of the chain already in
  warm) are leased for the ticket's holder until `end_load`, so they stay until the holder
  takes them into hot. A page that fails verification is a counted miss: the chain stops
  there and the holder recomputes from it.
- write-behind: `persist(entries)` writes pages (from warm, else hot) to cold and marks them
  cold-resident once the commit is durable; `drop_cold` deletes records. `kick()` asks the
  maintenance thread for a `TieredStore.rebalance` (coalesced), which demotes by watermarks
  and writes dirty warm pages behind.
- a full cold tier: a write refused for lack of room (ColdFull: the disk or LMDB's map filled
  up before cold.max_bytes) evicts cold's own victims (its eviction policy's order, leaves
  first) and retries, a few times with more room each; pages that still do not fit stay in
  memory, dirty. Failures are counted (`write_errors`), logged with a growing interval (the
  first at once, then at most one line per interval with the count since), and shown by
  `cold_state()` (the admin API's /readyz and /v1/stats).

Every method brackets its I/O with short critical sections (PageMover's plan/finish halves):
the engine thread, which only ever takes the lock for memory work, never waits for a disk.
Blocking methods (`persist`, `drop_cold`, `wait`) are for worker threads, never for the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Sequence

from kvstore.errors import KVStoreError
from kvstore.index import PageEntry
from kvstore.tiers.disk import ColdFull

if TYPE_CHECKING:
    from kvstore.store import TieredStore

log = logging.getLogger("kvstore.pageio")

LOAD_BATCH_BYTES = 16 << 20   # pages read per read transaction (and per trip through the lock)
FULL_RETRIES = 3              # evict-and-retry rounds for a write that found the cold tier full
LOG_INTERVAL_S = (5.0, 300.0)   # write failures: first and longest interval between log lines


class LoadTicket:
    """A load in flight. `done()` once every page it could bring is in warm; `ready` counts the
    chain's leading pages that are in memory and held for the holder (some may be ready early)."""

    def __init__(self, keys: Sequence[bytes]):
        self.keys = list(keys)
        self.future: Future = Future()
        self.leased: list[int] = []    # warm slots leased for the holder (under the store's lock)
        self.ready = 0
        self.failed = 0                 # pages that failed verification
        self.ended = False              # the holder let go; leases are returned when the load stops

    def done(self) -> bool:
        return self.future.done()

    def wait(self, timeout: float | None = None) -> int:
        """Block until done (worker threads and tests only); returns the pages ready."""
        self.future.result(timeout)
        return self.ready


class PageIO:
    def __init__(self, store: "TieredStore", read_threads: int = 2):
        self.store = store
        self._reads = ThreadPoolExecutor(max_workers=max(1, read_threads), thread_name_prefix="kvstore-read")
        self._maint = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-maint")
        self._kicked = False
        self._kick_lock = threading.Lock()
        self.write_errors = 0           # write-behind batches that failed (pages stayed in memory)
        self.last_write_error = ""
        self.cold_full = False          # the last write failed for lack of room, even after evicting
        self.evicted_for_room = 0       # cold records evicted because the disk or map was full
        self._failing = 0               # failures since the last success
        self._unlogged = 0              # failures since the last log line
        self._log_interval = LOG_INTERVAL_S[0]
        self._next_log = 0.0
        self._said_disk_bound = False
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self._maint.shutdown(wait=True)
        self._reads.shutdown(wait=True)

    # loads
    def load(self, keys: Sequence[bytes]) -> LoadTicket:
        """Start bringing the cold pages of this chain up to warm; returns at once."""
        ticket = LoadTicket(keys)
        if self.closed:
            ticket.future.set_result(0)
            return ticket
        self._reads.submit(self._load, ticket)
        return ticket

    def _load(self, ticket: LoadTicket) -> None:
        try:
            self._load_chain(ticket)
        except BaseException as exc:  # noqa: BLE001 - a failed load is a miss; the holder recomputes
            log.warning("load of %d pages failed: %s", len(ticket.keys), exc)
        finally:
            with self.store._lock:
                if ticket.ended:
                    self._return_leases(ticket)
            ticket.future.set_result(ticket.ready)

    def _load_chain(self, ticket: LoadTicket) -> None:
        store, mover = self.store, self.store.mover
        per_batch = max(1, LOAD_BATCH_BYTES // store.spec.page_bytes)
        retried = False
        while ticket.ready < len(ticket.keys) and not ticket.ended:
            with store._lock:
                entries = self._chain(ticket, per_batch)
                if not entries:
                    return
                plan = mover.plan_read(entries)
            ok = self._read(plan) if plan.entries else []
            with store._lock:
                mover.finish_read(plan, ok)
                before = ticket.ready
                self._hold(ticket, entries)
            if not all(ok):
                ticket.failed += ok.count(False)
                return
            if ticket.ready == before:   # warm had no room: write dirty pages behind to free some, once
                if retried or not store.clean_warm(len(entries)):
                    return
            retried = ticket.ready == before

    def _chain(self, ticket: LoadTicket, n: int) -> list[PageEntry]:
        out = []
        for key in ticket.keys[ticket.ready:ticket.ready + n]:
            e = self.store.index.get(key)
            if e is None:
                break
            out.append(e)
        return out

    def _hold(self, ticket: LoadTicket, entries: list[PageEntry]) -> None:
        """Lease the leading pages of `entries` that are now in memory for the ticket."""
        for e in entries:
            if e.key not in self.store.index or not e.in_memory(self.store.mover.memory):
                break
            if e.warm is not None:
                e.leases += 1
                ticket.leased.append(e.warm)
            ticket.ready += 1

    def _read(self, plan) -> list[bool]:
        try:
            return self.store.mover.read(plan)
        except Exception as exc:  # noqa: BLE001 - the tier closed or failed: nothing is served, the slots go back
            log.warning("cold read of %d pages failed: %s", len(plan.entries), exc)
            return [bool(ok) for ok in plan.ok]

    def end_load(self, ticket: LoadTicket) -> None:
        """The holder is done with the ticket (call under the store's lock): its leases are returned
        now, or by the load itself when it stops."""
        ticket.ended = True
        if ticket.done():
            self._return_leases(ticket)

    def _return_leases(self, ticket: LoadTicket) -> None:
        slots, ticket.leased = ticket.leased, []
        if slots:
            self.store.release_warm(slots)

    # writes
    def persist(self, entries: Sequence[PageEntry]) -> list[PageEntry]:
        """Write entries to cold (blocking, outside the lock); returns those now cold-resident.
        Makes room in cold first (leaves before parents); what still does not fit is skipped."""
        store, mover = self.store, self.store.mover
        if mover.durable is None or not entries:
            return []
        with store._lock:
            plan = mover.plan_write(list(entries))
            if not plan.entries:
                return []
            keys, fits = mover.cold_victims(plan.nbytes, {e.key for e in plan.entries})
            if store.cold.disk_bound:
                self._disk_bound(len(keys))
            planned = len(plan.entries)
            while not fits and plan.entries:   # keep the chain's head: drop from the tail
                for e in plan.entries[len(plan.entries) // 2:]:
                    e.writing = False
                    mover.index.changed(e)
                half = len(plan.entries) // 2
                plan.entries, plan.items, plan.sources = plan.entries[:half], plan.items[:half], plan.sources[:half]
                plan.nbytes = sum(mover.record_bytes(e) for e in plan.entries)
                more, fits = mover.cold_victims(plan.nbytes, {e.key for e in plan.entries})
                keys += more
        if len(plan.entries) < planned:
            self._write_failed(ColdFull(f"cold tier is full and nothing more in it may be evicted (pinned pages, "
                                        f"parents of cold pages); {planned - len(plan.entries)} pages not written"),
                               planned - len(plan.entries), full=True)
        ok = False
        try:
            self.drop_cold(keys)
            ok = self._write(plan) if plan.entries else False
        finally:
            with store._lock:
                done = mover.finish_write(plan, ok)
        return done

    def _write(self, plan) -> bool:
        """put_many the plan; when cold is full, evict cold victims and retry. False: the pages stay in memory."""
        store = self.store
        for attempt in range(FULL_RETRIES + 1):
            try:
                store.mover.write(plan).result()
            except ColdFull as exc:
                if attempt < FULL_RETRIES and self._make_room(plan, (attempt + 1) * plan.nbytes):
                    continue
                self._write_failed(exc, len(plan.entries), full=True)
                return False
            except Exception as exc:  # noqa: BLE001 - a disk error, a closed tier: the pages stay in memory
                self._write_failed(exc, len(plan.entries), full=False)
                return False
            if self._failing:
                log.info("cold tier writes succeed again after %d failed write-behind batches", self._failing)
            self._failing, self._unlogged, self.cold_full = 0, 0, False
            self._log_interval = LOG_INTERVAL_S[0]
            return True
        return False

    def _disk_bound(self, evicted: int) -> None:
        """Cold evicts for its disk, not for cold.max_bytes: counted, and said once."""
        self.evicted_for_room += evicted
        if evicted and not self._said_disk_bound:
            self._said_disk_bound = True
            cold = self.store.cold
            log.warning("cold tier at %s: its disk (free space, cold.map_size_max) holds less than cold.max_bytes "
                        "= %d; it evicts at the disk's limit (%d bytes used)", cold.path, cold.max_bytes,
                        cold.used_bytes)

    def _make_room(self, plan, nbytes: int) -> bool:
        """Evict cold records of about `nbytes` (the cold policy's victims); False when none can go."""
        with self.store._lock:
            keys = self.store.mover.cold_room(nbytes, {e.key for e in plan.entries})
        if not keys:
            return False
        self.evicted_for_room += len(keys)
        self.drop_cold(keys)
        return True

    def _write_failed(self, exc: BaseException, pages: int, full: bool) -> None:
        self.write_errors += 1
        self.last_write_error = " ".join(str(exc).split()) or type(exc).__name__
        self.cold_full = full
        self._failing += 1
        self._unlogged += 1
        now = time.monotonic()
        if now < self._next_log:
            return
        since = f" ({self._unlogged} failed batches since the last report)" if self._unlogged > 1 else ""
        log.warning("write-behind to cold failed%s: %s; %d pages stay in memory%s", " (full)" if full else "",
                    self.last_write_error, pages, since)
        self._unlogged = 0
        self._next_log = now + self._log_interval
        self._log_interval = min(2 * self._log_interval, LOG_INTERVAL_S[1])

    def cold_state(self) -> dict:
        """The cold tier's write health: failed batches, the last error, whether it is full."""
        return {"write_errors": self.write_errors, "last_error": self.last_write_error, "full": self.cold_full,
                "evicted_for_room": self.evicted_for_room}

    def drop_cold(self, keys: Sequence[bytes]) -> None:
        """Delete cold records (already unindexed), blocking until durable."""
        if keys and self.store.cold is not None:
            failed = False
            try:
                self.store.cold.evict(keys).result()
            except KVStoreError as exc:
                failed = True
                log.warning("deleting %d cold records failed: %s", len(keys), exc)
            with self.store._lock:
                self.store.mover.deleting.difference_update(keys)
                if failed:   # still stored, no longer indexed: deleted first next time cold needs room
                    self.store.mover.unindexed.update(keys)

    def drain(self) -> None:
        """Wait until the background work queued so far is done (tests, shutdown)."""
        self._maint.submit(lambda: None).result()
        self._reads.submit(lambda: None).result()

    # maintenance
    def kick(self) -> None:
        """Ask for a rebalance on the maintenance thread soon (non-blocking, coalesced)."""
        with self._kick_lock:
            if self._kicked or self.closed:
                return
            self._kicked = True
        try:
            self._maint.submit(self._maintain)
        except RuntimeError:   # shut down
            pass

    def _maintain(self) -> None:
        with self._kick_lock:
            self._kicked = False
        try:
            self.store.rebalance()
        except Exception:  # noqa: BLE001 - the next kick or daemon round retries
            log.exception("background rebalance failed")
