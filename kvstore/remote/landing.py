"""WarmLanding: the warm slots that pages read from the remote tier land in before they are cached.

A fetch reserves slots (outside the index, so nothing else sees or evicts them), has the backend
receive each record's page straight into its slot (and its head beside it: in the room warm leaves
before the slot's page, when it leaves one, else apart), verifies it where it
landed (kvstore.pages.record.check_landed), then adopts the good ones into the index as one chain and
frees the rest. No page is copied after it arrives; a page that failed verification was never
indexed, so it is never served. What it is given is the store's narrow core: its lock, its mover,
its daemon (the bound on dirty pages: a fetched page is dirty until written to cold) and warm.
"""

from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from kvstore.pages.record import RecordHeader


class WarmLanding:
    def __init__(self, lock: threading.RLock, mover, daemon, warm, backpressure_timeout_s: float,
                 source_name: str = "remote"):
        self.lock, self.mover, self.daemon, self.warm = lock, mover, daemon, warm
        self.timeout_s, self.source_name = backpressure_timeout_s, source_name

    @property
    def area(self) -> tuple[np.ndarray, int]:
        """Warm's memory (flat bytes: where every target lies) and the room before each slot's page
        that a whole record may land in (warm's head_room)."""
        return self.warm.buffer.numpy(), self.warm.head_room

    def reserve(self, n: int) -> list[tuple[int, np.ndarray]]:
        """Up to n reserved warm slots and their bytes (flat uint8 views), fewer when warm is full."""
        with self.lock:   # slots taken from the pool but not indexed: nothing else sees or evicts them
            self.mover.make_room(self.mover.stage, min(n, self.warm.num_slots))
            k = min(n, self.warm.pool.num_free)
            slots = self.warm.alloc(k) if k else []
            return [(s, t.numpy()) for s, t in zip(slots, self.warm.targets(slots))]

    def adopt(self, headers: Sequence[RecordHeader], slots: Sequence[int]) -> int:
        """Cache the verified pages in these reserved slots (a chain whose first parent is cached or
        the root) as far as the bound on dirty pages lets it; frees every slot it does not keep and
        returns how many of the chain are now cached."""
        kept: set[int] = set()

        def place(i: int) -> int:   # the page already lies in its slot
            kept.add(slots[i])
            return slots[i]

        def add(room: int) -> int:
            done = self.mover.add_chain(headers[:room], place, self.source_name)
            self.warm.evict([s for s in slots if s not in kept])   # under the lock, as add_chain
            return done
        return self.daemon.take_room(len(headers), self.timeout_s, add)

    def release(self, slots: Sequence[int]) -> None:
        """Free reserved slots nothing was adopted into."""
        if slots:
            with self.lock:
                self.warm.evict(slots)
