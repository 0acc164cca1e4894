"""TierMaintenance: moving pages down on request and by watermarks, a mixin of TieredStore.

- operators: `evict(keys, to)` and `flush(tier)` move pages down (out of the store, for cold);
- the daemon's periodic work: `rebalance` brings each tier above its high watermark down to its
  low watermark (hot at memory speed; warm frees clean pages and writes dirty ones behind first;
  cold deletes leaves), `write_through` copies committed pages down ahead of eviction, and the
  prefix index is trimmed to prefix_cache_max_entries;
- `clean_warm` frees warm slots for a load or a sidecar allocation.

Every method here may block on disk I/O (PageIO, outside the store's lock): for worker threads,
never the engine's. The host class provides the lock, config, tiers, index, mover and io.
"""

from __future__ import annotations

from typing import Iterable

from kvstore.errors import KVStoreError
from kvstore.index import TIERS, PageEntry


class TierMaintenance:
    """evict, flush, rebalance, clean_warm, write_through: see the module docstring."""

    def evict(self, keys: Iterable[bytes], to: str | None = None) -> int:
        """Move pages down: out of hot (to="warm"), out of hot and warm (to="cold"), or out of the
        store (to=None). Referenced and pinned pages are skipped; deepest pages go first."""
        names = self.mover.names
        if to is not None and to not in names[1:]:
            raise KVStoreError(f"evict: to = {to!r}: must be {', '.join(names[1:])} or none")
        leave = names if to is None else names[:names.index(to)]
        with self._lock:
            entries = sorted((e for e in map(self.index.get, keys) if e is not None), key=lambda e: -e.depth)
        return self._evict(entries, leave)

    def flush(self, tier: str) -> int:
        """Move every page that may leave `tier` one tier down (out of the store, for cold)."""
        names = (*self.mover.names, *(t for t in TIERS if t not in self.mover.names))
        if tier not in names:
            raise KVStoreError(f"flush: tier = {tier!r}: must be one of {', '.join(names)}")
        with self._lock:
            entries = sorted(self.index.in_tier(tier), key=lambda e: -e.depth)
        return self._evict(entries, (tier,))

    def _evict(self, entries: list[PageEntry], tiers: tuple[str, ...]) -> int:
        """Demote each entry out of each of `tiers` where it may leave; returns how many copies left.
        A page with nowhere lower to go in memory is written to cold first (outside the lock)."""
        moved = 0
        for tier in tiers:
            if tier not in self.mover.memory:
                with self._lock:
                    now = self.index.now()
                    keys = []
                    for e in entries:   # deepest first: a parent may become a leaf as its children go
                        if e.key in self.index and tier in e.where and self.mover.evictable(e, tier, now):
                            self.mover.remove_copies([e], tier)
                            keys.append(e.key)
                self.io.drop_cold(keys)
                moved += len(keys)
                continue
            with self._lock:
                now = self.index.now()
                live = [e for e in entries if e.key in self.index and tier in e.where
                        and self.mover.evictable(e, tier, now)]
                below = self.mover.below(tier)
                needs_disk = [e for e in live if e.residency <= 1
                              and not (below and self.mover.tiers[below].pool.num_free)]
            if self.cold is not None:
                self.io.persist(needs_disk)
            with self._lock:
                now = self.index.now()
                for e in live:   # a page the cold tier could not take stays (dirty), never dropped
                    if e.key in self.index and tier in e.where and self.mover.evictable(e, tier, now):
                        moved += self.mover.demote([e], tier, drop=self.cold is None)
        return moved

    # the daemon's periodic work
    def rebalance(self) -> dict[str, int]:
        """Bring each tier above its high watermark down to its low watermark; trim the index.

        Hot demotes at memory speed; warm frees clean pages at once and writes dirty ones behind
        (outside the lock) before freeing them; cold deletes leaves. For worker threads."""
        moved = {"hot": 0, "warm": 0, "cold": 0}
        with self._maintenance:
            with self._lock:
                pool, cfg, victims = self.hot.pool, self.config.hot, []
                if pool.num_slots and pool.num_used > cfg.high_watermark * pool.num_slots:
                    target = int(cfg.low_watermark * pool.num_slots)
                    victims = self.mover.victims("hot", pool.num_used - target)
                    moved["hot"] = self.mover.demote(victims, "hot", drop=self.cold is None)
            moved["hot"] += self._write_behind(victims if moved["hot"] < len(victims) else [], "hot")
            with self._lock:
                pool, cfg = self.warm.pool, self.config.warm
                victims = []
                if pool.num_slots and pool.num_used > cfg.high_watermark * pool.num_slots:
                    victims = self.mover.victims("warm", pool.num_used - int(cfg.low_watermark * pool.num_slots))
                    moved["warm"] = self.mover.demote(victims, "warm", drop=self.cold is None)
            moved["warm"] += self._write_behind(victims if moved["warm"] < len(victims) else [], "warm")
            if self.cold is not None:
                with self._lock:
                    keys = []
                    if self.cold.used_bytes > self.config.cold.high_watermark * self.cold.capacity_bytes:
                        keys, _ = self.mover.cold_victims(self.cold.used_bytes - int(
                            self.config.cold.low_watermark * self.cold.capacity_bytes))
                self.io.drop_cold(keys)
                moved["cold"] = len(keys)
            if self.config.write_policy == "write_through" and self.write_through_pending:
                self.write_through()
            self._trim_index()
        return moved

    def clean_warm(self, n: int) -> int:
        """Free up to n warm slots now, writing dirty pages behind first (blocks: worker threads)."""
        with self._maintenance:   # after any write-behind in flight
            with self._lock:
                victims = self.mover.victims("warm", n)
                freed = self.mover.demote(victims, "warm", drop=self.cold is None)
            return freed + self._write_behind(victims, "warm")

    def _write_behind(self, victims: list[PageEntry], tier: str) -> int:
        """Write the victims still in `tier` (dirty: no lower copy) to cold, then free them there."""
        with self._lock:
            dirty = [e for e in victims if e.key in self.index and tier in e.where]
        if not dirty or self.cold is None:
            return 0
        self.io.persist(sorted(dirty, key=lambda e: e.depth))
        with self._lock:
            now = self.index.now()
            clean = [e for e in dirty if e.key in self.index and tier in e.where and e.cold
                     and self.mover.evictable(e, tier, now)]
            return self.mover.demote(clean, tier)

    def _trim_index(self) -> None:
        """Drop the oldest unreferenced leaves past prefix_cache_max_entries."""
        with self._lock:
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

    def write_through(self, limit: int = 256) -> int:
        """Copy committed pages down now (write_through policy), so that evicting them is a free."""
        with self._lock:
            keys, self.write_through_pending = self.write_through_pending[:limit], self.write_through_pending[limit:]
            entries = [e for e in map(self.index.get, dict.fromkeys(keys)) if e is not None
                       and (e.hot is not None or e.warm is not None)]
            to_warm = [e for e in entries if e.warm is None]
            if to_warm and self.mover.make_room("warm", len(to_warm), {e.key for e in entries}):
                # a copy ahead of eviction: not counted as bytes moved (it never was)
                self.mover.copy(to_warm, "hot", "warm", self.warm.alloc(len(to_warm)), counted=False)
        self.io.persist([e for e in entries if not e.cold])
        return len(entries)
