"""PageEntry: one page's record in the index: where it lives, who holds it, how it has been used.

PageIndex (index.py) owns the entries and keeps their links, queues and residency exact; the
eviction policies (policy.py) read them as sort keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class PageEntry:
    key: bytes
    parent: bytes
    namespace: bytes
    tokens: bytes                # int32 LE token ids of this page
    depth: int = 0               # page index in its sequence
    where: dict = field(default_factory=dict)   # tier name -> handle (slot; True in a keyed tier), fastest first
    refcount: int = 0
    leases: int = 0              # holders of the warm copy
    writing: bool = False        # a cold write of this page is in flight: its warm copy stays
    stranded: str = ""           # why no lower tier can take it (cold_full, write_error): it may be dropped
    dirty_since: float = 0.0     # monotonic time it last joined the write-behind queue
    write_failures: int = 0      # failed cold writes of this page
    pin_until: float = 0.0       # monotonic deadline; 0 = not pinned
    hits: int = 0
    last_access: int = 0         # index tick
    kids: set = field(default_factory=set)
    seq: int = 0                 # insertion order: breaks ties between equal policy keys
    stamp: int = 0               # version of this entry's queue items (PageIndex._requeue)

    @property
    def children(self) -> int:
        return len(self.kids)

    # read-only views of `where` for the built-in tiers (the admin views and the services read them)
    @property
    def hot(self) -> int | None:
        return self.where.get("hot")

    @property
    def warm(self) -> int | None:
        return self.where.get("warm")

    @property
    def cold(self) -> bool:
        return "cold" in self.where

    @property
    def tier(self) -> str:
        """The fastest tier holding this page."""
        return next(iter(self.where), "cold")

    @property
    def residency(self) -> int:
        return len(self.where)

    def in_memory(self, memory: frozenset) -> bool:
        return not self.where.keys().isdisjoint(memory)

    def pinned(self, now: float) -> bool:
        return self.pin_until > now
