"""PageIndex: page key -> where the page lives, who holds it, how it has been used.

Invariants (checked by TieredStore.audit):
- An entry exists while at least one tier holds its page (hot slot, warm slot or cold record).
- `refcount` counts holders of the hot copy; a referenced entry always has a hot slot.
- `leases` counts holders of the warm copy (sidecar clients); a leased entry always has a warm slot.
- `kids` are the entries whose parent is this key; a child whose parent is absent waits in
  `_waiting` and is linked when the parent arrives, so `kids` is exact whatever the order.

Eviction order: each tier is kept in the policy's order (policy.VictimQueue, one per policy and
tier, plus the least recently used leaves for the prefix-cache trim), so `victims` and
`oldest_leaves` pop instead of scanning. An entry held in a tier (referenced in hot, leased in
warm, in cold with a child in cold or as the only copy of a parent) is left out of that tier's
queue until a change re-queues it. Hence the rule: code that changes a field a policy key reads
calls index.touch(e), and so does code that drops a refcount or a lease; tier membership changes
go through set_hot, set_warm and set_cold, links through add and remove.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from kvstore.policy import POLICIES, VictimQueue

TIERS = ("hot", "warm", "cold")


@dataclass(slots=True, eq=False)
class PageEntry:
    key: bytes
    parent: bytes
    namespace: bytes
    tokens: bytes                # int32 LE token ids of this page
    depth: int = 0               # page index in its sequence
    hot: int | None = None       # hot slot
    warm: int | None = None      # warm slot
    cold: bool = False           # a record in the cold tier
    refcount: int = 0
    leases: int = 0              # holders of the warm copy
    writing: bool = False        # a cold write of this page is in flight: its warm copy stays
    pin_until: float = 0.0       # monotonic deadline; 0 = not pinned
    hits: int = 0
    last_access: int = 0         # index tick
    kids: set = field(default_factory=set)
    seq: int = 0                 # insertion order: breaks ties between equal policy keys
    stamp: int = 0               # version of this entry's queue items (PageIndex._requeue)

    @property
    def children(self) -> int:
        return len(self.kids)

    @property
    def tier(self) -> str:
        """The fastest tier holding this page."""
        return "hot" if self.hot is not None else "warm" if self.warm is not None else "cold"

    @property
    def residency(self) -> int:
        return (self.hot is not None) + (self.warm is not None) + self.cold

    def pinned(self, now: float) -> bool:
        return self.pin_until > now


class PageIndex:
    def __init__(self, policy: str = "lru"):
        self.policy = policy
        self.entries: dict[bytes, PageEntry] = {}
        self.hot_slots: dict[int, PageEntry] = {}
        self.warm_slots: dict[int, PageEntry] = {}
        self.cold_entries: dict[bytes, PageEntry] = {}
        self._waiting: dict[bytes, set[bytes]] = {}
        self._tick = 0
        self._seq = 0
        self._stamp = 0
        self._orders: dict[str, dict[str, VictimQueue]] = {}   # policy -> tier (or "leaves") -> queue
        self._changed: set[PageEntry] = set()                  # to push again before the next read
        self._members = {"hot": self.hot_slots, "warm": self.warm_slots, "cold": self.cold_entries,
                         "leaves": self.entries}
        self._wanted: dict[str, Callable[[PageEntry], bool]] = {
            "hot": lambda e: e.hot is not None and not e.refcount,
            "warm": lambda e: e.warm is not None and not e.leases,
            "cold": lambda e: e.cold and not self._cold_held(e),
            "leaves": lambda e: not e.kids}
        for tier in TIERS:
            self._queue(policy, tier)
        self._queue("lru", "leaves")

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def get(self, key: bytes) -> PageEntry | None:
        return self.entries.get(key)

    def tick(self) -> int:
        self._tick += 1
        return self._tick

    def touch(self, e: PageEntry) -> None:
        e.last_access = self.tick()
        self._requeue(e)

    def changed(self, e: PageEntry) -> None:
        """e may leave a tier now that it could not before (a lease or a write ended): queue it again,
        without counting it as used."""
        self._requeue(e)

    def add(self, e: PageEntry) -> PageEntry:
        if e.key in self.entries:
            raise KeyError("page already indexed")
        self.entries[e.key] = e
        self._seq += 1
        e.seq = self._seq
        if e.cold:
            self.cold_entries[e.key] = e
        e.kids = self._waiting.pop(e.key, set())
        parent = self.entries.get(e.parent)
        if parent is not None:
            parent.kids.add(e.key)
            self._requeue(parent)
        else:
            self._waiting.setdefault(e.parent, set()).add(e.key)
        if e.last_access == 0:
            e.last_access = self.tick()
        self._requeue(e)
        return e

    def remove(self, e: PageEntry) -> None:
        del self.entries[e.key]
        self.cold_entries.pop(e.key, None)
        self._stamp += 1
        e.stamp = self._stamp   # its queue items are stale now
        self._changed.discard(e)
        parent = self.entries.get(e.parent)
        if parent is not None:
            parent.kids.discard(e.key)
            self._requeue(parent)
        else:
            waiting = self._waiting.get(e.parent)
            if waiting is not None:
                waiting.discard(e.key)
                if not waiting:
                    del self._waiting[e.parent]
        if e.kids:
            self._waiting[e.key] = e.kids
        e.kids = set()

    def set_hot(self, e: PageEntry, slot: int | None) -> None:
        if e.hot is not None:
            del self.hot_slots[e.hot]
        e.hot = slot
        if slot is not None:
            self.hot_slots[slot] = e
        self._requeue(e)

    def set_warm(self, e: PageEntry, slot: int | None) -> None:
        if e.warm is not None:
            del self.warm_slots[e.warm]
        e.warm = slot
        if slot is not None:
            self.warm_slots[slot] = e
        self._requeue(e)

    def set_cold(self, e: PageEntry, flag: bool) -> None:
        e.cold = flag
        if flag:
            self.cold_entries[e.key] = e
        else:
            self.cold_entries.pop(e.key, None)
        self._requeue(e)
        parent = self.entries.get(e.parent)
        if not flag and parent is not None and parent.cold:
            self._requeue(parent)   # its last child in cold may have left

    def in_tier(self, tier: str) -> Iterator[PageEntry]:
        return iter(self._members[tier].values())

    # eviction order
    def victims(self, tier: str, n: int, ok: Callable[[PageEntry], bool],
                policy: str | None = None) -> list[PageEntry]:
        """Up to n entries of `tier` that satisfy ok (and are not held there), in the policy's order:
        smallest key first, then insertion order. Nothing is removed; evicting them is the caller's."""
        self._flush()
        return self._queue(policy or self.policy, tier).first(n, ok)

    def oldest_leaves(self, n: int, ok: Callable[[PageEntry], bool]) -> list[PageEntry]:
        """Up to n entries without children that satisfy ok, least recently accessed first."""
        self._flush()
        return self._queue("lru", "leaves").first(n, ok)

    def _queue(self, policy: str, tier: str) -> VictimQueue:
        queues = self._orders.setdefault(policy, {})
        if tier not in queues:   # another policy asked for: built once, then kept up to date
            members = self._members[tier]
            queues[tier] = VictimQueue(POLICIES.get(policy), self._wanted[tier], members.__len__)
            queues[tier].rebuild(members.values())
        return queues[tier]

    def _requeue(self, e: PageEntry) -> None:
        """e changed: it is pushed again before the queues are next read (once, however often it changed)."""
        self._changed.add(e)

    def _flush(self) -> None:
        """Give each changed entry a new stamp (its older items go stale) and push it where it is
        wanted; when most entries changed (loading the cold tier), rebuild the queues instead."""
        changed, self._changed = self._changed, set()
        if len(changed) > 4096 and len(changed) * 2 > len(self.entries):
            for queues in self._orders.values():
                for tier, q in queues.items():
                    q.rebuild(self._members[tier].values())
            return
        for e in changed:
            self._stamp += 1
            e.stamp = self._stamp
            for queues in self._orders.values():
                key = None
                for q in queues.values():
                    if q.wanted(e):
                        key = q.key(e) if key is None else key
                        q.push(e, key)

    def settle(self) -> None:
        """Push the changed entries now (a bulk loader calls it per chunk, so that no later read
        finds most of the index changed and rebuilds every queue under the store's lock)."""
        self._flush()

    def _cold_held(self, e: PageEntry) -> bool:
        """A cold record stays while a child is in cold, or while it is the only copy of a parent."""
        if not e.kids:
            return False
        if e.hot is None and e.warm is None:
            return True
        entries = self.entries
        for k in e.kids:
            kid = entries.get(k)
            if kid is not None and kid.cold:
                return True
        return False

    def compute_depths(self, keys=None, done: dict[bytes, int] | None = None) -> None:
        """Set depth from parent links (after loading entries in any order): of every entry, or of
        `keys`, in chunks that share `done` (key -> depth found so far)."""
        done = {} if done is None else done
        for e in (self.entries.values() if keys is None else filter(None, map(self.entries.get, keys))):
            chain, seen = [], set()
            cur = e
            while cur is not None and cur.key not in done and cur.key not in seen:   # a forged cycle ends too
                chain.append(cur)
                seen.add(cur.key)
                cur = self.entries.get(cur.parent)
            d = done[cur.key] + 1 if cur is not None and cur.key in done else 0
            for c in reversed(chain):
                if c.depth != d:
                    c.depth = d
                    self._requeue(c)   # depth is a key field
                done[c.key] = d
                d += 1

    def now(self) -> float:
        return time.monotonic()
