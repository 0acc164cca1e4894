"""PageMover: moves pages between the tiers and decides what leaves a tier.

Caching is inclusive: promoting a page leaves its lower copies in place, so demoting it again
is only a free. Demoting copies a page down where no lower copy exists: hot -> warm, what does
not fit in warm -> cold, what fits nowhere leaves the store if it is a leaf (no cached page
extends it) and otherwise stays. Referenced pages never leave hot, leased pages never leave
warm, pinned pages never leave any tier; a cold record is deleted only when none of its
children is in cold (leaves first).

All methods run under the store's lock (TieredStore calls them); none takes a lock itself.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvstore.errors import KVStoreError, OutOfCapacity
from kvstore.index import PageEntry, PageIndex
from kvstore.policy import pick
from kvstore.record import PREFIX_BYTES, RecordHeader
from kvstore.spec import KVSpec
from kvstore.tiers.device import DeviceTier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier

TIERS = ("hot", "warm", "cold")
DIRECTIONS = ("hot_to_warm", "warm_to_hot", "warm_to_cold", "cold_to_warm", "hot_to_cold", "cold_to_hot",
              "peer_to_warm")


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

    # up
    def ensure_hot(self, e: PageEntry) -> bool:
        """Give e a hot copy (promoting from warm or cold). False if its cold record is bad."""
        if e.hot is not None:
            self.counters["hot"]["hits"] += 1
            return True
        self.counters["hot"]["misses"] += 1
        if not self.make_room("hot", 1):
            raise OutOfCapacity(f"out of KV capacity: cannot promote a page, all {self.hot.num_pages} "
                                "hot pages are referenced, pinned or allocated")
        [slot] = self.hot.pool.alloc(1)
        if e.warm is not None:
            self.counters["warm"]["hits"] += 1
            self.hot.load_from([slot], self.warm, [e.warm])
            self.bytes_moved["warm_to_hot"] += self.spec.page_bytes
        else:
            self.counters["warm"]["misses"] += 1
            staging = torch.empty(self.spec.page_bytes, dtype=torch.uint8)
            if not self.read_cold(e, staging):
                self.hot.pool.free([slot])
                return False
            self.hot.scatter([slot], staging.view(self.spec.torch_dtype))
            self.bytes_moved["cold_to_hot"] += self.spec.page_bytes
        self.index.set_hot(e, slot)
        self.counters["hot"]["promotions"] += 1
        self.emit("add", e.key, "hot")
        return True

    def ensure_warm(self, e: PageEntry) -> bool:
        """Give e a copy in hot or warm (prefetch from cold). False if there is no room or it is bad."""
        if e.hot is not None or e.warm is not None:
            return True
        if not self.make_room("warm", 1):
            return False
        [slot] = self.warm.pool.alloc(1)
        if not self.read_cold(e, self.warm.raw[slot]):
            self.warm.pool.free([slot])
            return False
        self.index.set_warm(e, slot)
        self.bytes_moved["cold_to_warm"] += self.spec.page_bytes
        self.counters["warm"]["promotions"] += 1
        self.emit("add", e.key, "warm")
        return True

    def ensure_warm_copy(self, e: PageEntry) -> bool:
        """Give e a warm copy itself (from hot, else cold). False if warm has no room or the record is bad."""
        if e.warm is not None:
            self.counters["warm"]["hits"] += 1
            return True
        self.counters["warm"]["misses"] += 1
        if not self.make_room("warm", 1):
            return False
        [slot] = self.warm.pool.alloc(1)
        if e.hot is not None:
            self.hot.save_to([e.hot], self.warm, [slot])
            self.bytes_moved["hot_to_warm"] += self.spec.page_bytes
        elif self.read_cold(e, self.warm.raw[slot]):
            self.bytes_moved["cold_to_warm"] += self.spec.page_bytes
            self.counters["warm"]["promotions"] += 1
        else:
            self.warm.pool.free([slot])
            return False
        self.index.set_warm(e, slot)
        self.emit("add", e.key, "warm")
        return True

    def page_bytes(self, e: PageEntry):
        """A page-first byte copy of e's page from its fastest tier (None if its cold record is bad)."""
        if e.warm is not None:
            return self.warm.raw[e.warm].numpy().tobytes()
        if e.hot is not None:
            return self.hot.gather([e.hot]).cpu().view(torch.uint8).numpy().tobytes()
        out = torch.empty(self.spec.page_bytes, dtype=torch.uint8)
        return out.numpy().tobytes() if self.read_cold(e, out) else None

    def read_cold(self, e: PageEntry, out: torch.Tensor) -> bool:
        """Read and verify e's cold record into `out`; a bad record is a counted miss, never served."""
        if self.cold is None or not e.cold:
            return False
        if self.cold.read(e.key, e.namespace, e.tokens, self.spec.fingerprint, out):
            self.counters["cold"]["hits"] += 1
            return True
        self.counters["cold"]["misses"] += 1
        self.corrupt_pages += 1
        self.unindexed.add(e.key)  # left in place for `kvstore fsck`; deleted first when room is needed
        e.cold = False
        self.emit("remove", e.key, "cold")
        if not e.residency:
            self.index.remove(e)
        return False

    # down
    def evictable(self, e: PageEntry, tier: str, now: float) -> bool:
        if e.pinned(now) or (tier == "hot" and e.refcount) or (tier == "warm" and e.leases):
            return False
        if tier == "cold":
            if any(self.index.entries[k].cold for k in e.kids if k in self.index.entries):
                return False  # leaves before parents
            return e.residency > 1 or not e.kids
        return True

    def victims(self, tier: str, n: int, exclude: set | None = None, leaves: bool = False) -> list[PageEntry]:
        now = self.index.now()
        cands = (e for e in self.index.in_tier(tier)
                 if self.evictable(e, tier, now) and (exclude is None or e.key not in exclude)
                 and not (leaves and e.kids))
        return pick(self.policy, cands, n)

    def make_room(self, tier: str, n: int, exclude: set | None = None) -> bool:
        """Free slots in hot or warm until n are free; False if that is impossible."""
        pool = self.hot.pool if tier == "hot" else self.warm.pool
        while pool.num_free < n:
            short = n - pool.num_free
            # a parent with nowhere lower to go stays; dropping leaves first frees it for the next round
            if not (self.demote(self.victims(tier, short, exclude), tier)
                    or self.demote(self.victims(tier, short, exclude, leaves=True), tier)):
                break
        return pool.num_free >= n

    def make_room_cold(self, nbytes: int, exclude: set | None = None) -> bool:
        if self.cold is None:
            return False
        limit = self.cold.capacity_bytes
        if self.cold.used_bytes + nbytes > limit and self.unindexed:
            self.cold.delete_many(list(self.unindexed)).result()
            self.unindexed.clear()
        while self.cold.used_bytes + nbytes > limit:
            victims = self.victims("cold", 8, exclude)
            if not victims:
                return False
            self.demote(victims, "cold")
        return True

    def demote(self, victims: list[PageEntry], tier: str) -> int:
        """Move victims out of `tier`; returns how many left it."""
        if tier == "cold":
            self.remove_copies(victims, "cold")
            return len(victims)
        other = "warm" if tier == "hot" else "hot"
        done = [e for e in victims if e.cold or getattr(e, other) is not None]
        need = [e for e in victims if not (e.cold or getattr(e, other) is not None)]
        if tier == "hot" and need and self.warm.num_slots:
            self.make_room("warm", min(len(need), self.warm.num_slots), {e.key for e in victims})
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
        if need:
            written = self.write_cold(need, make_room=True)
            done += written
            need = need[len(written):]
        done += [e for e in need if not e.kids]  # fits nowhere: leaves leave the store
        self.remove_copies(done, tier)
        return len(done)

    def evict_entries(self, entries: list[PageEntry], tiers: tuple[str, ...]) -> int:
        """Demote each entry out of each of `tiers` where it may leave; returns how many copies left."""
        moved = 0
        for tier in tiers:
            for e in entries:
                in_tier = e.hot is not None if tier == "hot" else e.warm is not None if tier == "warm" else e.cold
                if in_tier and e.key in self.index and self.evictable(e, tier, self.index.now()):
                    moved += self.demote([e], tier)
        return moved

    def write_cold(self, entries: list[PageEntry], make_room: bool) -> list[PageEntry]:
        """Write entries' pages (from warm, else hot) to cold; returns the prefix of entries written."""
        if self.cold is None or not entries:
            return []
        headers = [RecordHeader(e.key, e.parent, e.namespace, e.tokens, self.spec.fingerprint,
                                self.spec.page_bytes) for e in entries]
        sizes = [PREFIX_BYTES + len(h.pack()) + self.spec.page_bytes for h in headers]
        keep = len(entries)
        exclude = {e.key for e in entries}
        while keep and not (self.make_room_cold(sum(sizes[:keep]), exclude) if make_room
                            else self.cold.used_bytes + sum(sizes[:keep]) <= self.cold.capacity_bytes):
            keep -= 1
        entries, headers = entries[:keep], headers[:keep]
        if not entries:
            return []
        from_hot = [e for e in entries if e.warm is None]
        gathered = self.hot.gather([e.hot for e in from_hot]).cpu() if from_hot else None
        payloads, j = [], 0
        for e in entries:
            if e.warm is not None:
                payloads.append(self.warm.raw[e.warm].numpy())
                self.bytes_moved["warm_to_cold"] += self.spec.page_bytes
            else:
                payloads.append(gathered[j].view(torch.uint8).reshape(-1).numpy())
                self.bytes_moved["hot_to_cold"] += self.spec.page_bytes
                j += 1
        try:
            self.cold.put_many(list(zip(headers, payloads))).result()
        except KVStoreError:
            return []
        for e in entries:
            e.cold = True
            self.emit("add", e.key, "cold")
        return entries

    def remove_copies(self, entries: list[PageEntry], tier: str) -> None:
        """Drop entries' copies in `tier`; an entry with no copy left leaves the index."""
        doomed = []
        for e in entries:
            if tier == "hot":
                self.hot.pool.free([e.hot])
                self.index.set_hot(e, None)
            elif tier == "warm":
                self.warm.pool.free([e.warm])
                self.index.set_warm(e, None)
            else:
                doomed.append(e.key)
                e.cold = False
            self.counters[tier]["evictions"] += 1
            self.emit("remove", e.key, tier)
        if doomed:
            self.cold.delete_many(doomed).result()
        for e in entries:
            if not e.residency:
                self.index.remove(e)
