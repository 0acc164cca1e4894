"""StoreSnapshot: the store at one moment, copied under the lock, for readers that must not take it.

The admin views (kvstore.server.views) and the dashboard's sampler (kvstore.server.history) read
one through TieredStore.snapshot() on a worker thread: the tiers' byte counters, the bytes moved,
write-behind and drops, and, when asked for, the pages (all of them, or some keys). Copying the
counters is O(dirty pages); the pages, O(pages copied). A snapshot is immutable, and never
changes after it is taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterable, Mapping

from kvstore.movement.daemon import Daemon
from kvstore.placement.index import TIERS, PageEntry
from kvstore.store.core import StoreCore


@dataclass(frozen=True, slots=True)
class PageView:
    """One page as it was: where it lived (`tier` the fastest; `tiers` the built-in ones), who held it."""

    key: bytes
    parent: bytes
    namespace: bytes
    depth: int
    tier: str
    tiers: tuple[str, ...]
    refcount: int
    pin_until: float
    hits: int
    last_access: int
    children: int

    @classmethod
    def of(cls, e: PageEntry) -> "PageView":
        return cls(e.key, e.parent, e.namespace, e.depth, e.tier, tuple(t for t in TIERS if t in e.where),
                   e.refcount, e.pin_until, e.hits, e.last_access, e.children)

    def pinned(self, now: float) -> bool:
        return self.pin_until > now


@dataclass(frozen=True, slots=True)
class StoreSnapshot:
    now: float                                 # the index's clock (pin deadlines are on it)
    page_size: int
    tiers: Mapping[str, tuple[int, int]]       # built-in tier -> (used bytes, capacity bytes); (0, 0) if off
    bytes_moved: Mapping[str, int]             # direction (e.g. "hot_to_warm") -> bytes since the start
    write_behind: Mapping[str, Any]            # the daemon's stats()
    dropped_by_reason: Mapping[str, int]
    pages: Mapping[bytes, PageView]            # key -> page; empty unless asked for


def take_snapshot(core: StoreCore, daemon: Daemon, pages: bool | Iterable[bytes] = False,
                  tier: str | None = None) -> StoreSnapshot:
    """The snapshot now; `pages`: True for every page (only those `tier` holds, a built-in tier,
    when given: O(its pages)), or the keys wanted (those cached)."""
    with core.lock:
        index = core.index
        if pages is True:
            chosen = index.entries.values() if tier is None else index.in_tier(tier) if tier in TIERS else ()
        else:
            chosen = filter(None, map(index.get, pages or ()))
        return StoreSnapshot(
            now=index.now(), page_size=core.spec.page_size,
            tiers=MappingProxyType({name: (tier.used_bytes, tier.capacity_bytes) if tier is not None else (0, 0)
                                    for name, tier in ((t, core.by_name.get(t)) for t in TIERS)}),
            bytes_moved=MappingProxyType(dict(core.counts.bytes_moved)),
            write_behind=MappingProxyType(daemon.stats()),
            dropped_by_reason=MappingProxyType(dict(core.counts.drops)),
            pages=MappingProxyType({e.key: PageView.of(e) for e in chosen}))
