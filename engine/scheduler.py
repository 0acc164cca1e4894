"""Scheduler: continuous batching with chunked prefill over the request queues, which it alone owns.

A request moves WAITING -> (LOADING ->) RUNNING -> FINISHED; preemption sends it back to WAITING.
Each step: loads that are done (or, under prefetch.policy `timeout`, too slow) go back to waiting;
running requests decode (one token each, up to decode_concurrency), then compute prefill chunks;
waiting ones are admitted in order (engine.admission) while the token budget and the step's
prefills (admission.StepPrefills) allow. A batch holds a request once; one preempted in a step is not scheduled again in it.

A running request that cannot get a page preempts the lowest-priority, latest running request (possibly
itself): its full pages are committed and released (they stay cached) and it is requeued, to resume from
them. Under `preemptive`, a waiting request may preempt running ones of lower priority. A request alone
that gets no page for `stuck_limit_s`, step after step, with no write-behind pending, has outgrown the
tiers: running, it ends with what it has (finish_reason "length"); waiting, it is aborted.
"""

from __future__ import annotations

import collections
import contextlib
import time

from engine.admission import LOADING, Admission
from engine.config import Config
from engine.request import QueueFull, Request, Status
from kvstore.errors import OutOfCapacity
from kvstore.store.tiered import TieredStore

STUCK_LIMIT_S = 5.0              # a request alone that gets no page for this long has outgrown the tiers
IDLE_WAIT_S, IDLE_SLEEP_S = 0.005, 0.002   # nothing to compute: how long to wait for a load, or else sleep


class Scheduler:
    def __init__(self, store: TieredStore, config: Config, can_spill: bool = False, warm_in_place: bool = False):
        self.store = store
        self.engine_cfg, self.cfg = config.engine, config.scheduler
        self.admission = Admission(store, config, can_spill, warm_in_place)
        self.inbox: collections.deque[Request] = collections.deque()   # added from any thread
        self._queues: dict[Status, list[Request]] = {s: [] for s in (Status.WAITING, Status.LOADING, Status.RUNNING)}
        self.waiting, self.loading, self.running = self._queues.values()
        self.ended: list[Request] = []   # the requests the last schedule() ended (stuck alone)
        self.stuck_limit_s = STUCK_LIMIT_S
        self._stuck: tuple[set[Request], set[Request]] = (set(), set())   # found stuck: last step, this one
        self.preemptions = self.step_no = self._budget = 0
        self._batch: dict[Request, int] = {}
        self.current: Request | None = None   # the request being scheduled (the culprit if scheduling fails)

    # queues
    def add(self, req: Request, bounded: bool = True) -> None:
        """Queue a request (thread-safe); QueueFull past scheduler.max_queue_depth when bounded."""
        if bounded and self.depth >= self.cfg.max_queue_depth:
            raise QueueFull(self.depth)
        self.inbox.append(req)

    @property
    def depth(self) -> int:
        """Requests queued and not yet running."""
        return len(self.inbox) + len(self.waiting) + len(self.loading)

    def has_work(self) -> bool:
        return bool(self.depth or self.running)

    def counts(self) -> dict[str, int]:
        return dict(waiting=len(self.waiting) + len(self.inbox), loading=len(self.loading), running=len(self.running))

    def abort(self, ids: set[str]) -> list[Request]:
        """Finish the requests with these ids (finish_reason "abort"), wherever they are queued."""
        self._intake()
        done = [r for r in self.waiting + self.loading + self.running if r.id in ids]
        for req in done:
            self.finish(req, "abort")
        return done

    def finish(self, req: Request, reason: str) -> None:
        """Release req's pages (committing the full ones) and take it out of every queue; once."""
        if req.status is Status.FINISHED:
            raise RuntimeError(f"request {req.id} finished twice")
        if req.handle is not None:
            self.admission.release(req, commit=req.status is Status.RUNNING)
        self.drop(req, reason)

    def drop(self, req: Request, reason: str) -> None:
        """Take req out of every queue as finished, leaving its pages alone (they may be inconsistent)."""
        self._move(req, Status.FINISHED)
        req.finish_reason, req.finished_at = reason, time.monotonic()

    def culprits(self) -> list[Request]:
        """Whom a failed schedule() fails: the request it was scheduling, else every running one."""
        return [self.current] if self.current is not None else list(self.running)

    def _intake(self) -> None:
        while self.inbox:
            self.waiting.append(self.inbox.popleft())

    def _move(self, req: Request, status: Status) -> None:
        for queue in self._queues.values():
            if req in queue:
                queue.remove(req)
        req.status = status
        self._queues.get(status, []).append(req)

    def _order(self, req: Request) -> tuple:
        return (-req.priority, req.arrival) if self.cfg.policy != "fcfs" else (req.arrival,)

    # the step
    def schedule(self) -> list[tuple[Request, int]]:
        """This step's work: (request, tokens to compute), each request at most once."""
        self.step_no += 1
        self._batch, self._budget = {}, self.engine_cfg.max_batch_tokens
        self.current, self.ended = None, []
        self._stuck = (self._stuck[1], set())
        self._intake()
        for req in [r for r in self.loading if not r.handle.loading or time.monotonic() >= r.load_deadline]:
            self._move(req, Status.WAITING)
        ordered = sorted(self.running, key=self._order)   # decoding only takes requests out of running
        for req in ordered:
            if req.status is not Status.RUNNING or req.pending != 1:
                continue
            if len(self._batch) >= self.engine_cfg.decode_concurrency or self._budget < 1:
                break
            self._continue(req, 1)
        prefills = self.admission.step_prefills()   # a cap, and one long prompt at most on the CPU
        for req in ordered:
            if (req.status is not Status.RUNNING or req.pending <= 1 or req in self._batch or self._budget < 1
                    or prefills.full(req)):
                continue
            self._continue(req, self.admission.chunk(req, self._budget))
            prefills.add(req, req in self._batch)
        self.waiting.sort(key=self._order)
        while self.waiting and self._budget > 0 and not prefills.full(self.waiting[0]):
            req = self.current = self.waiting[0]
            if req.preempted_step == self.step_no:
                break   # it keeps its place; nothing behind it jumps the queue this step
            n = self.admission.admit(req, self._budget, self.running)
            if n == LOADING:
                self._move(req, Status.LOADING)
            elif n:
                self._move(req, Status.RUNNING)
                self._batch[req] = n
                self._budget -= n
                prefills.add(req)
            elif self.cfg.policy == "preemptive" and (lower := [r for r in self.running if r.priority < req.priority]):
                self.preempt(max(lower, key=self._order))
            else:
                break
        self.current = None
        return list(self._batch.items())

    def _continue(self, req: Request, n: int) -> None:
        """Batch n more tokens of running req if its pages can grow for them. Stuck alone past the
        limit, it ends with what it has: the tiers are too small for it."""
        self.current = req
        if self._grow(req, n):
            self._batch[req] = n
            self._budget -= n
        elif req.status is Status.RUNNING and self.stuck(req):
            self.finish(req, "length")
            self.ended.append(req)

    def idle(self) -> list[Request]:
        """Nothing to compute: wait a little for a load to land or for the background to free pages;
        abort the first waiting request if it cannot fit even alone (pinned pages, quota)."""
        if self.loading:
            ticket = next((r.handle.ticket for r in self.loading if r.handle.ticket is not None), None)
            with contextlib.suppress(TimeoutError):
                if ticket is not None:
                    ticket.wait(IDLE_WAIT_S)
        elif self.waiting and not self.running and self.stuck(self.waiting[0]):
            req = self.waiting[0]
            self.finish(req, "abort")
            return [req]
        elif self.has_work():
            time.sleep(IDLE_SLEEP_S)
        return []

    def stuck(self, req: Request) -> bool:
        """req runs alone (or would) and gets no page: relieve the pressure. True once it has been
        stuck for stuck_limit_s, in every step since."""
        now, (last, this) = time.monotonic(), self._stuck
        if not (req in last or req in this) or self.store.writes_pending():
            req.stuck_since = now   # a new spell (not stuck while the writer frees room)
        this.add(req)
        self.admission.relieve([r for r in self.waiting + self.loading if r is not req])
        return now - req.stuck_since > self.stuck_limit_s

    # pages
    def _grow(self, req: Request, n: int) -> bool:
        """Pages for running req's next n tokens: it preempts the latest running request (itself: False)."""
        while True:
            alone = not any(r is not req for r in self.running)
            try:
                self.admission.grow(req, n, alone)
                return True
            except OutOfCapacity as exc:
                if exc.pending or alone:   # write-behind frees the room soon: wait, preempting nobody
                    return False
                victim = max(self.running, key=self._order)
                self.preempt(victim)
                if victim is req:
                    return False

    def preempt(self, req: Request) -> None:
        self.admission.release(req, commit=True)
        self._move(req, Status.WAITING)
        req.preemptions, req.preempted_step = req.preemptions + 1, self.step_no
        self.preemptions += 1
        if req in self._batch:
            self._budget += self._batch.pop(req)

    # checks (debug mode and tests)
    def check(self) -> list[str]:
        """Invariants: each request in one queue with a matching state, page references balanced."""
        problems, seen = [], {}
        for status, queue in self._queues.items():
            for r in queue:
                if id(r) in seen:
                    problems.append(f"{r.id} is in {seen[id(r)]} and {status.value}")
                seen[id(r)] = status.value
                if r.status is not status:
                    problems.append(f"{r.id} is in {status.value} with status {r.status.value}")
        return problems + self.admission.check(self.running, self.waiting + self.loading)
