"""PageIndex: page key -> where the page lives, who holds it, how it has been used.

Invariants (checked by TieredStore.audit):
- An entry exists while at least one tier holds its page (hot slot, warm slot or cold record).
- `refcount` counts holders of the hot copy; a referenced entry always has a hot slot.
- `leases` counts holders of the warm copy (sidecar clients); a leased entry always has a warm slot.
- `kids` are the entries whose parent is this key; a child whose parent is absent waits in
  `_waiting` and is linked when the parent arrives, so `kids` is exact whatever the order.
- `dirty` holds, in the order they became so, the pages in memory that have no copy in the
  persistent tier (cold) and are not stranded: the write-behind queue. `stranded` holds those
  that cold refused (full, or failing): they may be dropped, and are retried now and then.
  Every residency change goes through place (and add, remove), which keeps both exact.

Eviction order: each tier is kept in the policy's order (policy.VictimQueue, one per policy and
tier, plus the least recently used leaves for the prefix-cache trim), so `victims` and
`oldest_leaves` pop instead of scanning. An entry held in a tier (referenced in hot, leased in
warm, in cold with a child in cold or as the only copy of a parent) is left out of that tier's
queue until a change re-queues it. Hence the rule: code that changes a field a policy key reads
calls index.touch(e), and so does code that drops a refcount or a lease; tier membership changes
go through place (set_hot, set_warm and set_cold for the built-in tiers), links through add and remove.

Residency is generic: `PageEntry.where` maps each tier holding the page (by name, fastest
first) to its handle there: a slot in a slotted tier, True in a keyed one (the key is the
handle). `hot`, `warm`, `cold` and `tier` are read-only views of it.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

from kvstore.placement.entry import PageEntry
from kvstore.placement.policy import POLICIES, VictimQueue

TIERS = ("hot", "warm", "cold")   # the built-in tiers, fastest first
SOURCES = ("remote", "peer")      # where else a request's cached pages may come from: the remote tier, a peer
CACHE_TIERS = (*TIERS, *SOURCES)  # every place a request's cached prompt tokens are counted from


class PageIndex:
    """`tiers`: the store's tier names, fastest first; `keyed`: those whose handles are page keys.
    The first tier holds referenced pages, the second leased ones; the first keyed tier (cold)
    keeps a record while a child is in it (leaves first)."""

    def __init__(self, policy: str = "lru", tiers: tuple[str, ...] = TIERS, keyed: tuple[str, ...] = ("cold",)):
        self.policy = policy
        self.tiers = tuple(tiers)
        self.keyed = frozenset(keyed)
        self.rank = {t: i for i, t in enumerate(self.tiers)}
        self.persistent = next((t for t in self.tiers if t in self.keyed), None)
        self.memory = frozenset(t for t in self.tiers if t not in self.keyed)
        self.dirty: dict[bytes, PageEntry] = {}      # the write-behind queue, oldest first (see the module doc)
        self.stranded: dict[bytes, PageEntry] = {}   # dirty pages cold refused (see the module doc)
        # tier -> handle (slot, or key in a keyed tier) -> entry
        self.at: dict[str, dict] = {t: {} for t in self.tiers}
        self.entries: dict[bytes, PageEntry] = {}
        self.hot_slots = self.at[self.tiers[0]]
        self.warm_slots = self.at[self.tiers[1]]
        self.cold_entries = self.at.get("cold", {})
        self._waiting: dict[bytes, set[bytes]] = {}
        self._tick = 0
        self._seq = 0
        self._stamp = 0
        self._orders: dict[str, dict[str, VictimQueue]] = {}   # policy -> tier (or "leaves") -> queue
        self._changed: set[PageEntry] = set()                  # to push again before the next read
        self._members = {**self.at, "leaves": self.entries}
        held = {self.tiers[0]: lambda e: e.refcount, self.tiers[1]: lambda e: e.leases,
                self.persistent: self._cold_held}
        self._wanted: dict[str, Callable[[PageEntry], bool]] = {
            t: (lambda e, t=t, h=held.get(t): t in e.where and not (h and h(e))) for t in self.tiers}
        self._wanted["leaves"] = lambda e: not e.kids
        for tier in self.tiers:
            self._queue(policy, tier)
        self._queue("lru", "leaves")

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def get(self, key: bytes) -> PageEntry | None:
        return self.entries.get(key)

    def tick(self) -> int:
        self._tick += 1
        return self._tick

    def touch(self, e: PageEntry) -> None:
        e.last_access = self.tick()
        self._requeue(e)

    def changed(self, e: PageEntry) -> None:
        """e may leave a tier now that it could not before (a lease or a write ended): queue it again,
        without counting it as used."""
        self._requeue(e)

    def add(self, e: PageEntry) -> PageEntry:
        if e.key in self.entries:
            raise KeyError("page already indexed")
        self.entries[e.key] = e
        self._seq += 1
        e.seq = self._seq
        for t, handle in e.where.items():
            self.at[t][e.key if t in self.keyed else handle] = e
        e.kids = self._waiting.pop(e.key, set())
        parent = self.entries.get(e.parent)
        if parent is not None:
            parent.kids.add(e.key)
            self._requeue(parent)
        else:
            self._waiting.setdefault(e.parent, set()).add(e.key)
        if e.last_access == 0:
            e.last_access = self.tick()
        self._requeue(e)
        self._mark(e)
        return e

    def remove(self, e: PageEntry) -> None:
        del self.entries[e.key]
        self.dirty.pop(e.key, None)
        self.stranded.pop(e.key, None)
        for t in self.keyed:
            self.at[t].pop(e.key, None)
        self._stamp += 1
        e.stamp = self._stamp   # its queue items are stale now
        self._changed.discard(e)
        parent = self.entries.get(e.parent)
        if parent is not None:
            parent.kids.discard(e.key)
            self._requeue(parent)
        else:
            waiting = self._waiting.get(e.parent)
            if waiting is not None:
                waiting.discard(e.key)
                if not waiting:
                    del self._waiting[e.parent]
        if e.kids:
            self._waiting[e.key] = e.kids
        e.kids = set()

    def place(self, e: PageEntry, tier: str, handle=None) -> None:
        """e's copy in `tier` is now `handle` (a slot; True in a keyed tier), or gone (None)."""
        members, keyed = self.at[tier], tier in self.keyed
        old = e.where.pop(tier, None)
        if old is not None:
            del members[e.key if keyed else old]
        if handle is not None and handle is not False:
            e.where[tier] = handle
            members[e.key if keyed else handle] = e
            if len(e.where) > 1:   # keep the fastest tier first
                e.where = {t: e.where[t] for t in sorted(e.where, key=self.rank.__getitem__)}
        self._requeue(e)
        self._mark(e)
        parent = self.entries.get(e.parent)
        if tier == self.persistent and old is not None and handle is None and parent is not None \
                and tier in parent.where:
            self._requeue(parent)   # its last child in cold may have left

    def _mark(self, e: PageEntry) -> None:
        """Keep `dirty` and `stranded` exact for e: dirty once it is in memory without a persistent copy."""
        if self.persistent is None or e.key not in self.entries:
            return
        if self.persistent in e.where or e.where.keys().isdisjoint(self.memory):
            self.dirty.pop(e.key, None)
            self.stranded.pop(e.key, None)
            e.stranded = ""
        elif e.stranded:
            self.dirty.pop(e.key, None)
            self.stranded[e.key] = e
        elif e.key not in self.dirty:
            e.dirty_since = time.monotonic()
            self.dirty[e.key] = e

    def strand(self, e: PageEntry, reason: str) -> None:
        """Cold refused e (`reason`: cold_full, write_error): it leaves the write-behind queue, and may
        be dropped from memory, until `unstrand` queues it again."""
        e.stranded = reason
        self._mark(e)

    def unstrand(self, e: PageEntry) -> None:
        self.stranded.pop(e.key, None)
        e.stranded = ""
        self._mark(e)

    def set_hot(self, e: PageEntry, slot: int | None) -> None:
        self.place(e, "hot", slot)

    def set_warm(self, e: PageEntry, slot: int | None) -> None:
        self.place(e, "warm", slot)

    def set_cold(self, e: PageEntry, flag: bool) -> None:
        self.place(e, "cold", True if flag else None)

    def in_tier(self, tier: str) -> Iterator[PageEntry]:
        return iter(self._members.get(tier, {}).values())   # a built-in tier not enabled holds nothing

    def count_in(self, tier: str) -> int:
        """How many pages `tier` holds (without walking them)."""
        return len(self._members.get(tier, {}))

    # eviction order
    def victims(self, tier: str, n: int, ok: Callable[[PageEntry], bool],
                policy: str | None = None) -> list[PageEntry]:
        """Up to n entries of `tier` that satisfy ok (and are not held there), in the policy's order:
        smallest key first, then insertion order. Nothing is removed; evicting them is the caller's."""
        self._flush()
        return self._queue(policy or self.policy, tier).first(n, ok)

    def oldest_leaves(self, n: int, ok: Callable[[PageEntry], bool]) -> list[PageEntry]:
        """Up to n entries without children that satisfy ok, least recently accessed first."""
        self._flush()
        return self._queue("lru", "leaves").first(n, ok)

    def _queue(self, policy: str, tier: str) -> VictimQueue:
        queues = self._orders.setdefault(policy, {})
        if tier not in queues:   # another policy asked for: built once, then kept up to date
            members = self._members[tier]
            queues[tier] = VictimQueue(POLICIES.get(policy), self._wanted[tier], members.__len__)
            queues[tier].rebuild(members.values())
        return queues[tier]

    def _requeue(self, e: PageEntry) -> None:
        """e changed: it is pushed again before the queues are next read (once, however often it changed)."""
        self._changed.add(e)

    def _flush(self) -> None:
        """Give each changed entry a new stamp (its older items go stale) and push it where it is
        wanted; when most entries changed (loading the cold tier), rebuild the queues instead."""
        changed, self._changed = self._changed, set()
        if len(changed) > 4096 and len(changed) * 2 > len(self.entries):
            for queues in self._orders.values():
                for tier, q in queues.items():
                    q.rebuild(self._members[tier].values())
            return
        for e in changed:
            self._stamp += 1
            e.stamp = self._stamp
            for queues in self._orders.values():
                key = None
                for q in queues.values():
                    if q.wanted(e):
                        key = q.key(e) if key is None else key
                        q.push(e, key)

    def settle(self) -> None:
        """Push the changed entries now (a bulk loader calls it per chunk, so that no later read
        finds most of the index changed and rebuilds every queue under the store's lock)."""
        self._flush()

    def _cold_held(self, e: PageEntry) -> bool:
        """A cold record stays while a child is in cold, or while it is the only copy of a parent."""
        if not e.kids:
            return False
        if len(e.where) == 1:
            return True
        entries, tier = self.entries, self.persistent
        for k in e.kids:
            kid = entries.get(k)
            if kid is not None and tier in kid.where:
                return True
        return False

    def compute_depths(self, keys=None, done: dict[bytes, int] | None = None) -> None:
        """Set depth from parent links (after loading entries in any order): of every entry, or of
        `keys`, in chunks that share `done` (key -> depth found so far)."""
        done = {} if done is None else done
        for e in (self.entries.values() if keys is None else filter(None, map(self.entries.get, keys))):
            chain, seen = [], set()
            cur = e
            while cur is not None and cur.key not in done and cur.key not in seen:   # a forged cycle ends too
                chain.append(cur)
                seen.add(cur.key)
                cur = self.entries.get(cur.parent)
            d = done[cur.key] + 1 if cur is not None and cur.key in done else 0
            for c in reversed(chain):
                if c.depth != d:
                    c.depth = d
                    self._requeue(c)   # depth is a key field
                done[c.key] = d
                d += 1

    def now(self) -> float:
        return time.monotonic()
