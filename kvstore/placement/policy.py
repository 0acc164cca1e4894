"""Eviction policies: which unreferenced, unpinned pages leave a tier first.

A policy is a sort key over PageEntry: the candidates with the smallest keys go first, ties in
insertion order (`PageEntry.seq`). Plugins add policies through the entry point group
`kvstore.eviction_policies` (an object with `name` and `key(entry)`). PageIndex keeps each tier
in each policy's order in a VictimQueue, so choosing a victim never scans the tier.
"""

from __future__ import annotations

import heapq
from typing import Callable, Iterable, Iterator

from kvstore.placement.entry import PageEntry
from kvstore.placement.registry import Registry

POLICIES: Registry[Callable[[PageEntry], tuple]] = Registry("eviction_policy", "kvstore.eviction_policies")


@POLICIES.register("lru")
def lru(e: PageEntry) -> tuple:
    """Least recently used first (a released sequence's tail is older than its head)."""
    return (e.last_access,)


@POLICIES.register("lfu")
def lfu(e: PageEntry) -> tuple:
    """Fewest hits first, then least recently used."""
    return (e.hits, e.last_access)


@POLICIES.register("refcount")
def refcount(e: PageEntry) -> tuple:
    """Lowest reference count first: live holders plus cached pages that extend this one."""
    return (e.refcount + e.children, e.last_access)


@POLICIES.register("prefix_aware")
def prefix_aware(e: PageEntry) -> tuple:
    """Protect long and highly reused prefixes: leaves first, then by hits x depth, then LRU."""
    return (e.children > 0, (e.hits + 1) * (e.depth + 1), e.last_access)


def policy_names() -> list[str]:
    return POLICIES.names()


def pick(policy: str, candidates: Iterable[PageEntry], n: int) -> list[PageEntry]:
    """The n candidates this policy evicts first, in order."""
    return heapq.nsmallest(n, candidates, key=POLICIES.get(policy))


class VictimQueue:
    """One tier's entries in one policy's order: a heap of (key, seq, stamp, entry), invalidated lazily.

    The owner (PageIndex) gives an entry a new `stamp` whenever it changes and pushes it again
    where it is `wanted` (in the tier and not held there); an item whose stamp is not its entry's is
    stale. Stale and no-longer-wanted items are dropped when popped, or all at once when the heap
    outgrows twice `size()`. A key that grew without a new stamp is re-pushed when popped; a key
    must never shrink without one, or its entry would come out late.
    """

    def __init__(self, key: Callable[[PageEntry], tuple], wanted: Callable[[PageEntry], bool],
                 size: Callable[[], int]):
        self.key, self.wanted, self.size = key, wanted, size
        self.heap: list[tuple] = []

    def __len__(self) -> int:
        return len(self.heap)

    def push(self, e: PageEntry, key: tuple) -> None:
        heapq.heappush(self.heap, (key, e.seq, e.stamp, e))
        if len(self.heap) > 2 * self.size() + 64:
            self.rebuild(item[3] for item in self.heap if item[2] == item[3].stamp)

    def rebuild(self, entries: Iterable[PageEntry]) -> None:
        self.heap = [(self.key(e), e.seq, e.stamp, e) for e in entries if self.wanted(e)]
        heapq.heapify(self.heap)

    def first(self, n: int, ok: Callable[[PageEntry], bool]) -> list[PageEntry]:
        """Up to n wanted entries satisfying ok, smallest key first; the queue is left as it was."""
        out, seen = [], []
        if n <= 0:
            return out
        try:
            for item in self._live():
                seen.append(item)
                if ok(item[3]):
                    out.append(item[3])
                    if len(out) >= n:
                        break
        finally:
            for item in seen:
                heapq.heappush(self.heap, item)
        return out

    def _live(self) -> Iterator[tuple]:
        """Pop live items in order, dropping stale ones and re-pushing those whose key grew."""
        heap = self.heap
        while heap:
            item = heapq.heappop(heap)
            key, seq, stamp, e = item
            if stamp != e.stamp or not self.wanted(e):
                continue
            now = self.key(e)
            if now != key:
                heapq.heappush(heap, (now, seq, stamp, e))
                continue
            yield item
