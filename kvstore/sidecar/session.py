"""Session: one sidecar client connection and the warm slots it holds (its leases).

Slots from alloc and get belong to their connection until put or release. They end when the
connection closes (the client died) or when it sends nothing for sidecar.lease_s (it hangs; any
request renews the lease). Committed pages stay in the store either way.

A Session only keeps the books; the sidecar frees the slots in the store (release_warm).
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Sequence

from kvstore.errors import KVStoreError
from kvstore.pages.keys import Namespace


@dataclass(eq=False)
class Session:
    name: str
    writer: asyncio.StreamWriter
    namespace: Namespace | None = None
    allocated: set = field(default_factory=set)    # warm slots from alloc, not yet put
    leased: collections.Counter = field(default_factory=collections.Counter)   # warm slot -> leases
    last_seen: float = field(default_factory=time.monotonic)
    busy: bool = False

    @property
    def holds(self) -> int:
        return len(self.allocated) + sum(self.leased.values())

    def expired(self, now: float, lease_s: float) -> bool:
        """Holds slots, and has sent nothing for lease_s."""
        return not self.busy and bool(self.holds) and now - self.last_seen > lease_s

    def check_allocated(self, slots: Sequence[int]) -> None:
        """put: every slot must be this client's, from alloc, once."""
        stray = sorted(set(slots) - self.allocated)
        if stray or len(set(slots)) < len(slots):
            raise KVStoreError(f"put: warm slots {stray or slots} are not this client's (alloc them first; "
                               "they are taken back after sidecar.lease_s without a request)")

    def check_held(self, slots: Sequence[int]) -> collections.Counter:
        """release: every slot must be leased (as often as it is named) or allocated; returns the counts."""
        wanted = collections.Counter(slots)
        stray = sorted(slot for slot, n in wanted.items() if n > self.leased[slot] + (slot in self.allocated))
        if stray:
            raise KVStoreError(f"release: warm slots {stray} are not held by this client "
                               "(leases end after sidecar.lease_s without a request)")
        return wanted

    def forget(self, wanted: collections.Counter) -> None:
        """After release: end the leases first, then the allocations."""
        for slot, n in wanted.items():
            lease_n = min(n, self.leased[slot])
            self.leased[slot] -= lease_n
            if self.leased[slot] <= 0:
                del self.leased[slot]
            if n > lease_n:
                self.allocated.discard(slot)

    def take_all(self) -> list[int]:
        """Forget every slot this session holds and return them (to release in the store)."""
        slots = list(self.allocated) + list(self.leased.elements())
        self.allocated.clear()
        self.leased.clear()
        return slots
