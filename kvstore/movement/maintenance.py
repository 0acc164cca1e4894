"""TierMaintenance: moving pages down on request and by watermarks, a part of TieredStore.

- operators: `evict(keys, to)` and `flush(tier)` move pages down (out of the store, for cold);
  a page with no cold copy is written first (by the Daemon's writer, which this waits for);
  `clear_namespace(digest)` takes a namespace's pages out of the store, but those in use now;
- the Daemon's periodic work: `rebalance` brings each memory tier above its high watermark down
  to its low watermark at memory speed (pages that are dirty wait in the write-behind queue),
  trims the cold tier to its low watermark (the whole excess) and the prefix index to
  prefix_cache_max_entries.

Every method here may block on disk I/O (outside the store's lock): for worker threads and the
Daemon's, never the engine's. It is given the store's core (kvstore.store.core) and the daemon,
whose writer it waits for and whose PageIO deletes cold records.
"""

from __future__ import annotations

import threading
from typing import Iterable

from kvstore.errors import KVStoreError
from kvstore.movement.daemon import Daemon
from kvstore.placement.index import TIERS, PageEntry
from kvstore.store.core import StoreCore


class TierMaintenance:
    """evict, clear_namespace, flush, rebalance: see the module docstring."""

    def __init__(self, core: StoreCore, daemon: Daemon):
        self.core, self.daemon, self.io = core, daemon, daemon.io
        self.config, self.index, self.mover = core.config, core.index, core.mover
        self._rebalancing = threading.Lock()   # one rebalance at a time

    def evict(self, keys: Iterable[bytes], to: str | None = None) -> int:
        """Move pages down: out of hot (to="warm"), out of hot and warm (to="cold"), or out of the
        store (to=None). Referenced and pinned pages are skipped; deepest pages go first."""
        names = self.mover.names
        if to is not None and to not in names[1:]:
            raise KVStoreError(f"evict: to = {to!r}: must be {', '.join(names[1:])} or none")
        leave = names if to is None else names[:names.index(to)]
        with self.core.lock:
            entries = sorted((e for e in map(self.index.get, keys) if e is not None), key=lambda e: -e.depth)
        return self._evict(entries, leave, out=to is None)

    def clear_namespace(self, namespace: bytes) -> tuple[int, int]:
        """Every page of a namespace (its digest) out of the store, but those in use now (referenced,
        leased or pinned: their copies all stay). Returns (pages removed, pages kept)."""
        with self.core.lock:
            now = self.index.now()
            mine = [e for e in self.index.entries.values() if e.namespace == namespace]
            idle = [e.key for e in mine if not (e.refcount or e.leases or e.pinned(now))]
        self.evict(idle, None)
        with self.core.lock:
            kept = sum(1 for e in mine if e.key in self.index)
        return len(mine) - kept, kept

    def flush(self, tier: str) -> int:
        """Move every page that may leave `tier` one tier down (out of the store, for cold)."""
        names = (*self.mover.names, *(t for t in TIERS if t not in self.mover.names))
        if tier not in names:
            raise KVStoreError(f"flush: tier = {tier!r}: must be one of {', '.join(names)}")
        with self.core.lock:
            entries = sorted(self.index.in_tier(tier), key=lambda e: -e.depth)
        return self._evict(entries, (tier,), out=False)

    def _evict(self, entries: list[PageEntry], tiers: tuple[str, ...], out: bool) -> int:
        """Take each entry out of each of `tiers` where it may leave; returns how many copies left.
        `out`: the pages leave the store; otherwise they go down to the tier after the last of
        `tiers`, and a page with a cold copy is not copied into a memory tier it leaves next."""
        names, moved = self.mover.names, 0
        after = names[names.index(tiers[-1]) + 1] if names.index(tiers[-1]) + 1 < len(names) else None
        into_cold = out or after not in self.mover.memory
        for tier in tiers:
            if tier in self.mover.memory:
                moved += self._leave_memory(entries, tier, out, passing=into_cold and self.mover.below(tier) in tiers)
                continue
            with self.core.lock:
                gone = self._leaving(entries, tier, one_by_one=True)
            self.io.drop_cold([e.key for e in gone])
            moved += len(gone)
        return moved

    def _leave_memory(self, entries: list[PageEntry], tier: str, out: bool, passing: bool) -> int:
        """Entries out of a memory tier. A page with no cold copy is written first (the writer does, this
        waits; a page cold refused before is tried again); one that cold still refuses stays, unless
        it is a leaf leaving the store (`out`) or there is no cold tier. Without `out` a page moves to
        the tier below, but with `passing` (that tier is left next) only one without a cold copy."""
        with self.core.lock:
            leaving = self._leaving(entries, tier)
            self.daemon.retry(leaving)
            # and a page whose cold write is in flight now (not evictable until it lands): without the
            # wait, whether it left depended on when write-behind had picked it up
            going = {e.key for e in leaving}
            dirty = [e for e in entries if e.key in self.index.dirty
                     and (e.key in going or (e.writing and tier in e.where))]
        self.daemon.wait_clean(dirty)
        moved = 0
        with self.core.lock:
            for e in self._leaving(entries, tier):   # one by one, deepest first: a leaf may make room for its parent
                if e.key in self.index and tier in e.where:
                    keep = not out and not (passing and e.residency > 1)
                    moved += self.mover.demote([e], tier, keep=keep, drop=out or self.core.cold is None)
        return moved

    def _leaving(self, entries: list[PageEntry], tier: str, one_by_one: bool = False) -> list[PageEntry]:
        """The entries that may leave `tier` now; `one_by_one` removes each copy as it goes (cold:
        deepest first, a parent may become a leaf as its children go)."""
        now, out = self.index.now(), []
        for e in entries:
            if e.key in self.index and tier in e.where and self.mover.evictable(e, tier, now):
                out.append(e)
                if one_by_one:
                    self.mover.remove_copies([e], tier)
        return out

    # the daemon's periodic work
    def rebalance(self) -> dict[str, int]:
        """Bring each memory tier above its high watermark down to its low watermark (at memory speed:
        dirty pages stay until written); trim cold to its low watermark and the index. For the
        Daemon's thread and worker threads."""
        moved = {"hot": 0, "warm": 0, "cold": 0}
        with self._rebalancing:
            for tier, cfg in (("hot", self.config.hot), ("warm", self.config.warm)):
                with self.core.lock:
                    pool = self.core.by_name[tier].pool
                    if pool.num_slots and pool.num_used > cfg.high_watermark * pool.num_slots:
                        before = pool.num_free
                        self.mover.make_room(tier, pool.num_slots - int(cfg.low_watermark * pool.num_slots))
                        moved[tier] = pool.num_free - before
            cold = self.core.cold
            if cold is not None:
                with self.core.lock:
                    keys = []
                    excess = cold.used_bytes - int(self.config.cold.low_watermark * cold.capacity_bytes)
                    if cold.used_bytes > self.config.cold.high_watermark * cold.capacity_bytes:
                        keys = self.mover.cold_room(excess)   # the whole excess, whatever room is left
                self.io.drop_cold(keys)
                moved["cold"] = len(keys)
            self._trim_index()
        return moved

    def _trim_index(self) -> None:
        """Drop the oldest unreferenced leaves past prefix_cache_max_entries."""
        with self.core.lock:
            over = len(self.index) - self.config.prefix_cache_max_entries
            keys = []
            if over > 0:
                now = self.index.now()
                for e in self.index.oldest_leaves(over, lambda e: not (e.refcount or e.leases or e.writing
                                                                       or e.pinned(now))):
                    for tier in list(e.where):
                        self.mover.remove_copies([e], tier)
                        if tier not in self.mover.memory:
                            keys.append(e.key)
        self.io.drop_cold(keys)
