"""WarmSharing: warm pages shared with another process (the sidecar's client), a part of TieredStore.

Such a caller maps the warm tier itself, so it holds warm slots instead of hot references:
lease_warm(keys) / allocate_warm(n) -> fill -> commit_warm(tokens, slots) -> release_warm(slots).
commit_warm_named(names, slots) is commit_warm for an engine that names its pages (kvstore.pages.keys).

Rules: a leased page stays in its warm slot, unchanged, until released (the mover does not
evict it from warm); an allocated slot is the caller's alone until committed or released, and is
tracked in the core's `warm_owned`. A caller that puts pages is a producer off the engine thread:
when the write-behind queue is at its bound or warm has no clean room, allocate_warm waits for the
daemon (bounded), then hands out what fits. Every method takes the core's lock. It is given the
store's core (core.py) and the daemon.
"""

from __future__ import annotations

from typing import Sequence

from kvstore.errors import KVStoreError, OutOfCapacity
from kvstore.movement.daemon import Daemon
from kvstore.pages.keys import Namespace, name_tokens, named_key, page_keys, tokens_bytes
from kvstore.placement.index import PageEntry
from kvstore.store.core import StoreCore


class WarmSharing:
    """lease_warm, allocate_warm, commit_warm, release_warm: see the module docstring."""

    def __init__(self, core: StoreCore, daemon: Daemon):
        self.core, self.daemon = core, daemon
        self.index, self.mover, self.warm = core.index, core.mover, core.warm

    def allocate_warm(self, n: int, wait_s: float | None = None, partial: bool = False) -> list[int]:
        """n warm slots for the caller to fill, evicting unleased clean warm pages if needed. When the
        write-behind queue is at its bound, or warm holds too few clean pages, this waits up to
        wait_s (daemon.backpressure_timeout_s) for the daemon's writer: it blocks, for worker
        threads. Then it raises OutOfCapacity, or with `partial` returns the slots that fit (maybe none)."""
        wait_s = self.core.config.daemon.backpressure_timeout_s if wait_s is None else wait_s

        def room() -> bool:
            return self.mover.make_room("warm", n)

        with self.daemon.room_for(n, wait_s, room) as fits:
            k = n
            if not fits:
                k = min(self.daemon.room(n), self.warm.pool.num_free)
                if not partial:
                    self.daemon.refused(n)
                    raise OutOfCapacity(self.warm_shortage(n), pending=bool(self.index.dirty))
                self.daemon.refused(n - k)
            slots = self.warm.pool.alloc(k) if k else []
            self.core.warm_owned.update(slots)
        return slots

    def warm_shortage(self, n: int) -> str:
        """Why n warm slots are not to be had."""
        with self.core.lock:
            dirty = len(self.index.dirty)
            why = (f"{dirty} pages wait for write-behind (daemon.max_dirty_bytes: at most {self.daemon.max_dirty_pages})"
                   if self.daemon.over_bound(n) else f"{self.warm.pool.num_free} free of {self.warm.num_slots}, "
                   f"{len(self.core.warm_owned)} allocated, the others leased, pinned or waiting for write-behind")
            return f"out of warm capacity: {n} warm pages requested; {why}"

    def commit_warm(self, namespace: Namespace, tokens: Sequence[int], slots: Sequence[int],
                    start_page: int = 0) -> list[bytes]:
        """Give keys to pages start_page.. of `tokens`, written by the caller into warm slots from
        allocate_warm; returns their keys. They become cached, unleased. A slot whose page is cached
        already is freed. Page start_page - 1 must be cached. On error nothing has changed."""
        ps, end = self.core.spec.page_size, start_page + len(slots)
        if start_page < 0 or end > len(tokens) // ps:
            raise KVStoreError(f"commit_warm: pages {start_page}..{end - 1} need {end * ps} tokens, got {len(tokens)}")
        keys = page_keys(namespace, tokens, ps)[:end]
        with self.core.lock:
            if not self.core.warm_owned.issuperset(slots) or len(set(slots)) < len(slots):
                raise KVStoreError(f"commit_warm: warm slots {list(slots)} are not all allocated to the caller")
            parent = keys[start_page - 1] if start_page else namespace.digest
            if start_page and parent not in self.index:
                raise KVStoreError(f"commit_warm: page {start_page - 1}, the parent of page {start_page}, is not cached")
            for i, slot in enumerate(slots, start=start_page):
                self.core.warm_owned.discard(slot)
                if keys[i] in self.index:
                    self.warm.pool.free([slot])
                else:
                    e = self.index.add(PageEntry(keys[i], parent, namespace.digest,
                                                 tokens_bytes(tokens[i * ps:(i + 1) * ps]), depth=i))
                    self.index.set_warm(e, slot)
                    self.core.emit("add", keys[i], "warm")
                parent = keys[i]
            self.daemon.wake()
        return keys[start_page:]

    def commit_warm_named(self, namespace: Namespace, names: Sequence[str], slots: Sequence[int]) -> list[bytes]:
        """commit_warm for named pages: slots[i] holds the page called names[i], a root page of its own
        (the name stands for its whole prefix). Returns their keys. On error nothing has changed."""
        if len(names) != len(slots):
            raise KVStoreError(f"commit_warm_named: {len(names)} names for {len(slots)} slots")
        keys = [named_key(namespace, name) for name in names]
        with self.core.lock:
            if not self.core.warm_owned.issuperset(slots) or len(set(slots)) < len(slots):
                raise KVStoreError(f"commit_warm_named: warm slots {list(slots)} are not all allocated to the caller")
            for key, name, slot in zip(keys, names, slots):
                self.core.warm_owned.discard(slot)
                if key in self.index:
                    self.warm.pool.free([slot])
                    continue
                e = self.index.add(PageEntry(key, namespace.digest, namespace.digest, name_tokens(name), depth=0))
                self.index.set_warm(e, slot)
                self.core.emit("add", key, "warm")
            self.daemon.wake()
        return keys

    def lease_warm(self, keys: Sequence[bytes], namespace: Namespace | None = None) -> list[int]:
        """Warm slots holding these pages (a prefix chain), each now leased once by the caller: the page
        stays in that slot, unchanged, until release_warm. Pages only in hot are copied to warm; pages
        only in cold are read first, outside the lock (so this blocks: for worker threads). Stops at
        the first page that is gone, of another namespace, bad, or finds no warm room."""
        with self.core.lock:
            chain = []
            for key in keys:
                e = self.index.get(key)
                if e is None or (namespace is not None and e.namespace != namespace.digest):
                    break
                chain.append(key)
            cold = any(self.index.entries[k].tier not in (self.mover.top, self.mover.stage) for k in chain)
        if not cold:
            return self.lease_in_memory(chain)
        ticket = self.daemon.load(chain)
        ticket.wait()
        with self.core.lock:
            try:
                return self.lease_in_memory(chain[:ticket.ready])
            finally:
                self.daemon.end_load(ticket)

    def lease_in_memory(self, keys: Sequence[bytes]) -> list[int]:
        """lease_warm at memory speed: stops at the first page that is only in cold (never reads the disk).
        The room made for the copies of pages only in hot never sends another page of `keys` down."""
        slots: list[int] = []
        keep = set(keys)
        with self.core.lock:
            for key in keys:
                e = self.index.get(key)
                if e is None or not self.mover.ensure_warm_copy(e, keep):
                    break
                e.leases += 1
                e.hits += 1
                self.index.touch(e)
                slots.append(e.warm)
        return slots

    def release_warm(self, slots: Sequence[int]) -> None:
        """End the caller's leases on these warm slots and free its uncommitted ones; all or nothing."""
        with self.core.lock:
            for slot in slots:
                e = self.index.warm_slots.get(slot)
                if slot not in self.core.warm_owned and (e is None or e.leases < slots.count(slot)):
                    raise KVStoreError(f"release_warm: warm slot {slot} is not leased or allocated")
            for slot in reversed(slots):
                if slot in self.core.warm_owned:
                    self.core.warm_owned.discard(slot)
                    self.warm.pool.free([slot])
                else:
                    self.core.unlease([slot])
            self.daemon.wake()   # room for a producer waiting on warm
