"""CacheHandle: one request's hold on its KV pages, the scheduler's only door to the store.

A request's pages 0..num_pages-1 are held: the oldest `len(spilled)` as warm leases (a long
sequence's head, which the attention backend reads from warm), the rest as hot slots. Pages
below `committed` have keys (`keys`, the hash chain extended incrementally from its last key);
the pages after them are the handle's own fresh slots, which the engine fills. While a load
runs, `ticket` brings the cached prefix's cold pages up to warm and holds them there.

Rules:
- One owner (the engine thread) calls a handle. Every verb takes the store's lock and works at
  memory speed: no verb reads or writes the disk; cold pages come up only through `load`, on
  the store's I/O threads.
- A handle is given the store's parts, not the store: the core (core.py), the daemon, and the
  verbs on hot pages (hot.py) and on warm leases (sharing.py).
- `attach` is all or nothing; `grow` raises OutOfCapacity and leaves the handle as it was.
- `release` gives everything back (pages stay cached, refcount 0); the handle can then be
  attached again (a preempted request resumes from its cached pages).
"""

from __future__ import annotations

from typing import Sequence

from kvstore.errors import OutOfCapacity
from kvstore.movement.daemon import Daemon
from kvstore.movement.pageio import LoadTicket
from kvstore.pages.keys import Namespace, page_keys
from kvstore.store.core import Match, StoreCore
from kvstore.store.hot import HotPages
from kvstore.store.sharing import WarmSharing


class CacheHandle:
    def __init__(self, core: StoreCore, daemon: Daemon, pages: HotPages, sharing: WarmSharing,
                 namespace: Namespace):
        self.core, self.daemon, self.pages, self.sharing = core, daemon, pages, sharing
        self.namespace = namespace
        self.page_size = core.spec.page_size
        self.keys: list[bytes] = []      # keys of the committed pages 0..committed-1
        self.spilled: list[int] = []     # warm slots (leased) of the oldest pages
        self.slots: list[int] = []       # hot slots of the pages after those
        self.ticket: LoadTicket | None = None
        self.served: list[str] = []      # tier each attached page came from (first attach)

    # state
    @property
    def num_pages(self) -> int:
        return len(self.spilled) + len(self.slots)

    @property
    def num_tokens(self) -> int:
        """Tokens the held pages have room for."""
        return self.num_pages * self.page_size

    @property
    def committed(self) -> int:
        return len(self.keys)

    @property
    def loading(self) -> bool:
        return self.ticket is not None and not self.ticket.done()

    # verbs
    def match(self, tokens: Sequence[int]) -> Match:
        """The longest cached prefix of tokens (nothing held)."""
        return self.core.match(tokens, self.namespace)

    def load(self, match: Match) -> bool:
        """Start bringing the matched prefix's cold pages (and those of other tiers below warm) up to
        warm (on the store's I/O threads); False when none is only below warm (nothing to wait for)."""
        mover = self.core.mover
        if all(t in (mover.top, mover.stage) for t in match.tiers) or self.ticket is not None:
            return False
        self.served = self.served or list(match.tiers)   # where the pages were before the load
        self.ticket = self.daemon.load(match.keys)
        return True

    def end_load(self) -> None:
        if self.ticket is not None:
            with self.core.lock:
                self.daemon.end_load(self.ticket)
            self.ticket = None

    def attach(self, match: Match, spill_room: int | None = None) -> int:
        """Hold the matched prefix's pages that are in memory (warm ones are copied to hot), up to
        the first page that is not; returns how many. With `spill_room` (a request that must run
        alone), only the last `spill_room` pages go to hot, the older ones are leased in warm.
        Raises OutOfCapacity (holding nothing) when hot cannot take them."""
        assert self.num_pages == 0, "attach: the handle already holds pages"
        with self.core.lock:
            keys = match.keys
            split = 0 if spill_room is None else max(len(keys) - spill_room, 0)
            spilled = self.sharing.lease_in_memory(keys[:split]) if split else []
            if len(spilled) < split:
                self.sharing.release_warm(spilled)
                spilled, keys = [], keys[:len(spilled)]
            try:
                slots = self.pages.acquire(keys[split:]) if len(spilled) == split else []
            except OutOfCapacity:
                self.sharing.release_warm(spilled)
                raise
            self.spilled, self.slots = spilled, slots
            self.keys = list(match.keys[:self.num_pages])
            if not self.served:
                self.served = list(match.tiers[:self.num_pages])
            self.end_load()
        return self.num_pages

    def grow(self, pages: int) -> None:
        """Hold at least `pages` pages, allocating fresh hot slots (OutOfCapacity if hot is full)."""
        need = pages - self.num_pages
        if need > 0:
            self.slots += self.pages.allocate(need)

    def commit(self, tokens: Sequence[int], full_pages: int) -> None:
        """Give keys to pages committed..full_pages-1, filled by the engine from `tokens`."""
        first = self.committed
        if full_pages <= first:
            return
        ps = self.page_size
        parent = self.keys[-1] if self.keys else None
        keys = page_keys(self.namespace, tokens[:full_pages * ps], ps, start=first, parent=parent)
        base = len(self.spilled)
        self.pages.commit_keys(self.namespace, tokens, keys, self.slots[first - base:full_pages - base],
                               start_page=first, parent=parent or self.namespace.digest)
        self.keys += keys

    def spill(self, n: int) -> int:
        """Move up to n of the oldest committed hot pages to warm leases; returns how many moved."""
        first = len(self.spilled)
        n = min(n, self.committed - first)
        if n <= 0:
            return 0
        with self.core.lock:
            leased = self.sharing.lease_in_memory(self.keys[first:first + n])
            self.pages.release(self.slots[:len(leased)])
        self.spilled += leased
        self.slots = self.slots[len(leased):]
        return len(leased)

    def release(self) -> None:
        """Give back every page and the load's leases; committed pages stay cached."""
        with self.core.lock:
            self.pages.release(self.slots)
            self.sharing.release_warm(self.spilled)
            self.end_load()
        self.keys, self.spilled, self.slots = [], [], []
