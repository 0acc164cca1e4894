"""PageMover: moves pages between the tiers and decides what leaves a tier.

The tiers are an ordered list, fastest first, and the mover walks it through the one tier
interface (tiers/base.py: contains, read_into, write_from, evict). Roles follow the order: the
first tier (hot) holds referenced pages, the second (warm) leased ones and is where every load
lands; the first writable I/O tier (cold) is where write-behind makes pages durable; slotted
tiers below warm (a plugin's) take demoted pages at memory speed and are read back like cold.
A read-only source (a peer's pages, tiers/peer_pages.py) is read into warm by `admit`.

Caching is inclusive: promoting a page leaves its lower copies in place, so demoting it again
is only a free. Referenced pages never leave hot, leased pages never leave warm, pinned pages
never leave any tier; a cold record is deleted only when none of its children is in cold
(leaves first).

Two speeds, so that no caller ever holds the store's lock across disk I/O:
- memory (any thread, under the lock): `ensure`, `make_room`, `demote`, and reads from slotted
  tiers. They never read or write an I/O tier. A page leaving a slotted tier moves down to the
  next one when that can make room without dropping anything (a page demoted from hot stays
  cached in warm). A page without a cold copy is dirty (index.dirty, the write-behind queue) and
  stays in memory until write-behind (the Daemon) has made it durable: it never leaves the
  store, unless no lower tier can take it (no cold tier, or cold refused it: `stranded`); then
  a leaf is dropped, counted by reason.
- I/O (the Daemon's threads, through PageIO): `plan_write` -> `write` -> `finish_write`, and
  `plan_read` -> `read` -> `finish_read`, bracket the I/O; the plan and finish halves run under
  the lock, the I/O between them does not. Pages in flight are marked: a page being written keeps its memory
  copies below hot (`writing`), a page being read owns its warm slot.

Every event is counted by MoveStats (move_stats.py), through its one method.
All methods run under the store's lock (TieredStore and PageIO call them); none takes a lock itself.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Sequence

from kvstore.errors import OutOfCapacity
from kvstore.movement.move_stats import MoveStats, directions
from kvstore.pages.record import PREFIX_BYTES, RecordHeader
from kvstore.pages.spec import KVSpec
from kvstore.placement.index import TIERS, PageEntry, PageIndex
from kvstore.tiers.base import Tier

DIRECTIONS = directions(TIERS)


class Staged:
    """Page copies taken under the lock (views of slots marked `writing`, or gathered copies),
    the source a write reads from outside it."""

    def __init__(self, payloads: list):
        self._payloads = payloads

    def payloads(self, slots: Sequence[int]) -> list:
        return [self._payloads[i] for i in slots]


@dataclass
class WritePlan:
    """Pages on their way to cold: headers, their source tiers and payloads that stay valid until finish_write."""

    entries: list[PageEntry]
    items: list[tuple[RecordHeader, object]]
    nbytes: int
    sources: list[str]


@dataclass
class ReadPlan:
    """Pages on their way up to warm from lower tiers: each owns the warm slot it is read into.
    `ok` is known already for pages read from slotted tiers (at memory speed, while planning)."""

    entries: list[PageEntry]
    slots: list[int]
    sources: list[str]
    ok: list[bool | None]


class PageMover:
    def __init__(self, spec: KVSpec | None, tiers: Sequence[Tier], index: PageIndex, policy: str,
                 emit: Callable[[str, bytes, str], None], stats: MoveStats | None = None):
        self.spec, self.index, self.policy, self.emit = spec, index, policy, emit
        self.tiers: dict[str, Tier] = {t.name: t for t in tiers}
        self.names = index.tiers
        self.top, self.stage = self.names[0], self.names[1]        # hot, warm
        self.memory = frozenset(t for t in self.names if t not in index.keyed)   # slotted tiers
        self.durable = next((t.name for t in tiers if t.io and t.writable), None)   # cold
        self.stats = stats or MoveStats(self.names, spec.page_bytes if spec else 0)
        self.unindexed: set[bytes] = set()   # cold records that are damaged or of another geometry
        self.reading: set[int] = set()       # warm slots owned by reads in flight
        self.deleting: set[bytes] = set()    # cold records unindexed, their delete not yet durable

    @property
    def bytes_moved(self) -> dict[str, int]:
        return self.stats.bytes_moved

    def count(self, event: str, tier: str | None = None, pages: int = 1, to: str | None = None,
              reason: str | None = None) -> None:
        self.stats.count(event, tier, pages, to, reason)

    def record_bytes(self, e: PageEntry) -> int:
        return PREFIX_BYTES + len(self.header(e).pack()) + self.spec.page_bytes

    def header(self, e: PageEntry) -> RecordHeader:
        return RecordHeader(e.key, e.parent, e.namespace, e.tokens, self.spec.fingerprint, self.spec.page_bytes)

    def below(self, tier: str) -> str | None:
        """The next slotted tier under `tier`, where its demoted pages go at memory speed."""
        i = self.names.index(tier) + 1
        return self.names[i] if i < len(self.names) and self.names[i] in self.memory else None

    def copy(self, entries: list[PageEntry], src: str, dst: str, slots: list[int], counted: bool = True) -> None:
        """Copy entries' pages from src into dst's slots and index them there (memory speed)."""
        self.tiers[dst].write_from(self.tiers[src], [e.where[src] for e in entries], slots).result()
        if counted:
            self.count("move", src, len(entries), dst)
        for e, slot in zip(entries, slots):
            self.index.place(e, dst, slot)
            self.emit("add", e.key, dst)

    # up, at memory speed
    def ensure(self, e: PageEntry, tier: str, keep: set | None = None) -> bool:
        """Give e a copy in hot (from warm) or in warm (from hot; making room moves no key of `keep`). False when the
        other holds none (load it first: PageIO) or, for warm, has no room; OutOfCapacity when hot has none."""
        if tier in e.where:
            self.count("hit", tier)
            return True
        self.count("miss", tier)
        src = self.stage if tier == self.top else self.top
        if src not in e.where:
            return False
        if tier == self.top:
            if not self.room_in_hot([e]):
                dirty = self.dirty_evictable(tier)
                raise OutOfCapacity(f"out of KV capacity: cannot promote a page, all {self.tiers[tier].num_slots} "
                                    f"hot pages are referenced, pinned, allocated or waiting for write-behind "
                                    f"({dirty})", pending=dirty > 0)
            self.count("hit", src)
        elif not self.make_room(tier, 1, keep or {e.key}):
            return False
        self.copy([e], src, tier, self.tiers[tier].alloc(1))
        if tier == self.top:
            self.count("promote", tier)
        return True

    def ensure_hot(self, e: PageEntry) -> bool:
        return self.ensure(e, self.top)

    def room_in_hot(self, coming: list[PageEntry], exclude: set | None = None) -> bool:
        """make_room in hot for the pages coming up from warm, whose warm copies must survive it."""
        for e in coming:
            e.leases += 1
        try:
            return self.make_room(self.top, len(coming), exclude)
        finally:
            for e in coming:
                e.leases -= 1
                self.index.changed(e)

    def promote_chain(self, chain: list[PageEntry]) -> set[bytes]:
        """Copy those of a chain's pages that are in warm but not in hot up to hot in one batched copy
        (one copy a run of slots, not one a page), counted as ensure_hot counts each; returns their keys.
        Best effort: when hot cannot make room for all of them at once nothing moves, and the caller's
        ensure_hot takes them one by one."""
        need = [e for e in chain if self.top not in e.where and self.stage in e.where]
        if len(need) < 2 or not self.room_in_hot(need, {e.key for e in chain}):
            return set()
        self.copy(need, self.stage, self.top, self.tiers[self.top].alloc(len(need)))
        self.count("miss", self.top, len(need))
        self.count("hit", self.stage, len(need))
        self.count("promote", self.top, len(need))
        return {e.key for e in need}

    def ensure_warm_copy(self, e: PageEntry, keep: set | None = None) -> bool:
        return self.ensure(e, self.stage, keep)

    def page_bytes(self, e: PageEntry) -> bytes | None:
        """A page-first byte copy of e's page from memory (None when it is only in I/O tiers)."""
        for t in (self.stage, *self.names):
            if t in e.where and t in self.memory:
                return bytes(self.tiers[t].payloads([e.where[t]])[0])
        return None

    # reads into warm: plan under the lock, read I/O tiers outside it, finish under it
    def plan_read(self, entries: list[PageEntry]) -> ReadPlan:
        """Warm slots for those of `entries` (a chain, in order) that are only in lower tiers; stops
        at the first page that is gone or finds no warm room. Pages already in hot or warm are
        skipped; those in a slotted tier below warm are copied now."""
        plan, stage = ReadPlan([], [], [], []), self.tiers[self.stage]
        for e in entries:
            if e.key not in self.index or self.top in e.where or self.stage in e.where:
                continue
            if not e.where:
                break
            plan.entries.append(e)
            plan.sources.append(next(iter(e.where)))
        # room for all at once (victims chosen once, none of them this read's); the leading ones get slots
        self.make_room(self.stage, len(plan.entries), {x.key for x in entries})
        n = min(len(plan.entries), stage.pool.num_free)
        del plan.entries[n:], plan.sources[n:]
        plan.slots = stage.alloc(n) if n else []
        self.reading.update(plan.slots)
        plan.ok = [self.tiers[src].read_into([e.where[src]], stage, [slot]).result()[0] if src in self.memory
                   else None for e, src, slot in zip(plan.entries, plan.sources, plan.slots)]
        return plan

    def read(self, plan: ReadPlan) -> list[bool]:
        """The I/O half of a read plan (outside the lock): each I/O tier reads its pages into warm."""
        ok = list(plan.ok)
        stage = self.tiers[self.stage]
        for name in dict.fromkeys(s for s, k in zip(plan.sources, plan.ok) if k is None):
            idx = [i for i, s in enumerate(plan.sources) if s == name and plan.ok[i] is None]
            got = self.tiers[name].read_into([self.header(plan.entries[i]) for i in idx], stage,
                                             [plan.slots[i] for i in idx]).result()
            for i, good in zip(idx, got):
                ok[i] = good
        return ok

    def finish_read(self, plan: ReadPlan, ok: list[bool]) -> list[PageEntry]:
        """Index what was read into warm; a bad record is a counted miss, never served. Returns the
        entries now in warm from this plan, in order, up to the first failure."""
        done, failed, sources = [], False, Counter()
        for e, slot, src, good in zip(plan.entries, plan.slots, plan.sources, ok):
            self.reading.discard(slot)
            alive = e.key in self.index and self.stage not in e.where
            if not good:
                self.mark_corrupt(e, src)
            if failed or not good or not alive:
                failed = failed or not good
                self.tiers[self.stage].evict([slot])
                continue
            self.index.place(e, self.stage, slot)
            self.emit("add", e.key, self.stage)
            sources[src] += 1
            done.append(e)
        for src, n in sources.items():   # counted once a source, not three calls a page
            self.count("hit", src, n)
            self.count("promote", self.stage, n)
            self.count("move", src, n, self.stage)
        return done

    def mark_corrupt(self, e: PageEntry, tier: str | None = None) -> None:
        """e's record in `tier` (cold) failed verification: it is no longer a copy of e (left for `kvstore fsck`)."""
        tier = tier or self.durable
        self.count("corrupt", tier)
        self.unindexed.add(e.key)  # deleted first when cold needs room
        if e.key in self.index and tier in e.where:
            self.index.place(e, tier, None)
            self.emit("remove", e.key, tier)
            if not e.residency:
                self.index.remove(e)

    def admit(self, source: Tier, headers: Sequence[RecordHeader]) -> int:
        """add_chain of new pages read from a read-only source (a peer's) into free warm slots."""
        stage = self.tiers[self.stage]

        def place(i: int) -> int | None:
            if not self.make_room(self.stage, 1):
                return None
            [slot] = stage.alloc(1)
            if not source.read_into([headers[i]], stage, [slot]).result()[0]:
                stage.evict([slot])
                return None
            return slot
        return self.add_chain(headers, place, source.name)

    def add_chain(self, headers: Sequence[RecordHeader], place: Callable[[int], int | None], source_name: str) -> int:
        """Index a chain of new pages in warm, place(i) giving the slot holding headers[i]'s page (None:
        the chain stops there, as at an uncached parent); returns how many of the chain are cached."""
        done = 0
        for i, h in enumerate(headers):
            if h.key not in self.index:
                if h.parent != h.namespace and h.parent not in self.index:
                    break
                slot = place(i)
                if slot is None:
                    break
                parent = self.index.get(h.parent)
                e = self.index.add(PageEntry(h.key, h.parent, h.namespace, h.tokens,
                                             depth=parent.depth + 1 if parent else 0))
                self.index.place(e, self.stage, slot)
                self.count("move", source_name, 1, self.stage)
                self.emit("add", h.key, self.stage)
            done += 1
        return done

    # writes to cold
    def plan_write(self, entries: list[PageEntry]) -> WritePlan:
        """Headers and payloads of those entries that are in memory, not in cold and not already being
        written; each is marked `writing` (its memory copies below hot stay put) until finish_write."""
        todo = [e for e in entries if e.key in self.index and self.durable not in e.where and not e.writing
                and e.key not in self.deleting and e.in_memory(self.memory)]
        sources = [self.stage if self.stage in e.where else next(t for t in e.where if t in self.memory)
                   for e in todo]
        payloads: list = [None] * len(todo)
        for name in dict.fromkeys(sources):
            idx = [i for i, s in enumerate(sources) if s == name]
            for i, p in zip(idx, self.tiers[name].payloads([todo[i].where[name] for i in idx])):
                payloads[i] = p
        for e in todo:
            e.writing = True
        items = [(self.header(e), p) for e, p in zip(todo, payloads)]
        nbytes = sum(PREFIX_BYTES + len(h.pack()) + self.spec.page_bytes for h, _ in items)
        return WritePlan(todo, items, nbytes, sources)

    def write(self, plan: WritePlan) -> Future:
        """The I/O half of a write plan (outside the lock): the future resolves once it is durable."""
        staged = Staged([p for _, p in plan.items])
        return self.tiers[self.durable].write_from(staged, range(len(plan.items)), [h for h, _ in plan.items])

    def finish_write(self, plan: WritePlan, ok: bool) -> list[PageEntry]:
        """Mark the plan's pages cold-resident once their commit is durable; returns them."""
        done = []
        for e, src in zip(plan.entries, plan.sources):
            e.writing = False
            self.index.changed(e)
            if not ok:
                continue
            self.count("move", src, 1, self.durable)
            if e.key not in self.index:   # dropped meanwhile: the record is orphaned, delete it later
                self.unindexed.add(e.key)
                continue
            self.index.place(e, self.durable, True)
            self.emit("add", e.key, self.durable)
            done.append(e)
        return done

    def cold_victims(self, nbytes: int, exclude: set | None = None) -> tuple[list[bytes], bool]:
        """Unindex cold records until `nbytes` more fit (damaged ones first); returns the keys to
        delete (by the caller, outside the lock) and whether that makes enough room. The room is
        what cold.max_bytes leaves, or less when the disk (or the map) holds less."""
        if self.durable is None:
            return [], False
        need = nbytes - self.tiers[self.durable].room_bytes()
        keys, freed = self._unindex_cold(need, exclude)
        return keys, freed >= need

    def cold_room(self, nbytes: int, exclude: set | None = None) -> list[bytes]:
        """Unindex cold records of at least `nbytes` in all, whatever the room looks like: the cold
        trim down to its low watermark, or a disk or map that filled up anyway. Returns the keys to
        delete (by the caller, outside the lock)."""
        return self._unindex_cold(nbytes, exclude)[0] if self.durable is not None else []

    def _unindex_cold(self, nbytes: int, exclude: set | None) -> tuple[list[bytes], int]:
        """Damaged records (size unknown, counted as none), then the cold policy's victims (leaves
        first) until `nbytes` are freed or none is left; (keys, bytes freed). A page with a copy in
        memory keeps its record: it would only be written again (a cold tier smaller than memory
        would never stop writing); pages that then do not fit are stranded by the writer."""
        keys, freed = list(self.unindexed), 0
        self.deleting.update(self.unindexed)
        self.unindexed.clear()
        while freed < nbytes:
            victims = self.victims(self.durable, 8, exclude, outside=True)
            if not victims:
                break
            for e in victims:
                freed += self.record_bytes(e)
                keys.append(e.key)
            self.remove_copies(victims, self.durable)
        return keys, freed

    # down
    def evictable(self, e: PageEntry, tier: str, now: float) -> bool:
        if e.pinned(now):
            return False
        if tier == self.top:
            return not e.refcount
        if tier in self.memory:
            return not (e.writing or (tier == self.stage and e.leases))
        if tier == self.index.persistent:
            entries = self.index.entries
            if any(tier in entries[k].where for k in e.kids if k in entries):
                return False  # leaves before parents
            return e.residency > 1 or not e.kids
        return True

    def dirty_evictable(self, tier: str) -> int:
        """Pages of `tier` that may leave it once write-behind has written them."""
        now = self.index.now()
        return sum(1 for e in self.index.dirty.values() if tier in e.where and self.evictable(e, tier, now))

    def droppable(self, e: PageEntry) -> bool:
        """e may leave the store from memory without a copy below: a leaf that no lower tier can
        take (no durable tier, or it refused the page: `stranded`)."""
        return (self.durable is None or bool(e.stranded)) and not e.kids and not e.writing

    def victims(self, tier: str, n: int, exclude: set | None = None, leaving: bool = False,
                outside: bool = False) -> list[PageEntry]:
        """Up to n pages that may leave `tier`, in the policy's order. `leaving`: only those that can
        leave without a copy made (one exists elsewhere, or they are droppable); `outside`: only
        those with no copy in memory."""
        now = self.index.now()

        def ok(e: PageEntry) -> bool:
            return (self.evictable(e, tier, now) and (exclude is None or e.key not in exclude)
                    and (not leaving or e.residency > 1 or self.droppable(e))
                    and not (outside and e.in_memory(self.memory)))
        return self.index.victims(tier, n, ok, self.policy)

    def make_room(self, tier: str, n: int, exclude: set | None = None) -> bool:
        """Free slots in a slotted tier until n are free, at memory speed; False if that is impossible
        now. Pages that can leave at once go first, then those that can move to the slotted tier
        below; a dirty page stays (write-behind makes it clean): no page that cold could take is dropped."""
        pool = self.tiers[tier].pool
        while pool.num_free < n:
            short = n - pool.num_free
            if not (self.demote(self.victims(tier, short, exclude, leaving=True), tier)
                    or self.demote(self.victims(tier, short, exclude), tier)):
                break
        return pool.num_free >= n

    def demote(self, victims: list[PageEntry], tier: str, keep: bool = True, drop: bool = True) -> int:
        """Move victims out of a slotted tier at memory speed; returns how many left it.

        With `keep`, their pages go down to the next slotted tier as far as it can make room without
        dropping anything (pages with no copy elsewhere first). Then a victim leaves when another
        tier holds a copy, or, with `drop`, when it is droppable (dropped, counted by reason); the
        others stay."""
        below = self.below(tier) if keep else None
        want = sorted((e for e in victims if below is not None and below not in e.where),
                      key=lambda e: e.residency > 1)
        if want and self.tiers[below].num_slots:
            lower = self.tiers[below]
            self.make_room(below, min(len(want), lower.num_slots), {e.key for e in victims})
            k = min(len(want), lower.pool.num_free)
            if k:   # in slot order, runs copy as blocks (in LRU order: 680 copies for 520 pages, not 8)
                self.copy(sorted(want[:k], key=lambda e: e.where[tier]), tier, below, lower.alloc(k))
        done = [e for e in victims if e.residency > 1]
        dropped = [e for e in victims if drop and e.residency <= 1 and self.droppable(e)]
        for e in dropped:
            self.count("drop", None, reason=e.stranded or "no_cold_tier")
        self.remove_copies(done + dropped, tier)
        return len(done) + len(dropped)

    def remove_copies(self, entries: list[PageEntry], tier: str) -> None:
        """Drop entries' copies in `tier` (an I/O tier's delete is the caller's); an entry with no
        copy left leaves the index."""
        for e in entries:
            if tier in self.memory:
                self.tiers[tier].evict([e.where[tier]])
            else:
                self.deleting.add(e.key)   # the caller deletes the record (PageIO.drop_cold)
            self.index.place(e, tier, None)
            self.count("evict", tier)
            self.emit("remove", e.key, tier)
        for e in entries:
            if not e.residency:
                self.index.remove(e)
