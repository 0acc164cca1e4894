"""PageIndex: page key -> where the page lives, who holds it, how it has been used.

Invariants (checked by TieredStore.audit):
- An entry exists while at least one tier holds its page (hot slot, warm slot or cold record).
- `refcount` counts holders of the hot copy; a referenced entry always has a hot slot.
- `leases` counts holders of the warm copy (sidecar clients); a leased entry always has a warm slot.
- `kids` are the entries whose parent is this key; a child whose parent is absent waits in
  `_waiting` and is linked when the parent arrives, so `kids` is exact whatever the order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator


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
    pin_until: float = 0.0       # monotonic deadline; 0 = not pinned
    hits: int = 0
    last_access: int = 0         # index tick
    kids: set = field(default_factory=set)

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
    def __init__(self):
        self.entries: dict[bytes, PageEntry] = {}
        self.hot_slots: dict[int, PageEntry] = {}
        self.warm_slots: dict[int, PageEntry] = {}
        self._waiting: dict[bytes, set[bytes]] = {}
        self._tick = 0

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

    def add(self, e: PageEntry) -> PageEntry:
        if e.key in self.entries:
            raise KeyError("page already indexed")
        self.entries[e.key] = e
        e.kids = self._waiting.pop(e.key, set())
        parent = self.entries.get(e.parent)
        if parent is not None:
            parent.kids.add(e.key)
        else:
            self._waiting.setdefault(e.parent, set()).add(e.key)
        if e.last_access == 0:
            self.touch(e)
        return e

    def remove(self, e: PageEntry) -> None:
        del self.entries[e.key]
        parent = self.entries.get(e.parent)
        if parent is not None:
            parent.kids.discard(e.key)
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

    def set_warm(self, e: PageEntry, slot: int | None) -> None:
        if e.warm is not None:
            del self.warm_slots[e.warm]
        e.warm = slot
        if slot is not None:
            self.warm_slots[slot] = e

    def in_tier(self, tier: str) -> Iterator[PageEntry]:
        if tier == "hot":
            return iter(self.hot_slots.values())
        if tier == "warm":
            return iter(self.warm_slots.values())
        return (e for e in self.entries.values() if e.cold)

    def compute_depths(self) -> None:
        """Set depth from parent links (after loading entries in any order)."""
        done: dict[bytes, int] = {}
        for e in self.entries.values():
            chain = []
            cur = e
            while cur is not None and cur.key not in done:
                chain.append(cur)
                cur = self.entries.get(cur.parent)
            d = done[cur.key] + 1 if cur is not None else 0
            for c in reversed(chain):
                c.depth = d
                done[c.key] = d
                d += 1

    def now(self) -> float:
        return time.monotonic()
