"""Scheduler: continuous batching with chunked prefill, admission by hot-tier page budget.

A request moves WAITING -> (LOADING ->) RUNNING -> FINISHED; preemption sends it back to WAITING.
Each step:
1. requests whose load is done (or, under prefetch.policy `timeout`, took too long) go back to
   waiting;
2. running decodes (one token each, up to decode_concurrency), then prefill chunks of running
   requests;
3. waiting requests, in order, while the token budget, prefill_concurrency, the hot budget and
   the tenant's quota allow. A request whose cached prefix is partly in cold starts a load (the
   store's I/O threads bring it to warm) and waits in LOADING under `wait` and `timeout`, while
   the running requests keep stepping; under `best_effort` it runs at once and recomputes what
   is not in memory. Only the uncached suffix is computed.

Rules: a step's batch holds a request at most once; a request preempted in a step is not
scheduled again in that step; a request finishes once. When a running request cannot get a
page, the lowest-priority, latest running request (possibly itself) is preempted: its full
pages are committed, its handle released (the pages stay cached) and it is requeued, to resume
from its cached pages. A request alone that outgrows the hot tier spills its oldest committed
pages to warm (torch backend) instead of failing. Under `preemptive`, a waiting request may
preempt running ones of lower priority.

The scheduler deals in token budgets and cache handles (kvstore.store.handle.CacheHandle): it never
reads a tier's internals or computes a page key.
"""

from __future__ import annotations

import time

from engine.config import Config
from kvstore.errors import OutOfCapacity
from kvstore.store.tiered import Match, TieredStore

from engine.request import QueueFull, Request, Status

LOADING = -1   # _admit's answer for a request that now waits for its load
STUCK_LIMIT_S = 5.0   # a request alone that gets no page for this long has outgrown the tiers


class Scheduler:
    def __init__(self, store: TieredStore, config: Config):
        self.store = store
        self.engine_cfg, self.cfg, self.prefetch = config.engine, config.scheduler, config.prefetch
        self.page_size = store.spec.page_size
        self.waiting: list[Request] = []
        self.loading: list[Request] = []
        self.running: list[Request] = []
        self.stalled: list[Request] = []   # running requests that cannot get another page
        self.can_spill = False             # set by the engine when its attention backend reads warm pages
        self.warm_in_place = False         # ... and reads them as fast as hot ones: warm prefixes stay in warm
        self.preemptions = 0
        self.spilled_pages = 0
        self.step_no = 0
        self._batch: dict[Request, int] = {}
        self._budget = 0
        self.current: Request | None = None   # the request being scheduled (the culprit if scheduling fails)

    def add(self, req: Request) -> None:
        if len(self.waiting) + len(self.loading) >= self.cfg.max_queue_depth:
            raise QueueFull(len(self.waiting) + len(self.loading))
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.loading or self.running)

    def _order(self, req: Request) -> tuple:
        return (-req.priority, req.arrival) if self.cfg.policy != "fcfs" else (req.arrival,)

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _chunk(self, req: Request, budget: int) -> int:
        """Tokens of req to compute next: bounded by the budget, the chunk size and half the hot tier."""
        half = max(1, self.store.hot_pages // 2) * self.page_size - req.num_computed % self.page_size
        return min(req.pending, budget, self.engine_cfg.prefill_chunk_tokens, half)

    # the step
    def schedule(self) -> list[tuple[Request, int]]:
        """This step's work: (request, tokens to compute), each request at most once."""
        self.step_no += 1
        self._batch, self._budget = {}, self.engine_cfg.max_batch_tokens
        self.current = None
        self._poll_loads()
        for req in sorted(self.running, key=self._order):
            if req.status is not Status.RUNNING or req.pending != 1:
                continue
            if len(self._batch) >= self.engine_cfg.decode_concurrency or self._budget < 1:
                break
            self.current = req
            if self._grow(req, 1):
                self._add(req, 1)
            elif req.status is Status.RUNNING and self.stuck(req):
                self.stalled.append(req)  # alone and still no page: the hot tier is too small for it
        prefilling = 0
        for req in sorted(self.running, key=self._order):
            if (req.status is not Status.RUNNING or req.pending <= 1 or req in self._batch or self._budget < 1
                    or prefilling >= self.engine_cfg.prefill_concurrency):
                continue
            n = self._chunk(req, self._budget)
            self.current = req
            if self._grow(req, n):
                self._add(req, n)
                prefilling += 1
            elif req.status is Status.RUNNING and self.stuck(req):
                self.stalled.append(req)
        self.waiting.sort(key=self._order)
        while self.waiting and self._budget > 0 and prefilling < self.engine_cfg.prefill_concurrency:
            req = self.waiting[0]
            if req.preempted_step == self.step_no:
                break   # it keeps its place; nothing behind it jumps the queue this step
            self.current = req
            n = self._admit(req, self._budget)
            if n == LOADING:
                self.waiting.pop(0)
                continue
            if not n and self.cfg.policy == "preemptive":
                lower = [r for r in self.running if r.priority < req.priority]
                if lower:
                    self.preempt(max(lower, key=self._order))
                    continue
            if not n:
                break
            self.waiting.pop(0)
            self._add(req, n)
            prefilling += 1
        self.current = None
        return list(self._batch.items())

    def _add(self, req: Request, n: int) -> None:
        self._batch[req] = n
        self._budget -= n
        req.stuck_since = None

    def stuck(self, req: Request) -> bool:
        """req runs alone (or would) and gets no page. Relieve the pressure: the loads of other
        requests give their warm pages back and the background writes dirty pages behind
        so that they can be freed. True once it has been stuck for STUCK_LIMIT_S, while no page waits
        for write-behind."""
        now = time.monotonic()
        if req.stuck_since is None or self.store.writes_pending():   # not stuck while the writer frees room
            req.stuck_since = now
        for r in self.waiting + self.loading:
            if r is not req and r.handle is not None and r.handle.ticket is not None:
                r.handle.end_load()   # they compute what did not come up
        self.store.daemon.kick()
        return now - req.stuck_since > STUCK_LIMIT_S

    def _poll_loads(self) -> None:
        now = time.monotonic()
        for req in list(self.loading):
            if not req.handle.loading or now >= req.load_deadline:
                self.loading.remove(req)
                req.status = Status.WAITING
                self.waiting.append(req)

    def wait_for_loads(self, timeout: float) -> None:
        """Block up to `timeout` for a load to finish (only when there is nothing else to run)."""
        for req in self.loading:
            if req.handle.ticket is not None:
                try:
                    req.handle.ticket.wait(timeout)
                except TimeoutError:
                    pass
                return

    # pages
    def _grow(self, req: Request, n: int, admitting: bool = False) -> bool:
        """Give req the pages for its next n tokens. Under pressure a running req preempts the latest
        running request (itself if it is the latest: then False); a request being admitted preempts
        nobody; a request alone spills its head to warm."""
        pages = self._pages(req.num_computed + n)
        while True:
            try:
                req.handle.grow(pages)
                return True
            except OutOfCapacity as exc:
                if exc.pending:   # write-behind frees the room soon: wait, preempting nobody
                    return False
                others = any(r is not req for r in self.running)
                if others and not admitting:
                    victim = max(self.running, key=self._order)
                    self.preempt(victim)
                    if victim is req:
                        return False
                elif others or not self._spill(req, pages - req.handle.num_pages):
                    return False

    def _spill(self, req: Request, n: int) -> int:
        moved = req.handle.spill(n) if self.can_spill else 0
        self.spilled_pages += moved
        return moved

    def commit(self, req: Request) -> None:
        """Give keys to req's pages that filled up (called after each step it ran in)."""
        req.handle.commit(req.tokens, req.num_computed // self.page_size)

    def preempt(self, req: Request) -> None:
        self.commit(req)
        req.handle.release()
        req.num_computed = 0
        req.status = Status.WAITING
        req.preemptions += 1
        req.preempted_step = self.step_no
        req.load_tried = False
        self.preemptions += 1
        self.running.remove(req)
        if req in self._batch:
            self._budget += self._batch.pop(req)
        self.waiting.append(req)

    def finish(self, req: Request) -> None:
        """Release req's pages (committing the full ones) and take it out of every queue; once."""
        if req.status is Status.FINISHED:
            raise RuntimeError(f"request {req.id} finished twice")
        if req.handle is not None:
            if req.status is Status.RUNNING:
                self.commit(req)
            req.handle.release()
        for queue in (self.running, self.waiting, self.loading):
            if req in queue:
                queue.remove(req)
        req.status = Status.FINISHED

    # admission
    def _admit(self, req: Request, budget: int) -> int:
        """Admit req if its pages fit; returns the tokens it computes this step (0: not admitted,
        LOADING: it now waits for its cached prefix to come up from cold)."""
        if req.handle is None:
            req.handle = self.store.handle(req.namespace)
        h = req.handle
        m = h.match(req.tokens[:len(req.tokens) - 1])  # always compute the last token
        if not req.load_tried and not h.loading:
            req.load_tried = True
            if h.load(m) and self.prefetch.policy == "best_effort":
                h.end_load()   # the load warms the cache for later; this request holds none of it
            elif h.ticket is not None:
                req.status = Status.LOADING
                req.load_deadline = (time.monotonic() + self.prefetch.timeout_s if self.prefetch.policy == "timeout"
                                     else float("inf"))
                self.loading.append(req)
                return LOADING
        lead = m.tiers.index("cold") if "cold" in m.tiers else len(m.tiers)
        need_hot = self._pages(len(req.tokens)) - m.tiers[:lead].count("hot")
        if need_hot > self.store.admission_budget() and self.running:
            return 0
        quota = self.cfg.tenant_quotas.get(req.tenant, self.cfg.tenant_quota_pages)
        mine = [r for r in self.running if r.tenant == req.tenant]
        if quota and mine and sum(r.handle.num_pages for r in mine) + self._pages(len(req.tokens)) > quota:
            return 0
        if not self._attach(req, m):
            return 0
        req.num_computed = h.num_tokens
        if not req.admitted:
            for i, tier in enumerate(h.served[:h.num_pages]):
                source = next((s for s, pages in req.fetched_pages.items() if i in pages), tier)
                req.cached_tokens[source] += self.page_size
            req.admitted = True
        n = self._chunk(req, budget)
        if not self._grow(req, n, admitting=True):
            h.release()
            req.num_computed = 0
            return 0
        req.status = Status.RUNNING
        self.running.append(req)
        return n

    def _attach(self, req: Request, m) -> bool:
        """Hold req's cached prefix. A request that would run alone and cannot fit lets go of its
        load's warm pages (they stay cached), then leases its oldest pages in warm (spill), and
        failing that holds nothing and recomputes its prefix: alone, it always starts."""
        try:
            req.handle.attach(m, spill_room=self._warm_room(m))
            return True
        except OutOfCapacity as exc:
            if self.running or exc.pending:
                return False
        req.handle.end_load()
        if self.can_spill:
            room = max(self.store.hot_budget() - max(1, self.store.hot_pages // 2), 0)
            try:
                req.handle.attach(m, spill_room=room)
                return True
            except OutOfCapacity:
                pass
        req.handle.attach(Match(m.namespace, m.page_size))
        return True

    def _warm_room(self, m) -> int | None:
        """With warm_in_place: attach's spill_room that leaves the match's leading pages in warm (leased
        and attended there, not copied to hot), while the running requests' leases stay within half
        of warm; None (everything to hot) otherwise."""
        if not self.warm_in_place:
            return None
        lead = next((i for i, t in enumerate(m.tiers) if t != "warm"), len(m.tiers))
        leased = sum(len(r.handle.spilled) for r in self.running)
        if not lead or leased + lead > self.store.warm.num_slots // 2:
            return None
        return len(m.keys) - lead

    # checks (debug mode and tests)
    def check(self) -> list[str]:
        """Invariants: each request in one queue with a matching state, page references balanced."""
        problems = []
        seen: dict[int, str] = {}
        for name, queue, status in (("waiting", self.waiting, Status.WAITING), ("loading", self.loading, Status.LOADING),
                                    ("running", self.running, Status.RUNNING)):
            for r in queue:
                if id(r) in seen:
                    problems.append(f"{r.id} is in {seen[id(r)]} and {name}")
                seen[id(r)] = name
                if r.status is not status:
                    problems.append(f"{r.id} is in {name} with status {r.status.value}")
        for r in self.waiting + self.loading:
            if r.handle is not None and r.handle.num_pages:
                problems.append(f"{r.id} holds {r.handle.num_pages} pages while {r.status.value}")
        audit = self.store.audit(cold=False)
        problems += audit["problems"]
        held = sum(len(r.handle.slots) for r in self.running)
        if audit["total_refcount"] + audit["allocated_slots"] != held:
            problems.append(f"hot references {audit['total_refcount']} + allocated {audit['allocated_slots']} "
                            f"!= slots held by running requests {held}")
        return problems
