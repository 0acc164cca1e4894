"""Admission: whether a request's pages fit in the hot tier, and getting them for it.

A waiting request is admitted when the pages its uncached part needs fit the store's admission
budget (alone, it always is) and its tenant's quota: its cached prefix is attached (a prefix
partly in cold first starts a load, under prefetch.policy `wait` and `timeout`), then its pages
grow for the first chunk. A request alone that outgrows the hot tier spills its oldest committed
pages to warm (when the attention backend reads them there) instead of failing. With
warm_in_place a cached prefix in warm is leased and attended there, not copied to hot.

A step prefills at most engine.prefill_concurrency requests (StepPrefills), and on the CPU at most
one of a prompt of engine.prefill_alone_tokens or more: its attention over the long context is
most of the step's work and none of it is shared, so two such prefills in one step gain little and
each waits for both (three questions over one 8K-token document: each answered after 0.61 s
together; one after the other after 0.22, 0.46 and 0.70 s). Shorter prompts still join its steps;
on a GPU, where a step's prefills run side by side, the rule is off.

Admission deals in token budgets and cache handles (kvstore.store.handle.CacheHandle): it never
reads a tier's internals or computes a page key. It moves no request between queues: the
scheduler does, from its answers.
"""

from __future__ import annotations

import time
from typing import Sequence

from engine.config import Config
from engine.request import Request
from kvstore.errors import OutOfCapacity
from kvstore.store.tiered import Match, TieredStore

LOADING = -1   # admit's answer for a request that now waits for its load


class StepPrefills:
    """The prefills of one step so far: `full(req)` when req may not join them (the module's rules)."""

    def __init__(self, cap: int, alone_tokens: int):
        self.cap, self.alone_tokens = cap, alone_tokens
        self.count, self.has_long = 0, False

    def long(self, req: Request) -> bool:
        return bool(self.alone_tokens) and len(req.prompt) >= self.alone_tokens

    def full(self, req: Request) -> bool:
        return self.count >= self.cap or (self.has_long and self.long(req))

    def add(self, req: Request, added: bool = True) -> None:
        if added:
            self.count += 1
            self.has_long |= self.long(req)


class Admission:
    def __init__(self, store: TieredStore, config: Config, can_spill: bool = False, warm_in_place: bool = False):
        self.store = store
        self.engine_cfg, self.cfg, self.prefetch = config.engine, config.scheduler, config.prefetch
        self.page_size = store.spec.page_size
        self.can_spill = can_spill           # the attention backend reads warm pages
        self.warm_in_place = warm_in_place   # ... as fast as hot ones: warm prefixes stay in warm
        self.spilled_pages = 0
        self.alone_tokens = self.engine_cfg.prefill_alone_tokens if store.hot.device.type == "cpu" else 0

    def step_prefills(self) -> StepPrefills:
        """What bounds a new step's prefills."""
        return StepPrefills(self.engine_cfg.prefill_concurrency, self.alone_tokens)

    def pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def chunk(self, req: Request, budget: int) -> int:
        """Tokens of req to compute next: bounded by the budget, the chunk size and half the hot tier."""
        half = max(1, self.store.hot_pages // 2) * self.page_size - req.num_computed % self.page_size
        return min(req.pending, budget, self.engine_cfg.prefill_chunk_tokens, half)

    def grow(self, req: Request, n: int, alone: bool) -> None:
        """Give req the pages for its next n tokens; a request alone spills its head to warm for
        room. Raises OutOfCapacity when they do not fit (`pending`: write-behind frees room soon)."""
        pages = self.pages(req.num_computed + n)
        while True:
            try:
                req.handle.grow(pages)
                return
            except OutOfCapacity as exc:
                if exc.pending or not alone or not self.spill(req, pages - req.handle.num_pages):
                    raise

    def spill(self, req: Request, n: int) -> int:
        moved = req.handle.spill(n) if self.can_spill else 0
        self.spilled_pages += moved
        return moved

    def relieve(self, others: Sequence[Request]) -> None:
        """A request alone gets no page: the loads of the others give their warm pages back (they
        compute what did not come up) and the background writes dirty pages behind, to free them."""
        for r in others:
            if r.handle is not None and r.handle.ticket is not None:
                r.handle.end_load()
        self.store.daemon.kick()

    def commit(self, req: Request) -> None:
        """Give keys to req's pages that filled up (after each step it ran in)."""
        req.handle.commit(req.tokens, req.num_computed // self.page_size)

    def release(self, req: Request, commit: bool) -> None:
        """Let go of req's pages (they stay cached), committing its full ones first when it ran;
        it computes from its cached pages again when readmitted."""
        if commit:
            self.commit(req)
        req.handle.release()
        req.num_computed, req.load_tried = 0, False

    def admit(self, req: Request, budget: int, running: Sequence[Request]) -> int:
        """Admit req if its pages fit beside the running requests; returns the tokens it computes
        this step (0: not admitted, its pages released; LOADING: its cached prefix now comes up
        from cold, until req.load_deadline)."""
        if req.handle is None:
            req.handle = self.store.handle(req.namespace)
        h = req.handle
        m = h.match(req.tokens[:req.cacheable])  # the last token is always computed (Request.cacheable)
        if not req.load_tried and not h.loading:
            req.load_tried = True
            if h.load(m) and self.prefetch.policy == "best_effort":
                h.end_load()   # the load warms the cache for later; this request holds none of it
            elif h.ticket is not None:
                req.load_deadline = (time.monotonic() + self.prefetch.timeout_s if self.prefetch.policy == "timeout"
                                     else float("inf"))
                return LOADING
        lead = m.tiers.index("cold") if "cold" in m.tiers else len(m.tiers)
        need_hot = self.pages(len(req.tokens)) - m.tiers[:lead].count("hot")
        if need_hot > self.store.admission_budget() and running:
            return 0
        quota = self.cfg.tenant_quotas.get(req.tenant, self.cfg.tenant_quota_pages)
        mine = [r for r in running if r.tenant == req.tenant]
        if quota and mine and sum(r.handle.num_pages for r in mine) + self.pages(len(req.tokens)) > quota:
            return 0
        if not self._attach(req, m, running):
            return 0
        req.num_computed = h.num_tokens
        if not req.admitted:
            for i, tier in enumerate(h.served[:h.num_pages]):
                source = next((s for s, pages in req.fetched_pages.items() if i in pages), tier)
                req.cached_tokens[source] += self.page_size
            req.admitted = True
        n = self.chunk(req, budget)
        try:
            self.grow(req, n, alone=not running)
        except OutOfCapacity:
            h.release()
            req.num_computed = 0
            return 0
        return n

    def _attach(self, req: Request, m: Match, running: Sequence[Request]) -> bool:
        """Hold req's cached prefix. A request that would run alone and cannot fit lets go of its
        load's warm pages (they stay cached), then leases its oldest pages in warm (spill), and
        failing that holds nothing and recomputes its prefix: alone, it always starts."""
        room = self._warm_room(m, running)
        try:
            req.handle.attach(m, spill_room=room)
            if room is not None and m.keys and not req.handle.num_pages:   # warm had no room for the copies
                req.handle.attach(m)
            return True
        except OutOfCapacity as exc:
            if running or exc.pending:
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

    def _warm_room(self, m: Match, running: Sequence[Request]) -> int | None:
        """With warm_in_place: attach's spill_room that leaves the match's leading pages in warm (leased
        and attended there, not copied to hot), while the pages the running requests lease stay within
        half of warm; None (everything to hot) otherwise. The leading pages run to the last one in warm
        before a page in neither tier; those of them in hot get warm copies, so they are leased when
        fewer are in hot than in warm (eviction keeps a chain's head in hot and sends its tail to warm:
        the short head is copied down instead of the long tail up, and no other prefix leaves hot)."""
        if not self.warm_in_place:
            return None
        memory = next((i for i, t in enumerate(m.tiers) if t not in ("hot", "warm")), len(m.tiers))
        lead = max((i + 1 for i, t in enumerate(m.tiers[:memory]) if t == "warm"), default=0)
        if 2 * m.tiers[:lead].count("warm") <= lead:
            return None
        leased = {k for r in running for k in r.handle.keys[:len(r.handle.spilled)]}   # a page leased twice counts once
        if len(leased) + sum(k not in leased for k in m.keys[:lead]) > self.store.warm.num_slots // 2:
            return None
        return len(m.keys) - lead

    def check(self, running: Sequence[Request], queued: Sequence[Request]) -> list[str]:
        """Page references balanced: only running requests hold pages, and hot's references and
        allocations are the slots they hold."""
        problems = [f"{r.id} holds {r.handle.num_pages} pages while {r.status.value}"
                    for r in queued if r.handle is not None and r.handle.num_pages]
        audit = self.store.audit(cold=False)
        problems += audit["problems"]
        held = sum(len(r.handle.slots) for r in running)
        if audit["total_refcount"] + audit["allocated_slots"] != held:
            problems.append(f"hot references {audit['total_refcount']} + allocated {audit['allocated_slots']} "
                            f"!= slots held by running requests {held}")
        return problems
