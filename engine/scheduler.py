"""Scheduler: continuous batching with chunked prefill, admission by hot-tier page budget.

Each step: running decodes first (one token each, up to decode_concurrency), then prefill
chunks of running requests, then new requests admitted while the token budget
(max_batch_tokens), prefill_concurrency, the hot-tier page budget and the tenant's quota allow.
A request is admitted with its cached prefix acquired (promoted from warm/cold if needed), so
only the uncached suffix is computed. A request alone that outgrows the hot tier spills its
oldest committed pages to warm (leased there; the torch backend reads them from warm) instead
of failing. When a running request cannot get a page, the
lowest-priority, latest request is preempted: its full pages are committed, its hold released
(the pages stay cached and are demoted as needed), and it is requeued at the front, to resume
from its cached pages instead of from scratch. Under `preemptive`, a waiting request may also
preempt running ones of lower priority to be admitted.
"""

from __future__ import annotations

from kvstore.config import Config
from kvstore.errors import OutOfCapacity
from kvstore.keys import page_keys
from kvstore.store import TieredStore

from engine.request import QueueFull, Request, Status


class Scheduler:
    def __init__(self, store: TieredStore, config: Config):
        self.store = store
        self.engine_cfg, self.cfg = config.engine, config.scheduler
        self.page_size = store.spec.page_size
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.preemptions = 0
        self.stalled: list[Request] = []   # running requests that cannot get another page
        self.can_spill = False             # set by the engine when its attention backend reads warm pages
        self.spilled_pages = 0

    def add(self, req: Request) -> None:
        if len(self.waiting) >= self.cfg.max_queue_depth:
            raise QueueFull(len(self.waiting))
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _order(self, req: Request) -> tuple:
        return (-req.priority, req.arrival) if self.cfg.policy != "fcfs" else (req.arrival,)

    def _quota(self, tenant: str) -> int:
        return self.cfg.tenant_quotas.get(tenant, self.cfg.tenant_quota_pages)

    def _pages_needed(self, req: Request, n: int) -> int:
        return -(-(req.num_computed + n) // self.page_size) - len(req.spilled) - len(req.slots)

    def _chunk(self, req: Request, budget: int) -> int:
        """Tokens of req to compute next: bounded by the budget, the chunk size and half the hot tier."""
        half = max(1, self.store.hot.num_pages // 2) * self.page_size - req.num_computed % self.page_size
        return min(req.pending, budget, self.engine_cfg.prefill_chunk_tokens, half)

    def _grow(self, req: Request, n: int) -> bool:
        """Give req the pages for its next n tokens, preempting others (or spilling) if needed."""
        need = self._pages_needed(req, n)
        while need > 0:
            try:
                req.slots += self.store.allocate(need)
                return True
            except OutOfCapacity:
                victims = [r for r in self.running if r is not req]
                if victims:
                    self.preempt(max(victims, key=self._order))
                elif not self._spill(req, need):
                    return False
        return True

    def _spill(self, req: Request, n: int) -> int:
        """Move req's n oldest committed hot pages to warm leases; returns how many moved."""
        first = len(req.spilled)
        n = min(n, req.committed - first) if self.can_spill else 0
        if n <= 0:
            return 0
        keys = page_keys(req.namespace, req.tokens[:(first + n) * self.page_size], self.page_size)[first:]
        leased = self.store.lease_warm(keys)
        self.store.release(req.slots[:len(leased)])
        req.spilled += leased
        req.slots = req.slots[len(leased):]
        self.spilled_pages += len(leased)
        return len(leased)

    def _release(self, req: Request) -> None:
        self.store.release(req.slots)
        self.store.release_warm(req.spilled)
        req.slots, req.spilled = [], []

    def preempt(self, req: Request) -> None:
        self.commit(req)
        self._release(req)
        req.num_computed, req.committed = 0, 0
        req.status = Status.WAITING
        req.preemptions += 1
        self.preemptions += 1
        self.running.remove(req)
        self.waiting.append(req)  # sorted by arrival: ahead of everything that came later

    def commit(self, req: Request) -> None:
        full, first = req.num_computed // self.page_size, len(req.spilled)
        if full > req.committed:
            self.store.commit(req.namespace, req.tokens[:full * self.page_size],
                              req.slots[req.committed - first:full - first], start_page=req.committed)
            req.committed = full

    def finish(self, req: Request) -> None:
        self.commit(req)
        self._release(req)
        req.status = Status.FINISHED
        self.running.remove(req)

    def _admit(self, req: Request, budget: int) -> int:
        """Admit req if its pages fit; returns the tokens it will compute this step (0: not admitted)."""
        tokens = req.tokens
        m = self.store.match(tokens[:len(tokens) - 1], req.namespace)  # always compute the last token
        pages_total = -(-len(tokens) // self.page_size)
        need_hot = pages_total - m.tiers.count("hot")
        reserve = int((1 - self.store.config.hot.high_watermark) * self.store.hot.num_pages)
        if need_hot > self.store.hot_budget() - reserve and self.running:
            return 0
        quota = self._quota(req.tenant)
        held = sum(len(r.slots) for r in self.running if r.tenant == req.tenant)
        if quota and held + pages_total > quota and any(r.tenant == req.tenant for r in self.running):
            return 0
        try:
            self._acquire_prefix(req, m.keys)
        except OutOfCapacity:
            return 0
        held = len(req.spilled) + len(req.slots)
        req.num_computed = req.committed = held * self.page_size
        req.committed = held
        if not req.admitted:
            for i, tier in enumerate(m.tiers[:held]):
                req.cached_tokens["peer" if i in req.peer_pages else tier] += self.page_size
            req.admitted = True
        n = self._chunk(req, budget)
        if not self._grow(req, n):
            self._release(req)
            req.num_computed = req.committed = 0
            return 0
        req.status = Status.RUNNING
        self.running.append(req)
        return n

    def _acquire_prefix(self, req: Request, keys: list[bytes]) -> None:
        """Hold req's cached prefix in hot; if it cannot fit and req would run alone, lease its
        oldest pages in warm instead."""
        try:
            req.slots = self.store.acquire(keys)
            return
        except OutOfCapacity:
            if not self.can_spill or self.running:
                raise
        room = max(self.store.hot_budget() - max(1, self.store.hot.num_pages // 2), 0)
        split = max(len(keys) - room, 0)
        req.spilled = self.store.lease_warm(keys[:split])
        req.slots = self.store.acquire(keys[split:]) if len(req.spilled) == split else []

    def schedule(self) -> list[tuple[Request, int]]:
        """This step's work: (request, tokens to compute)."""
        budget = self.engine_cfg.max_batch_tokens
        batch: list[tuple[Request, int]] = []
        for req in sorted(self.running, key=self._order):
            if req not in self.running or req.pending != 1:
                continue
            if len(batch) >= self.engine_cfg.decode_concurrency or budget < 1:
                break
            if self._grow(req, 1):
                batch.append((req, 1))
                budget -= 1
            else:
                self.stalled.append(req)  # alone and still no page: the hot tier is too small for it
        batch = [(r, n) for r, n in batch if r in self.running]  # drop the preempted
        prefilling = 0
        for req in sorted(self.running, key=self._order):
            if req.pending <= 1 or budget < 1 or prefilling >= self.engine_cfg.prefill_concurrency:
                continue
            n = self._chunk(req, budget)
            if self._grow(req, n):
                batch.append((req, n))
                budget -= n
                prefilling += 1
        batch = [(r, n) for r, n in batch if r in self.running]
        self.waiting.sort(key=self._order)
        while self.waiting and budget > 0 and prefilling < self.engine_cfg.prefill_concurrency:
            req = self.waiting[0]
            n = self._admit(req, budget)
            if not n and self.cfg.policy == "preemptive":
                lower = [r for r in self.running if r.priority < req.priority]
                if lower:
                    self.preempt(max(lower, key=self._order))
                    batch = [(r, k) for r, k in batch if r in self.running]
                    continue
            if not n:
                break
            self.waiting.pop(0)
            batch.append((req, n))
            budget -= n
            prefilling += 1
        return [(r, n) for r, n in batch if r in self.running]
