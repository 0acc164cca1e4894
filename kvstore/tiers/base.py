"""Tier: a bounded place where whole pages live.

Rules every tier keeps:
- It never holds more than `capacity_bytes`; a write that would exceed it is refused,
  never squeezed in. Making room is the caller's job (TieredStore picks what to evict).
- It stores bytes and knows nothing of keys' meaning, refcounts or pins: TieredStore's
  index decides what lives where. Callers must hold the store lock while they mutate a tier.
- Hot and warm are pools of fixed slots (SlotPool): `alloc` hands out slots, `free` gives
  them back; a slot's bytes are undefined until written. Cold is addressed by page key.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod

from kvstore.spec import KVSpec


class Tier(ABC):
    name: str

    def __init__(self, spec: KVSpec):
        self.spec = spec

    @property
    @abstractmethod
    def capacity_bytes(self) -> int: ...

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    def close(self) -> None:
        """Release resources. The tier must not be used afterwards."""


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
