"""StoreCore: what the store's parts share, and nothing more.

TieredStore (tiered.py) is built of parts that each hold this core, never the store: the
engine's verbs on hot pages (hot.py), warm pages shared with another process (sharing.py), a
request's handle (handle.py), moving pages down (kvstore.movement.maintenance), the disk work
and the daemon (kvstore.movement.pageio, daemon), the remote fetch (fetch.py). The core is the
one lock, the config and spec, the tiers by role, the page index, the mover and its counts, the
remote tier, the slots handed to callers and not yet committed, and the residency listeners.

Rules: the index, the tiers' pools and the callers' slots are read and changed under `lock`
(re-entrant; the mover never takes it itself). Only the store's parts take it: the admin views
read TieredStore.snapshot() instead.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvstore.config import Config
from kvstore.movement.move_stats import MoveStats
from kvstore.movement.mover import PageMover
from kvstore.pages.keys import Namespace, page_keys, page_tokens
from kvstore.pages.spec import KVSpec
from kvstore.placement.index import TIERS, PageIndex
from kvstore.remote.tier import RemoteTier
from kvstore.tiers.base import Tier
from kvstore.tiers.device import DeviceTier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier

Listener = Callable[[str, bytes, str], None]   # (event "add" | "remove", key, tier)


@dataclass
class Match:
    """The longest cached prefix of a token sequence: one key and one tier per full page."""

    namespace: Namespace
    page_size: int
    keys: list[bytes] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)

    @property
    def num_pages(self) -> int:
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        return len(self.keys) * self.page_size

    def counts(self) -> dict[str, int]:
        return {t: self.tiers.count(t) for t in TIERS}


class StoreCore:
    """`tiers`: the store's tiers, fastest first (hot and warm always; cold when enabled)."""

    def __init__(self, config: Config, spec: KVSpec, tiers: Sequence[Tier], remote: RemoteTier | None):
        self.config, self.spec, self.remote = config, spec, remote
        self.tiers = list(tiers)
        self.by_name = {t.name: t for t in self.tiers}
        self.hot: DeviceTier = self.by_name["hot"]
        self.warm: HostTier = self.by_name["warm"]
        self.cold: DiskTier | None = self.by_name.get("cold")
        names = tuple(self.by_name)
        self.lock = threading.RLock()
        self.index = PageIndex(config.eviction_policy, names, tuple(t.name for t in self.tiers if t.keyed))
        self.owned: set[int] = set()        # hot slots allocated to callers and not committed
        self.warm_owned: set[int] = set()   # the same in warm (allocate_warm)
        self.listeners: list[Listener] = []
        # every built-in tier is reported, enabled or not
        self.counts = MoveStats(names if "cold" in names else (*names, "cold"), spec.page_bytes)
        self.mover = PageMover(spec, self.tiers, self.index, config.eviction_policy, self.emit, self.counts)

    def emit(self, event: str, key: bytes, tier: str) -> None:
        """Tell the listeners of a residency change (under the lock: they must not block)."""
        for fn in self.listeners:
            fn(event, key, tier)

    def match(self, tokens: Sequence[int], namespace: Namespace) -> Match:
        """The longest prefix of full pages present in some tier, verified against the request."""
        ps = self.spec.page_size
        m = Match(namespace, ps)
        keys, pages = page_keys(namespace, tokens, ps), page_tokens(tokens, ps)
        with self.lock:
            prev = namespace.digest
            for key, page in zip(keys, pages):
                e = self.index.get(key)
                if e is None:
                    break
                if e.namespace != namespace.digest or e.parent != prev or e.tokens != page:
                    self.counts.count("mismatch")
                    break
                m.keys.append(key)
                m.tiers.append(e.tier)
                prev = key
        return m

    def unlease(self, slots: Sequence[int]) -> None:
        """End one lease on the page in each of these warm slots, the tail first (under the lock)."""
        for slot in reversed(slots):
            e = self.index.warm_slots[slot]
            e.leases -= 1
            self.index.touch(e)
