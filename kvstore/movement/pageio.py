"""PageIO: the store's disk work, run on the Daemon's threads (daemon.py), never under the store's lock.

- loads: `load_chain(ticket)` brings the cold pages of a prefix chain up to warm; the pages it
  brought (and those of the chain already in warm) are leased for the ticket's holder until
  `end_load`, so they stay until the holder takes them into hot. A page that fails verification
  is a counted miss: the chain stops there and the holder recomputes from it.
- write-behind: `start_write(entries)` queues a write of pages (from warm, else hot) to cold, and
  `finish_write(job)` waits for it and marks them cold-resident once the commit is durable;
  `drop_cold` deletes records.
- a full cold tier: a write refused for lack of room (ColdFull: the disk or LMDB's map filled
  up before cold.max_bytes) evicts cold's own victims (its eviction policy's order, leaves
  first) and retries, a few times with more room each. Pages that still do not fit, and pages
  whose writes failed MAX_WRITE_FAILURES times, are stranded (index.strand): no lower tier can
  take them, so they may be dropped from memory, counted by reason. Failures are counted
  (`write_errors`), logged with a growing interval (the first at once, then at most one line
  per interval with the count since), and shown by `cold_state()` (the admin API's /readyz and
  /v1/stats).

Every method brackets its I/O with short critical sections (PageMover's plan/finish halves):
the engine thread, which only ever takes the lock for memory work, never waits for a disk.
Every method here blocks: for the Daemon's threads and worker threads, never for the engine.
It is given the store's core (kvstore.store.core: the lock, the index, the mover, the tiers)
and `released`, called under the lock when a load's leases go back (room for waiting producers).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Sequence

from kvstore.errors import KVStoreError
from kvstore.logbackoff import LogBackoff
from kvstore.movement.mover import WritePlan
from kvstore.placement.index import PageEntry
from kvstore.store.core import StoreCore
from kvstore.tiers.disk import ColdFull

log = logging.getLogger("kvstore.pageio")

LOAD_BATCH_BYTES = 16 << 20   # pages read per read transaction (and per trip through the lock)
FULL_RETRIES = 3              # evict-and-retry rounds for a write that found the cold tier full
MAX_WRITE_FAILURES = 3        # failed writes of a page (disk errors) before it is stranded
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


@dataclass
class WriteJob:
    """A write to cold in flight: its plan, and put_many's future (or the error that refused it at once)."""

    plan: WritePlan
    future: Future | None = None
    error: BaseException | None = None


class PageIO:
    def __init__(self, core: StoreCore, released: Callable[[], None]):
        self.core, self.released = core, released
        self.write_errors = 0           # write-behind batches that failed (pages stayed in memory)
        self.last_write_error = ""
        self.cold_full = False          # the last write failed for lack of room, even after evicting
        self.evicted_for_room = 0       # cold records evicted because the disk or map was full
        self._failing = 0               # failures since the last success
        self._log = LogBackoff(*LOG_INTERVAL_S)
        self._said_disk_bound = False

    # loads
    def load(self, ticket: LoadTicket, wait_room: Callable[[], bool]) -> None:
        """Bring the ticket's chain up (a read thread); `wait_room()` waits, bounded, for write-behind
        to make warm room when there is none, and says whether it did. Resolves the ticket."""
        try:
            self._load_chain(ticket, wait_room)
        except BaseException as exc:  # noqa: BLE001 - a failed load is a miss; the holder recomputes
            log.warning("load of %d pages failed: %s", len(ticket.keys), exc)
        finally:
            with self.core.lock:
                if ticket.ended:
                    self._return_leases(ticket)
            ticket.future.set_result(ticket.ready)

    def _load_chain(self, ticket: LoadTicket, wait_room: Callable[[], bool]) -> None:
        core, mover = self.core, self.core.mover
        per_batch = max(1, LOAD_BATCH_BYTES // core.spec.page_bytes)
        while ticket.ready < len(ticket.keys) and not ticket.ended:
            with core.lock:
                entries = self._chain(ticket, per_batch)
                if not entries:
                    return
                plan = mover.plan_read(entries)
            ok = self._read(plan) if plan.entries else []
            with core.lock:
                mover.finish_read(plan, ok)
                before = ticket.ready
                self._hold(ticket, entries)
            if not all(ok):
                ticket.failed += ok.count(False)
                return
            if ticket.ready == before and not wait_room():   # warm had no room, and write-behind freed none
                return

    def _chain(self, ticket: LoadTicket, n: int) -> list[PageEntry]:
        out = []
        for key in ticket.keys[ticket.ready:ticket.ready + n]:
            e = self.core.index.get(key)
            if e is None:
                break
            out.append(e)
        return out

    def _hold(self, ticket: LoadTicket, entries: list[PageEntry]) -> None:
        """Lease the leading pages of `entries` that are now in memory for the ticket."""
        for e in entries:
            if e.key not in self.core.index or not e.in_memory(self.core.mover.memory):
                break
            if e.warm is not None:
                e.leases += 1
                ticket.leased.append(e.warm)
            ticket.ready += 1

    def _read(self, plan) -> list[bool]:
        try:
            return self.core.mover.read(plan)
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
            self.core.unlease(slots)
            self.released()

    # writes
    def start_write(self, entries: Sequence[PageEntry]) -> "WriteJob | None":
        """Plan and queue a write of entries to cold, without waiting for it (None: nothing to write).
        Makes room in cold first (leaves before parents). Pages that cold cannot take (full, and
        nothing more of it may be evicted) are stranded as cold_full. The pages are marked
        `writing` until finish_write, which the caller owes every job, in the order started."""
        core, mover = self.core, self.core.mover
        if mover.durable is None or not entries:
            return None
        with core.lock:
            plan = mover.plan_write(list(entries))
            if not plan.entries:
                return None
            keys, fits = mover.cold_victims(plan.nbytes, {e.key for e in plan.entries})
            if core.cold.disk_bound:
                self._disk_bound(len(keys))
            left: list[PageEntry] = []
            while not fits and plan.entries:   # keep the chain's head: drop from the tail
                half = len(plan.entries) // 2
                left += plan.entries[half:]
                plan.entries, plan.items, plan.sources = plan.entries[:half], plan.items[:half], plan.sources[:half]
                plan.nbytes = sum(mover.record_bytes(e) for e in plan.entries)
                more, fits = mover.cold_victims(plan.nbytes, {e.key for e in plan.entries})
                keys += more
            for e in left:
                e.writing = False
                mover.index.strand(e, "cold_full")
        if left:
            self._write_failed(ColdFull(f"cold tier is full and nothing more in it may be evicted (pinned pages, "
                                        f"parents of cold pages); {len(left)} pages not written"),
                               len(left), full=True)
        job = WriteJob(plan)
        try:
            self.drop_cold(keys)
            if plan.entries:
                job.future = mover.write(plan)
        except Exception as exc:  # noqa: BLE001 - refused at once (closed, full): finish_write reports it
            job.error = exc
        return job

    def finish_write(self, job: "WriteJob") -> list[PageEntry]:
        """Wait for a started write; mark its pages cold-resident once durable and return them. A page
        whose writes failed MAX_WRITE_FAILURES times (disk errors) is stranded as write_error; the
        others that failed stay dirty, queued."""
        mover = self.core.mover
        failure = "write_error"
        try:
            failure = self._settle(job) if job.plan.entries else None
        finally:
            with self.core.lock:
                done = mover.finish_write(job.plan, failure is None)
                if done and self.core.remote is not None:   # durable in cold: on to the remote tier, queued
                    self.core.remote.offer([(e.namespace, e.key) for e in done])   # before they are clean
                for e in job.plan.entries if failure else ():
                    e.write_failures += 1
                    if e.key in mover.index and (failure == "cold_full" or e.write_failures >= MAX_WRITE_FAILURES):
                        mover.index.strand(e, failure)
        return done

    def _settle(self, job: "WriteJob") -> str | None:
        """Wait for the job's put_many; when cold is full, evict cold victims and put again. None once
        durable, else why not (cold_full, write_error): the pages stay in memory."""
        core, plan = self.core, job.plan
        for attempt in range(FULL_RETRIES + 1):
            try:
                if job.error is not None:
                    raise job.error
                job.future.result()
            except ColdFull as exc:
                if attempt < FULL_RETRIES and self._make_room(plan, (attempt + 1) * plan.nbytes):
                    job.error, job.future = None, None
                    try:
                        job.future = core.mover.write(plan)
                    except Exception as again:  # noqa: BLE001 - refused at once again: the next round says
                        job.error = again
                    continue
                self._write_failed(exc, len(plan.entries), full=True)
                return "cold_full"
            except Exception as exc:  # noqa: BLE001 - a disk error, a closed tier: the pages stay in memory
                self._write_failed(exc, len(plan.entries), full=False)
                return "write_error"
            if self._failing:
                log.info("cold tier writes succeed again after %d failed write-behind batches", self._failing)
            self._failing, self.cold_full = 0, False
            self._log.reset()
            return None
        return "cold_full"

    def _disk_bound(self, evicted: int) -> None:
        """Cold evicts for its disk, not for cold.max_bytes: counted, and said once."""
        self.evicted_for_room += evicted
        if evicted and not self._said_disk_bound:
            self._said_disk_bound = True
            cold = self.core.cold
            log.warning("cold tier at %s: its disk (free space, cold.map_size_max) holds less than cold.max_bytes "
                        "= %d; it evicts at the disk's limit (%d bytes used)", cold.path, cold.max_bytes,
                        cold.used_bytes)

    def _make_room(self, plan, nbytes: int) -> bool:
        """Evict cold records of about `nbytes` (the cold policy's victims); False when none can go."""
        with self.core.lock:
            keys = self.core.mover.cold_room(nbytes, {e.key for e in plan.entries})
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
        count = self._log.due()
        if count:
            since = f" ({count} failed batches since the last report)" if count > 1 else ""
            log.warning("write-behind to cold failed%s: %s; %d pages stay in memory%s", " (full)" if full else "",
                        self.last_write_error, pages, since)

    def cold_state(self) -> dict:
        """The cold tier's write health: failed batches, the last error, whether it is full."""
        return {"write_errors": self.write_errors, "last_error": self.last_write_error, "full": self.cold_full,
                "evicted_for_room": self.evicted_for_room}

    def drop_cold(self, keys: Sequence[bytes]) -> None:
        """Delete cold records (already unindexed), blocking until durable."""
        if keys and self.core.cold is not None:
            failed = False
            try:
                self.core.cold.evict(keys).result()
            except KVStoreError as exc:
                failed = True
                log.warning("deleting %d cold records failed: %s", len(keys), exc)
            with self.core.lock:
                self.core.mover.deleting.difference_update(keys)
                if failed:   # still stored, no longer indexed: deleted first next time cold needs room
                    self.core.mover.unindexed.update(keys)
