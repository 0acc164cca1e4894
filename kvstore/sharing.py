"""WarmSharing: warm pages shared with another process (the sidecar's client), a mixin of TieredStore.

Such a caller maps the warm tier itself, so it holds warm slots instead of hot references:
lease_warm(keys) / allocate_warm(n) -> fill -> commit_warm(tokens, slots) -> release_warm(slots).

Rules: a leased page stays in its warm slot, unchanged, until released (the mover does not
evict it from warm); an allocated slot is the caller's alone until committed or released, and is
tracked in `_warm_owned`. Every method takes the store's lock. The host class provides the lock,
spec, config, warm tier, index, mover, io, write_through_pending, _warm_owned and _emit.
"""

from __future__ import annotations

from typing import Sequence

from kvstore.errors import KVStoreError, OutOfCapacity
from kvstore.index import PageEntry
from kvstore.keys import Namespace, page_keys, tokens_bytes


class WarmSharing:
    """lease_warm, allocate_warm, commit_warm, release_warm: see the module docstring."""

    def allocate_warm(self, n: int) -> list[int]:
        """n warm slots for the caller to fill, evicting unleased warm pages if needed (pages with no
        cold copy are written behind first, outside the lock: this blocks, for worker threads)."""
        with self._lock:
            room = self.mover.make_room("warm", n, drop=self.cold is None)
            short = n - self.warm.pool.num_free
            victims = [] if room else self.mover.victims("warm", short)
        if victims:
            self._write_behind(victims, "warm")
        with self._lock:
            if not self.mover.make_room("warm", n):
                raise OutOfCapacity(f"out of warm capacity: {n} warm pages requested, {self.warm.pool.num_free} free "
                                    f"of {self.warm.num_slots} ({len(self._warm_owned)} allocated, others leased or pinned)")
            slots = self.warm.pool.alloc(n)
            self._warm_owned.update(slots)
            return slots

    def commit_warm(self, namespace: Namespace, tokens: Sequence[int], slots: Sequence[int],
                    start_page: int = 0) -> list[bytes]:
        """Give keys to pages start_page.. of `tokens`, written by the caller into warm slots from
        allocate_warm; returns their keys. They become cached, unleased. A slot whose page is cached
        already is freed. Page start_page - 1 must be cached. On error nothing has changed."""
        ps, end = self.spec.page_size, start_page + len(slots)
        if start_page < 0 or end > len(tokens) // ps:
            raise KVStoreError(f"commit_warm: pages {start_page}..{end - 1} need {end * ps} tokens, got {len(tokens)}")
        keys = page_keys(namespace, tokens, ps)[:end]
        with self._lock:
            if not self._warm_owned.issuperset(slots) or len(set(slots)) < len(slots):
                raise KVStoreError(f"commit_warm: warm slots {list(slots)} are not all allocated to the caller")
            parent = keys[start_page - 1] if start_page else namespace.digest
            if start_page and parent not in self.index:
                raise KVStoreError(f"commit_warm: page {start_page - 1}, the parent of page {start_page}, is not cached")
            for i, slot in enumerate(slots, start=start_page):
                self._warm_owned.discard(slot)
                if keys[i] in self.index:
                    self.warm.pool.free([slot])
                else:
                    e = self.index.add(PageEntry(keys[i], parent, namespace.digest,
                                                 tokens_bytes(tokens[i * ps:(i + 1) * ps]), depth=i))
                    self.index.set_warm(e, slot)
                    if self.config.write_policy == "write_through":
                        self.write_through_pending.append(keys[i])
                    self._emit("add", keys[i], "warm")
                parent = keys[i]
        return keys[start_page:]

    def lease_warm(self, keys: Sequence[bytes], namespace: Namespace | None = None) -> list[int]:
        """Warm slots holding these pages (a prefix chain), each now leased once by the caller: the page
        stays in that slot, unchanged, until release_warm. Pages only in hot are copied to warm; pages
        only in cold are read first, outside the lock (so this blocks: for worker threads). Stops at
        the first page that is gone, of another namespace, bad, or finds no warm room."""
        with self._lock:
            chain = []
            for key in keys:
                e = self.index.get(key)
                if e is None or (namespace is not None and e.namespace != namespace.digest):
                    break
                chain.append(key)
            cold = any(self.index.entries[k].tier not in (self.mover.top, self.mover.stage) for k in chain)
        if not cold:
            return self.lease_in_memory(chain)
        ticket = self.io.load(chain)
        ticket.wait()
        with self._lock:
            try:
                return self.lease_in_memory(chain[:ticket.ready])
            finally:
                self.io.end_load(ticket)

    def lease_in_memory(self, keys: Sequence[bytes]) -> list[int]:
        """lease_warm at memory speed: stops at the first page that is only in cold (never reads the disk)."""
        slots: list[int] = []
        with self._lock:
            for key in keys:
                e = self.index.get(key)
                if e is None or not self.mover.ensure_warm_copy(e):
                    break
                e.leases += 1
                e.hits += 1
                self.index.touch(e)
                slots.append(e.warm)
        return slots

    def release_warm(self, slots: Sequence[int]) -> None:
        """End the caller's leases on these warm slots and free its uncommitted ones; all or nothing."""
        with self._lock:
            for slot in slots:
                e = self.index.warm_slots.get(slot)
                if slot not in self._warm_owned and (e is None or e.leases < slots.count(slot)):
                    raise KVStoreError(f"release_warm: warm slot {slot} is not leased or allocated")
            for slot in reversed(slots):
                if slot in self._warm_owned:
                    self._warm_owned.discard(slot)
                    self.warm.pool.free([slot])
                    continue
                self.index.warm_slots[slot].leases -= 1
                self.index.touch(self.index.warm_slots[slot])
