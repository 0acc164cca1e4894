"""Eviction policies: which unreferenced, unpinned pages leave a tier first.

A policy is a sort key over PageEntry: the candidates with the smallest keys go first.
Plugins add policies through the entry point group `kvstore.eviction_policies`
(an object with `name` and `key(entry)`).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Callable, Iterable

from kvstore.registry import Registry

if TYPE_CHECKING:
    from kvstore.index import PageEntry

POLICIES: Registry[Callable[["PageEntry"], tuple]] = Registry("eviction_policy", "kvstore.eviction_policies")


@POLICIES.register("lru")
def lru(e: "PageEntry") -> tuple:
    """Least recently used first (a released sequence's tail is older than its head)."""
    return (e.last_access,)


@POLICIES.register("lfu")
def lfu(e: "PageEntry") -> tuple:
    """Fewest hits first, then least recently used."""
    return (e.hits, e.last_access)


@POLICIES.register("refcount")
def refcount(e: "PageEntry") -> tuple:
    """Lowest reference count first: live holders plus cached pages that extend this one."""
    return (e.refcount + e.children, e.last_access)


@POLICIES.register("prefix_aware")
def prefix_aware(e: "PageEntry") -> tuple:
    """Protect long and highly reused prefixes: leaves first, then by hits x depth, then LRU."""
    return (e.children > 0, (e.hits + 1) * (e.depth + 1), e.last_access)


def policy_names() -> list[str]:
    return POLICIES.names()


def pick(policy: str, candidates: Iterable["PageEntry"], n: int) -> list["PageEntry"]:
    """The n candidates this policy evicts first, in order."""
    return heapq.nsmallest(n, candidates, key=POLICIES.get(policy))
