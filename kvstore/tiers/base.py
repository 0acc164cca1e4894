"""Tier: a bounded place where whole pages live, one level of the store's ordered list of tiers.

The store keeps its tiers in an ordered list, fastest first (hot, warm, then cold; a plugin's tier
may sit anywhere below warm), and PageMover walks that list through this one interface:

    contains(handles) -> list[bool]
    read_into(handles, dst, dst_slots) -> Future[list[bool]]   # this tier's pages into dst's slots
    write_from(src, src_slots, handles) -> Future[None]        # src's slots into this tier
    evict(handles) -> Future[None]

All four are batched. A handle names a page in the tier: a slot number in a slotted tier (hot,
warm), the page's key in a keyed tier (cold) - where read_into and write_from take the pages'
RecordHeaders instead, what a read verifies and a write stores. Copies end in a slotted tier's
slots: every `dst` of read_into, and every `src` of write_from, is a SlotTier.

Rules every tier keeps:
- It never holds more than `capacity_bytes`; a write that would exceed it is refused,
  never squeezed in. Making room is the caller's job (PageMover picks what to evict).
- It stores bytes and knows nothing of keys' meaning, refcounts or pins: the store's index
  decides what lives where. Callers hold the store lock while they mutate a slotted tier.
- Slotted tiers are pools of fixed slots (SlotPool): `alloc` hands out slots, `evict` gives
  them back; a slot's bytes are undefined until written. Their futures are done when the call
  returns (memory speed).
- A tier with `io` set does I/O: the store never calls it under its lock (PageIO's threads do).
  `write_from` and `evict` return at once and resolve when durable; `read_into` runs on its
  caller's (worker) thread and returns a done future; a False read leaves its slot undefined.
- A tier with `writable` unset is a read-only source (a peer's pages): only contains and read_into.
- Tiers are built by name from the registry `TIER_BACKENDS` (entry point group `kvstore.tiers`):
  `TIER_BACKENDS.get(name)(role, spec, settings)` returns the tier for one level (see tiers/build.py).
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Callable, Sequence

import numpy as np

from kvstore.pages.spec import KVSpec
from kvstore.placement.registry import Registry

TIER_BACKENDS: Registry[Callable[..., "Tier"]] = Registry("tier backend", "kvstore.tiers")


def done(value=None) -> Future:
    """A future that has already resolved to `value` (work done at memory speed)."""
    f: Future = Future()
    f.set_result(value)
    return f


class Tier(ABC):
    name: str           # its role in the store: hot, warm, cold, or a plugin's own
    keyed = False       # handles are page keys (reads and writes take RecordHeaders), not slots
    io = False          # its reads and writes are I/O: never under the store's lock
    writable = True     # False: a read-only source

    def __init__(self, spec: KVSpec):
        self.spec = spec

    @property
    @abstractmethod
    def capacity_bytes(self) -> int: ...

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    @abstractmethod
    def contains(self, handles: Sequence) -> list[bool]:
        """Whether each handle holds a page now."""

    @abstractmethod
    def read_into(self, handles: Sequence, dst: "SlotTier", dst_slots: Sequence[int]) -> Future:
        """Copy these pages into dst's slots; the future gives a bool per page (False: not copied)."""

    def write_from(self, src: "SlotTier", src_slots: Sequence[int], handles: Sequence) -> Future:
        """Copy src's slots into these handles of this tier; the future resolves once they are stored."""
        raise NotImplementedError(f"the {self.name} tier is read-only")

    def evict(self, handles: Sequence) -> Future:
        """Forget these pages (free the slots, delete the records)."""
        raise NotImplementedError(f"the {self.name} tier is read-only")

    def close(self) -> None:
        """Release resources. The tier must not be used afterwards."""


class SlotTier(Tier):
    """A tier of fixed slots in memory: `pool` hands them out, `payloads`/`targets` expose their bytes."""

    pool: "SlotPool"

    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    @property
    def used_bytes(self) -> int:
        return self.pool.num_used * self.spec.page_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.pool.num_slots * self.spec.page_bytes

    def alloc(self, n: int) -> list[int] | None:
        return self.pool.alloc(n)

    def contains(self, handles: Sequence[int]) -> list[bool]:
        return [self.pool.is_used(s) for s in handles]

    def evict(self, handles: Sequence[int]) -> Future:
        self.pool.free(handles)
        return done()

    @abstractmethod
    def payloads(self, slots: Sequence[int]) -> list[np.ndarray]:
        """Page-first bytes of these slots in host memory ([page_bytes] uint8 each; views where possible),
        valid until the slots change."""

    @abstractmethod
    def store_pages(self, slots: Sequence[int], payloads: Sequence) -> None:
        """Write page-first bytes into these slots."""

    def read_into(self, handles: Sequence[int], dst: "SlotTier", dst_slots: Sequence[int]) -> Future:
        dst.store_pages(dst_slots, self.payloads(handles))
        return done([True] * len(handles))

    def write_from(self, src: "SlotTier", src_slots: Sequence[int], handles: Sequence[int]) -> Future:
        return src.read_into(src_slots, self, handles)


class SlotPool:
    """Fixed slots handed out lowest-index first, so a batch tends to be one contiguous run."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots))  # a heap; already ordered
        self._used = bytearray(num_slots)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n slots, or None (and nothing taken) when fewer than n are free."""
        if n > len(self._free):
            return None
        slots = [heapq.heappop(self._free) for _ in range(n)]
        for s in slots:
            self._used[s] = 1
        return slots

    def free(self, slots) -> None:
        for s in slots:
            if not self._used[s]:
                raise RuntimeError(f"slot {s} freed twice")
            self._used[s] = 0
            heapq.heappush(self._free, s)

    def is_used(self, slot: int) -> bool:
        return bool(self._used[slot])


def runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Group (src[i], dst[i]) pairs into runs (src_start, dst_start, length) where both are consecutive."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out
