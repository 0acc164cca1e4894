"""HotPages: the engine's verbs on hot pages, a part of TieredStore (given the core and the daemon).

A request holds hot pages: `allocate(n)` fresh slots -> fill -> `commit_keys` -> `release`;
`acquire(keys)` holds cached pages (warm ones are copied up). Released pages stay cached
(refcount 0) until evicted. `hot_budget` and `admission_budget` say what a new request may take
now; `promote` prefetches a chain without holding it.

Every verb takes the core's lock and works at memory speed, never touching the disk, but
promote, which waits for cold pages to be read (outside the lock): for worker threads.
"""

from __future__ import annotations

from typing import Sequence

from kvstore.errors import KVStoreError, OutOfCapacity
from kvstore.movement.daemon import Daemon
from kvstore.pages.keys import Namespace, tokens_bytes
from kvstore.placement.index import PageEntry
from kvstore.store.core import StoreCore


class HotPages:
    def __init__(self, core: StoreCore, daemon: Daemon):
        self.core, self.daemon = core, daemon

    def allocate(self, n: int) -> list[int]:
        """n hot slots for the caller to fill, evicting unreferenced pages if needed; never oversubscribes.
        Raises OutOfCapacity (`pending` when dirty pages hold the room until they are written)."""
        core = self.core
        with core.lock:
            if not core.mover.make_room("hot", n):
                self.daemon.kick()
                dirty = core.mover.dirty_evictable("hot")
                raise OutOfCapacity(
                    f"out of KV capacity: {n} hot pages requested, {core.hot.pool.num_free} free of "
                    f"{core.hot.num_pages} ({len(core.owned)} allocated, "
                    f"{sum(1 for e in core.index.hot_slots.values() if e.refcount)} referenced, "
                    f"{dirty} waiting for write-behind)", pending=dirty > 0)
            slots = core.hot.pool.alloc(n)
            core.owned.update(slots)
            self._kick_if_high()
            return slots

    def writes_pending(self) -> bool:
        """Whether pages wait for write-behind (room that the daemon's writer will free soon)."""
        with self.core.lock:
            return bool(self.core.index.dirty)

    def _kick_if_high(self) -> None:
        """Wake the background rebalance when hot or warm passes its high watermark."""
        core = self.core
        for pool, cfg in ((core.hot.pool, core.config.hot), (core.warm.pool, core.config.warm)):
            if pool.num_slots and pool.num_used > cfg.high_watermark * pool.num_slots:
                self.daemon.kick()
                return

    def admission_budget(self) -> int:
        """Hot pages a new request may take now: hot_budget, less the headroom the high watermark
        keeps for running requests to grow; nothing while the write-behind queue is at its bound
        (a new request would only add to it)."""
        with self.core.lock:
            if self.daemon.over_bound():
                return 0
            reserve = int((1 - self.core.config.hot.high_watermark) * self.core.hot.num_pages)
            return self.hot_budget() - reserve

    def hot_budget(self) -> int:
        """Hot pages a new request could get now, without waiting for the disk: free, plus evictable
        pages that can leave at once (a copy elsewhere) or move to warm's free or clean slots."""
        core, mover = self.core, self.core.mover
        with core.lock:
            now = core.index.now()
            evictable = [e for e in core.index.hot_slots.values() if mover.evictable(e, "hot", now)]
            dirty = sum(1 for e in evictable if e.residency <= 1 and not mover.droppable(e))
            warm_room = 0
            if dirty and core.warm.num_slots:
                warm_room = core.warm.pool.num_free + len(mover.victims("warm", dirty, leaving=True))
            return core.hot.pool.num_free + len(evictable) - dirty + min(dirty, warm_room)

    def commit_keys(self, namespace: Namespace, tokens: Sequence[int], keys: Sequence[bytes],
                    slots: Sequence[int], start_page: int, parent: bytes) -> list[bytes]:
        """Give keys to pages start_page.. of `tokens`: slots[i] holds page start_page + i, filled by
        the caller (a handle, which extends its chain and passes the keys).

        The caller keeps holding each committed page (one reference). A page whose key is
        already cached in hot stays the caller's private copy and is freed on release.
        Pages committed before (by this caller) are skipped. New pages join the write-behind queue.
        Returns the keys of those pages.
        """
        core, ps = self.core, self.core.spec.page_size
        with core.lock:
            prev, added = parent, False
            for i, key in enumerate(keys, start=start_page):
                slot, e = slots[i - start_page], core.index.get(key)
                if slot not in core.owned:
                    if e is None or e.hot != slot:
                        raise KVStoreError(f"commit: hot slot {slot} is not allocated to the caller")
                elif e is None or e.hot is None:
                    if e is None:
                        e = core.index.add(PageEntry(key, prev, namespace.digest,
                                                     tokens_bytes(tokens[i * ps:(i + 1) * ps]), depth=i))
                    core.owned.discard(slot)
                    core.index.set_hot(e, slot)
                    e.refcount += 1
                    core.emit("add", key, "hot")
                    added = True
                prev = key
            if added:
                self.daemon.wake()
        return list(keys)

    def acquire(self, keys: Sequence[bytes]) -> list[int]:
        """Hot slots holding these pages (a prefix chain), each now referenced once by the caller.

        Pages in warm are copied up. Stops at the first page that is gone or only in cold (load
        it first: promote, or a handle's load), so the result may be shorter than `keys`.
        """
        core, mover = self.core, self.core.mover
        slots: list[int] = []
        with core.lock:
            chain = []
            for key in keys:
                e = core.index.get(key)
                if e is None or not (mover.top in e.where or mover.stage in e.where):
                    break
                chain.append(e)
            try:
                copied = mover.promote_chain(chain)   # warm pages up in one batched copy
                for e in chain:
                    if e.key not in copied and not mover.ensure_hot(e):
                        break
                    e.refcount += 1
                    e.hits += 1
                    core.index.touch(e)
                    slots.append(e.hot)
            except OutOfCapacity:
                self.release(slots)  # all or nothing: no reference survives a failed acquire
                raise
        return slots

    def release(self, slots: Sequence[int]) -> None:
        """Drop the caller's references and free its uncommitted slots; the tail ages first."""
        core = self.core
        with core.lock:
            for slot in reversed(slots):
                if slot in core.owned:
                    core.owned.discard(slot)
                    core.hot.pool.free([slot])
                    continue
                e = core.index.hot_slots.get(slot)
                if e is None or e.refcount <= 0:
                    raise KVStoreError(f"release: hot slot {slot} is not held")
                e.refcount -= 1
                core.index.touch(e)

    def promote(self, keys: Sequence[bytes], to: str = "warm") -> int:
        """Prefetch a prefix chain up to "warm" or "hot" without referencing it; returns pages done.
        Blocks while cold pages are read (outside the lock): for worker threads."""
        ticket = self.daemon.load(keys)
        ready = ticket.wait()
        with self.core.lock:
            try:
                if to != "hot":
                    return ready
                done = 0
                for key in keys[:ready]:
                    e = self.core.index.get(key)
                    if e is None or not self.core.mover.ensure_hot(e):
                        break
                    done += 1
                return done
            except OutOfCapacity:
                return done
            finally:
                self.daemon.end_load(ticket)
