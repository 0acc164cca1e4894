"""PageMover: moves pages between the tiers and decides what leaves a tier.

Caching is inclusive: promoting a page leaves its lower copies in place, so demoting it again
is only a free. Referenced pages never leave hot, leased pages never leave warm, pinned pages
never leave any tier; a cold record is deleted only when none of its children is in cold
(leaves first).

Two speeds, so that no caller ever holds the store's lock across disk I/O:
- memory (any thread, under the lock): `ensure_hot`, `ensure_warm_copy`, `make_room`, `demote`.
  They never read or write LMDB. A page with no lower copy moves hot -> warm when warm has
  room (freeing clean warm pages for it), and otherwise leaves the store if it is a leaf (a
  cached page dropped, never a wrong one); a warm page without a cold copy is dirty and stays
  until write-behind (PageIO) has made it durable.
- disk (PageIO's threads): `plan_write` -> DiskTier.put_many -> `finish_write`, and
  `plan_read` -> DiskTier.read_many -> `finish_read`, bracket the LMDB work; the plan and
  finish halves run under the lock, the I/O between them does not. Pages in flight are marked:
  a page being written keeps its warm copy (`writing`), a page being read owns its warm slot.

All methods run under the store's lock (TieredStore and PageIO call them); none takes a lock itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kvstore.errors import OutOfCapacity
from kvstore.index import PageEntry, PageIndex
from kvstore.record import PREFIX_BYTES, RecordHeader
from kvstore.spec import KVSpec
from kvstore.tiers.device import DeviceTier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier

TIERS = ("hot", "warm", "cold")
DIRECTIONS = ("hot_to_warm", "warm_to_hot", "warm_to_cold", "cold_to_warm", "hot_to_cold", "cold_to_hot",
              "peer_to_warm")


@dataclass
class WritePlan:
    """Pages on their way to cold: headers and payload views that stay valid until finish_write."""

    entries: list[PageEntry]
    items: list[tuple[RecordHeader, object]]
    nbytes: int


@dataclass
class ReadPlan:
    """Cold pages on their way to warm: each owns the warm slot it is read into."""

    entries: list[PageEntry]
    slots: list[int]


class PageMover:
    def __init__(self, spec: KVSpec, hot: DeviceTier, warm: HostTier, cold: DiskTier | None,
                 index: PageIndex, policy: str, emit: Callable[[str, bytes, str], None]):
        self.spec, self.hot, self.warm, self.cold, self.index = spec, hot, warm, cold, index
        self.policy = policy
        self.emit = emit
        self.unindexed: set[bytes] = set()   # cold records that are damaged or of another geometry
        self.counters = {t: {"hits": 0, "misses": 0, "evictions": 0, "promotions": 0} for t in TIERS}
        self.bytes_moved = dict.fromkeys(DIRECTIONS, 0)
        self.corrupt_pages = 0
        self.dropped_pages = 0               # cached pages that left the store for lack of room
        self.reading: set[int] = set()       # warm slots owned by reads in flight
        self.deleting: set[bytes] = set()    # cold records unindexed, their delete not yet durable

    def record_bytes(self, e: PageEntry) -> int:
        return PREFIX_BYTES + len(self.header(e).pack()) + self.spec.page_bytes

    def header(self, e: PageEntry) -> RecordHeader:
        return RecordHeader(e.key, e.parent, e.namespace, e.tokens, self.spec.fingerprint, self.spec.page_bytes)

    # up, at memory speed
    def ensure_hot(self, e: PageEntry) -> bool:
        """Give e a hot copy (from warm). False when its only copy is in cold: load it first (PageIO).
        Raises OutOfCapacity when hot has no room."""
        if e.hot is not None:
            self.counters["hot"]["hits"] += 1
            return True
        self.counters["hot"]["misses"] += 1
        if e.warm is None:
            return False
        e.leases += 1   # its warm copy must survive making room in hot
        try:
            room = self.make_room("hot", 1)
        finally:
            e.leases -= 1
            self.index.changed(e)
        if not room:
            raise OutOfCapacity(f"out of KV capacity: cannot promote a page, all {self.hot.num_pages} "
                                "hot pages are referenced, pinned or allocated")
        [slot] = self.hot.pool.alloc(1)
        self.counters["warm"]["hits"] += 1
        self.hot.load_from([slot], self.warm, [e.warm])
        self.bytes_moved["warm_to_hot"] += self.spec.page_bytes
        self.index.set_hot(e, slot)
        self.counters["hot"]["promotions"] += 1
        self.emit("add", e.key, "hot")
        return True

    def ensure_warm_copy(self, e: PageEntry) -> bool:
        """Give e a warm copy itself (from hot). False when warm has no room or its only copy is cold."""
        if e.warm is not None:
            self.counters["warm"]["hits"] += 1
            return True
        self.counters["warm"]["misses"] += 1
        if e.hot is None or not self.make_room("warm", 1, {e.key}):
            return False
        [slot] = self.warm.pool.alloc(1)
        self.hot.save_to([e.hot], self.warm, [slot])
        self.bytes_moved["hot_to_warm"] += self.spec.page_bytes
        self.index.set_warm(e, slot)
        self.emit("add", e.key, "warm")
        return True

    def page_bytes(self, e: PageEntry) -> bytes | None:
        """A page-first byte copy of e's page from memory (None when it is only in cold)."""
        if e.warm is not None:
            return self.warm.raw[e.warm].numpy().tobytes()
        if e.hot is not None:
            return self.hot.gather([e.hot]).cpu().view(torch.uint8).numpy().tobytes()
        return None

    # cold reads: plan under the lock, read outside it, finish under it
    def plan_read(self, entries: list[PageEntry]) -> ReadPlan:
        """Warm slots for those of `entries` (a chain, in order) that are only in cold; stops at the
        first page that is gone or finds no warm room. Pages already in memory are skipped."""
        todo, slots = [], []
        for e in entries:
            if e.key not in self.index or e.hot is not None or e.warm is not None:
                continue
            if not e.cold or not self.make_room("warm", 1, {x.key for x in entries}):
                break
            [slot] = self.warm.pool.alloc(1)
            self.reading.add(slot)
            todo.append(e)
            slots.append(slot)
        return ReadPlan(todo, slots)

    def finish_read(self, plan: ReadPlan, ok: list[bool]) -> list[PageEntry]:
        """Index what was read into warm; a bad record is a counted miss, never served. Returns the
        entries now in warm from this plan, in order, up to the first failure."""
        done, failed = [], False
        for e, slot, good in zip(plan.entries, plan.slots, ok):
            self.reading.discard(slot)
            alive = e.key in self.index and e.warm is None
            if not good:
                self.mark_corrupt(e)
            if failed or not good or not alive:
                failed = failed or not good
                self.warm.pool.free([slot])
                continue
            self.index.set_warm(e, slot)
            self.counters["cold"]["hits"] += 1
            self.counters["warm"]["promotions"] += 1
            self.bytes_moved["cold_to_warm"] += self.spec.page_bytes
            self.emit("add", e.key, "warm")
            done.append(e)
        return done

    def mark_corrupt(self, e: PageEntry) -> None:
        """e's cold record failed verification: it is no longer a copy of e (left for `kvstore fsck`)."""
        self.counters["cold"]["misses"] += 1
        self.corrupt_pages += 1
        self.unindexed.add(e.key)  # deleted first when cold needs room
        if e.key in self.index and e.cold:
            self.index.set_cold(e, False)
            self.emit("remove", e.key, "cold")
            if not e.residency:
                self.index.remove(e)

    # cold writes
    def plan_write(self, entries: list[PageEntry]) -> WritePlan:
        """Headers and payloads of those entries that are in memory, not in cold and not already being
        written; each is marked `writing` (its warm copy stays put) until finish_write."""
        todo = [e for e in entries if e.key in self.index and not e.cold and not e.writing
                and e.key not in self.deleting and (e.warm is not None or e.hot is not None)]
        from_hot = [e for e in todo if e.warm is None]
        gathered = self.hot.gather([e.hot for e in from_hot]).cpu() if from_hot else None
        items, j = [], 0
        for e in todo:
            e.writing = True
            if e.warm is not None:
                payload = self.warm.raw[e.warm].numpy()
            else:
                payload = gathered[j].view(torch.uint8).reshape(-1).numpy()
                j += 1
            items.append((self.header(e), payload))
        nbytes = sum(PREFIX_BYTES + len(h.pack()) + self.spec.page_bytes for h, _ in items)
        return WritePlan(todo, items, nbytes)

    def finish_write(self, plan: WritePlan, ok: bool) -> list[PageEntry]:
        """Mark the plan's pages cold-resident once their commit is durable; returns them."""
        done = []
        for e in plan.entries:
            e.writing = False
            self.index.changed(e)
            if not ok:
                continue
            direction = "warm_to_cold" if e.warm is not None else "hot_to_cold"
            self.bytes_moved[direction] += self.spec.page_bytes
            if e.key not in self.index:   # dropped meanwhile: the record is orphaned, delete it later
                self.unindexed.add(e.key)
                continue
            self.index.set_cold(e, True)
            self.emit("add", e.key, "cold")
            done.append(e)
        return done

    def cold_victims(self, nbytes: int, exclude: set | None = None) -> tuple[list[bytes], bool]:
        """Unindex cold records until `nbytes` more fit (damaged ones first); returns the keys to
        delete (by the caller, outside the lock) and whether that makes enough room. The room is
        what cold.max_bytes leaves, or less when the disk (or the map) holds less."""
        if self.cold is None:
            return [], False
        need = nbytes - self.cold.room_bytes()
        keys, freed = self._unindex_cold(need, exclude)
        return keys, freed >= need

    def cold_room(self, nbytes: int, exclude: set | None = None) -> list[bytes]:
        """Unindex cold records of at least `nbytes` in all, whatever the room looks like: for a disk or
        map that filled up anyway. Returns the keys to delete (by the caller, outside the lock)."""
        return self._unindex_cold(nbytes, exclude)[0] if self.cold is not None else []

    def _unindex_cold(self, nbytes: int, exclude: set | None) -> tuple[list[bytes], int]:
        """Damaged records (size unknown, counted as none), then the cold policy's victims (leaves
        first) until `nbytes` are freed or none is left; (keys, bytes freed)."""
        keys, freed = list(self.unindexed), 0
        self.deleting.update(self.unindexed)
        self.unindexed.clear()
        while freed < nbytes:
            victims = self.victims("cold", 8, exclude)
            if not victims:
                break
            for e in victims:
                freed += self.record_bytes(e)
                keys.append(e.key)
            self.remove_copies(victims, "cold")
        return keys, freed

    # down
    def evictable(self, e: PageEntry, tier: str, now: float) -> bool:
        if e.pinned(now) or (tier == "hot" and e.refcount) or (tier == "warm" and (e.leases or e.writing)):
            return False
        if tier == "cold":
            if any(self.index.entries[k].cold for k in e.kids if k in self.index.entries):
                return False  # leaves before parents
            return e.residency > 1 or not e.kids
        return True

    def victims(self, tier: str, n: int, exclude: set | None = None, leaves: bool = False) -> list[PageEntry]:
        now = self.index.now()
        return self.index.victims(tier, n, lambda e: self.evictable(e, tier, now)
                                  and (exclude is None or e.key not in exclude)
                                  and not (leaves and e.kids), self.policy)

    def make_room(self, tier: str, n: int, exclude: set | None = None, drop: bool = True) -> bool:
        """Free slots in hot or warm until n are free, at memory speed; False if that is impossible now.
        Without `drop`, no page leaves the store (only pages with a copy elsewhere are freed)."""
        pool = self.hot.pool if tier == "hot" else self.warm.pool
        while pool.num_free < n:
            short = n - pool.num_free
            # a parent with nowhere lower to go stays; dropping leaves first frees it for the next round
            if not (self.demote(self.victims(tier, short, exclude), tier, drop)
                    or self.demote(self.victims(tier, short, exclude, leaves=True), tier, drop)):
                break
        return pool.num_free >= n

    def demote(self, victims: list[PageEntry], tier: str, drop: bool = True) -> int:
        """Move victims out of hot or warm at memory speed; returns how many left it.

        A victim leaves when a lower copy exists (warm or cold below hot; cold, or a hot copy, for
        warm), when hot can copy it to warm, or, with no copy elsewhere and `drop`, when it is a leaf
        (dropped). Other pages stay (write-behind can make them clean)."""
        other = "warm" if tier == "hot" else "hot"
        done = [e for e in victims if e.cold or getattr(e, other) is not None]
        need = [e for e in victims if not (e.cold or getattr(e, other) is not None)]
        if tier == "hot" and need and self.warm.num_slots:
            self.make_room("warm", min(len(need), self.warm.num_slots), {e.key for e in victims}, drop)
            k = min(len(need), self.warm.pool.num_free)
            to_warm, need = need[:k], need[k:]
            if to_warm:
                slots = self.warm.pool.alloc(k)
                self.hot.save_to([e.hot for e in to_warm], self.warm, slots)
                self.bytes_moved["hot_to_warm"] += k * self.spec.page_bytes
                for e, s in zip(to_warm, slots):
                    self.index.set_warm(e, s)
                    self.emit("add", e.key, "warm")
                done += to_warm
        dropped = [e for e in need if drop and not e.kids and not e.writing]  # fits nowhere: leaves leave the store
        self.dropped_pages += len(dropped)
        self.remove_copies(done + dropped, tier)
        return len(done) + len(dropped)

    def remove_copies(self, entries: list[PageEntry], tier: str) -> None:
        """Drop entries' copies in `tier` (a cold record's delete is the caller's); an entry with no
        copy left leaves the index."""
        for e in entries:
            if tier == "hot":
                self.hot.pool.free([e.hot])
                self.index.set_hot(e, None)
            elif tier == "warm":
                self.warm.pool.free([e.warm])
                self.index.set_warm(e, None)
            else:
                self.index.set_cold(e, False)
                self.deleting.add(e.key)   # the caller deletes the record (PageIO.drop_cold)
            self.counters[tier]["evictions"] += 1
            self.emit("remove", e.key, tier)
        for e in entries:
            if not e.residency:
                self.index.remove(e)
