"""TieredStore: the one facade the engine and the services call.

Pages live in an ordered list of tiers, hot (DeviceTier), warm (HostTier) and cold (DiskTier),
built by name from the config (tiers/build.py), are named by hash-chained keys (keys.py), indexed
by PageIndex (where, who holds them, how used), moved by PageMover and counted by MoveStats.
Moving pages down on request and by watermarks is TierMaintenance's (maintenance.py).

The store is the one door: the engine, the sidecar, the job runner, the admin API and the tests
all call its verbs (event loops through `daemon.run`, on worker threads). The engine's requests
go through a CacheHandle (handle.py): `store.handle(namespace)`, then match -> load (cold pages
up to warm, in the background) -> attach (hold the cached prefix in hot) -> grow (fresh hot
slots) -> fill -> commit -> release. Released pages stay cached (refcount 0) until evicted.
Another process sharing the warm tier (the sidecar's client) does the same in warm
(sharing.py, WarmSharing):
lease_warm(keys) / allocate_warm(n) -> fill -> commit_warm(tokens, slots) -> release_warm(slots).

Retention: a committed or put page joins the write-behind queue at once; the Daemon (daemon.py),
the store's one background component, writes it to cold, demotes by watermarks, loads and trims.
No page leaves the store while cold could take it: a page without a cold copy stays in memory
until written, and producers wait (bounded) for room instead (Daemon.room_for).

Thread model: every public method takes one re-entrant lock. Methods the engine calls (match,
acquire, allocate, commit_keys, release, lease_in_memory, hot_budget) work at memory speed and
never touch the disk. Disk work (loads, write-behind, cold eviction) runs on the Daemon's
threads outside the lock, or on the caller's thread for the blocking methods meant for worker
threads (promote, lease_warm, allocate_warm, evict, flush, rebalance, export_records, close).
Opening the store indexes the cold tier in the background: pages become visible as they are
indexed (`indexing` says how far it is). A store with a cold tier or a shared warm tier owns
its data directory (DataDir: private modes, an exclusive lock, the warm segment's name) until
closed. A damaged cold store (DamagedStore) stops the store from opening, unless
cold.on_damage is quarantine: then it is moved aside and the tier starts empty.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from kvstore.config import Config
from kvstore.datadir import DataDir
from kvstore.errors import KVStoreError, OutOfCapacity
from kvstore.movement.daemon import Daemon
from kvstore.movement.maintenance import TierMaintenance
from kvstore.movement.move_stats import MoveStats
from kvstore.movement.mover import PageMover
from kvstore.pages import record
from kvstore.pages.keys import Namespace, name_tokens, named_key, page_keys, tokens_bytes
from kvstore.pages.record import RecordHeader
from kvstore.pages.spec import KVSpec
from kvstore.placement.index import TIERS, PageEntry, PageIndex
from kvstore.remote import open_remote
from kvstore.remote.landing import WarmLanding
from kvstore.store.handle import CacheHandle
from kvstore.store.sharing import WarmSharing
from kvstore.tiers.base import Tier
from kvstore.tiers.build import Layer, build_tiers, layout
from kvstore.tiers.device import DeviceTier, resolve_device
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier
from kvstore.tiers.peer_pages import PeerPages

Listener = Callable[[str, bytes, str], None]   # (event "add" | "remove", key, tier)
log = logging.getLogger("kvstore.store")
INDEX_WAIT_S = 2.0   # how long services wait for the cold tier's index before serving without it


@dataclass
class Match:
    """The longest cached prefix of a token sequence: one key and one tier per full page."""

    namespace: Namespace
    page_size: int
    keys: list[bytes] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)

    @property
    def num_pages(self) -> int:
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        return len(self.keys) * self.page_size

    def counts(self) -> dict[str, int]:
        return {t: self.tiers.count(t) for t in TIERS}


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class TieredStore(WarmSharing, TierMaintenance):
    def __init__(self, config: Config, spec: KVSpec | None = None, model_id: str | None = None,
                 extra_tiers: Sequence[Layer] = ()):
        """`extra_tiers`: (role, backend, settings) of tiers to place between warm and cold."""
        self.config = config
        device = resolve_device(config.hot.device)
        self.spec = spec or config.kv_spec(device.type)
        self.model_id = model_id or config.model
        pool = config.hot.pool
        pool_bytes = int(pool * free_memory_bytes(device)) if isinstance(pool, float) else pool
        if pool_bytes < self.spec.page_bytes:
            raise KVStoreError(f"hot.pool ({pool_bytes} bytes) is smaller than one page "
                               f"({self.spec.describe()})")
        self.data_dir = (DataDir(config.data_dir).lock() if config.cold.enabled or config.warm.shared_memory
                         else None)
        try:
            self.tiers: list[Tier] = build_tiers(self.spec, layout(
                config, self.spec, device, pool_bytes, self.data_dir.shm_name if self.data_dir else None, extra_tiers))
        except BaseException:
            if self.data_dir is not None:
                self.data_dir.unlock()
            raise
        self._by_name = {t.name: t for t in self.tiers}
        try:
            self.remote = open_remote(config, self.spec)
        except BaseException:
            for tier in self.tiers:
                tier.close()
            if self.data_dir is not None:
                self.data_dir.unlock()
            raise
        names = tuple(self._by_name)
        self.index = PageIndex(config.eviction_policy, names, tuple(t.name for t in self.tiers if t.keyed))
        self._lock = threading.RLock()
        self._owned: set[int] = set()   # hot slots allocated to callers and not committed
        self._warm_owned: set[int] = set()   # the same in warm (allocate_warm)
        self._listeners: list[Listener] = []
        # every built-in tier is reported, enabled or not
        self.counts = MoveStats(names if "cold" in names else (*names, "cold"), self.spec.page_bytes)
        self.mover = PageMover(self.spec, self.tiers, self.index, config.eviction_policy, self._emit, self.counts)
        self.daemon = Daemon(self)
        self.io = self.daemon.io   # the disk work, on the daemon's threads and worker threads
        self._maintenance = threading.Lock()   # one rebalance at a time
        self.indexing = {"done": self.cold is None, "pages": 0}
        self._closing = False
        self._indexer: threading.Thread | None = None
        if self.cold is not None:
            self._indexer = threading.Thread(target=self._index_cold, name="kvstore-cold-index", daemon=True)
            self._indexer.start()
        self.daemon.start()
        if self.remote is not None:
            self._landing = WarmLanding(self._lock, self.mover, self.daemon, self.warm,
                                        config.daemon.backpressure_timeout_s)
            self.remote.lend(*self._landing.area)
            if self.cold is not None:
                self.remote.start(self.cold.records)

    # the tiers, by role
    @property
    def hot(self) -> DeviceTier:
        return self._by_name["hot"]

    @property
    def warm(self) -> HostTier:
        return self._by_name["warm"]

    @property
    def cold(self) -> DiskTier | None:
        return self._by_name.get("cold")

    @property
    def mismatched_pages(self) -> int:
        return self.counts.pages["mismatch"]

    # lifecycle
    def _index_cold(self) -> None:
        """Index the cold tier's records, a chunk per trip through the lock, while the store serves."""
        chunk: list = []
        try:
            for item in self.cold.scan():
                chunk.append(item)
                if len(chunk) >= 1024:
                    self._index_chunk(chunk)
                    chunk = []
                if self._closing:
                    return
            self._index_chunk(chunk)
            keys, done = list(self.index.entries), {}
            for i in range(0, len(keys), 4096):   # a chunk per trip through the lock
                with self._lock:
                    self.index.compute_depths(keys[i:i + 4096], done)
        except KVStoreError as exc:
            log.warning("indexing the cold tier stopped: %s", exc)
        finally:
            self.indexing["done"] = True

    def _index_chunk(self, chunk: list) -> None:
        with self._lock:
            for key, header, _ in chunk:
                if header is None or header.spec != self.spec.fingerprint or header.nbytes != self.spec.page_bytes:
                    self.mover.unindexed.add(key)
                    continue
                e = self.index.get(key)
                if e is None:
                    parent = self.index.get(header.parent)
                    e = self.index.add(PageEntry(key, header.parent, header.namespace, header.tokens,
                                                 depth=parent.depth + 1 if parent else 0))
                if not e.cold:
                    self.index.set_cold(e, True)
            self.index.settle()
            self.indexing["pages"] += len(chunk)

    def wait_indexed(self, timeout: float | None = None) -> bool:
        """Block until the cold tier is indexed (tests, tools); True when it is."""
        if self._indexer is not None:
            self._indexer.join(timeout)
        return self.indexing["done"]

    def close(self, persist: bool = True) -> None:
        """Stop the store. With persist, the pages in memory not yet in cold are written there first
        (the daemon drains its write-behind queue)."""
        self._closing = True
        if self._indexer is not None:
            self._indexer.join()
        self.daemon.close(persist)
        if self.remote is not None:
            self.remote.close()
        with self._lock:
            for tier in reversed(self.tiers):
                tier.close()
        if self.data_dir is not None:
            self.data_dir.unlock()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def namespace(self, tenant: str = "", salt: str = "") -> Namespace:
        return Namespace.for_spec(self.model_id, self.spec, tenant, salt)

    def add_listener(self, fn: Listener) -> None:
        """fn(event, key, tier) on every residency change; called under the lock: must not block."""
        self._listeners.append(fn)

    def _emit(self, event: str, key: bytes, tier: str) -> None:
        for fn in self._listeners:
            fn(event, key, tier)

    def handle(self, namespace: Namespace) -> CacheHandle:
        """A request's door to its pages (see handle.py)."""
        return CacheHandle(self, namespace)

    # lookup
    def match(self, tokens: Sequence[int], namespace: Namespace) -> Match:
        """The longest prefix of full pages present in some tier, verified against the request."""
        m = Match(namespace, self.spec.page_size)
        ps = self.spec.page_size
        with self._lock:
            prev = namespace.digest
            for i, key in enumerate(page_keys(namespace, tokens, ps)):
                e = self.index.get(key)
                if e is None:
                    break
                if e.namespace != namespace.digest or e.parent != prev or e.tokens != tokens_bytes(tokens[i * ps:(i + 1) * ps]):
                    self.counts.count("mismatch")
                    break
                m.keys.append(key)
                m.tiers.append(e.tier)
                prev = key
        return m

    # callers' pages
    def allocate(self, n: int) -> list[int]:
        """n hot slots for the caller to fill, evicting unreferenced pages if needed; never oversubscribes.
        Raises OutOfCapacity (`pending` when dirty pages hold the room until they are written)."""
        with self._lock:
            if not self.mover.make_room("hot", n):
                self.daemon.kick()
                dirty = self.mover.dirty_evictable("hot")
                raise OutOfCapacity(
                    f"out of KV capacity: {n} hot pages requested, {self.hot.pool.num_free} free of "
                    f"{self.hot.num_pages} ({len(self._owned)} allocated, "
                    f"{sum(1 for e in self.index.hot_slots.values() if e.refcount)} referenced, "
                    f"{dirty} waiting for write-behind)", pending=dirty > 0)
            slots = self.hot.pool.alloc(n)
            self._owned.update(slots)
            self._kick_if_high()
            return slots

    def writes_pending(self) -> bool:
        """Whether pages wait for write-behind (room that the daemon's writer will free soon)."""
        with self._lock:
            return bool(self.index.dirty)

    def _kick_if_high(self) -> None:
        """Wake the background rebalance when hot or warm passes its high watermark."""
        for pool, cfg in ((self.hot.pool, self.config.hot), (self.warm.pool, self.config.warm)):
            if pool.num_slots and pool.num_used > cfg.high_watermark * pool.num_slots:
                self.daemon.kick()
                return

    @property
    def hot_pages(self) -> int:
        """Pages the hot tier holds in all."""
        return self.hot.num_pages

    def admission_budget(self) -> int:
        """Hot pages a new request may take now: hot_budget, less the headroom the high watermark
        keeps for running requests to grow; nothing while the write-behind queue is at its bound
        (a new request would only add to it)."""
        with self._lock:
            if self.daemon.over_bound():
                return 0
            reserve = int((1 - self.config.hot.high_watermark) * self.hot.num_pages)
            return self.hot_budget() - reserve

    def hot_budget(self) -> int:
        """Hot pages a new request could get now, without waiting for the disk: free, plus evictable
        pages that can leave at once (a copy elsewhere) or move to warm's free or clean slots."""
        with self._lock:
            now = self.index.now()
            evictable = [e for e in self.index.hot_slots.values() if self.mover.evictable(e, "hot", now)]
            dirty = sum(1 for e in evictable if e.residency <= 1 and not self.mover.droppable(e))
            warm_room = 0
            if dirty and self.warm.num_slots:
                warm_room = self.warm.pool.num_free + len(self.mover.victims("warm", dirty, leaving=True))
            return self.hot.pool.num_free + len(evictable) - dirty + min(dirty, warm_room)

    def commit_keys(self, namespace: Namespace, tokens: Sequence[int], keys: Sequence[bytes],
                    slots: Sequence[int], start_page: int, parent: bytes) -> list[bytes]:
        """Give keys to pages start_page.. of `tokens`: slots[i] holds page start_page + i, filled by
        the caller (a handle, which extends its chain and passes the keys).

        The caller keeps holding each committed page (one reference). A page whose key is
        already cached in hot stays the caller's private copy and is freed on release.
        Pages committed before (by this caller) are skipped. New pages join the write-behind queue.
        Returns the keys of those pages.
        """
        ps = self.spec.page_size
        with self._lock:
            prev, added = parent, False
            for i, key in enumerate(keys, start=start_page):
                slot, e = slots[i - start_page], self.index.get(key)
                if slot not in self._owned:
                    if e is None or e.hot != slot:
                        raise KVStoreError(f"commit: hot slot {slot} is not allocated to the caller")
                elif e is None or e.hot is None:
                    if e is None:
                        e = self.index.add(PageEntry(key, prev, namespace.digest,
                                                     tokens_bytes(tokens[i * ps:(i + 1) * ps]), depth=i))
                    self._owned.discard(slot)
                    self.index.set_hot(e, slot)
                    e.refcount += 1
                    self._emit("add", key, "hot")
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
        slots: list[int] = []
        with self._lock:
            chain = []
            for key in keys:
                e = self.index.get(key)
                if e is None or not (self.mover.top in e.where or self.mover.stage in e.where):
                    break
                chain.append(e)
            try:
                copied = self.mover.promote_chain(chain)   # warm pages up in one batched copy
                for e in chain:
                    if e.key not in copied and not self.mover.ensure_hot(e):
                        break
                    e.refcount += 1
                    e.hits += 1
                    self.index.touch(e)
                    slots.append(e.hot)
            except OutOfCapacity:
                self.release(slots)  # all or nothing: no reference survives a failed acquire
                raise
        return slots

    def release(self, slots: Sequence[int]) -> None:
        """Drop the caller's references and free its uncommitted slots; the tail ages first."""
        with self._lock:
            for slot in reversed(slots):
                if slot in self._owned:
                    self._owned.discard(slot)
                    self.hot.pool.free([slot])
                    continue
                e = self.index.hot_slots.get(slot)
                if e is None or e.refcount <= 0:
                    raise KVStoreError(f"release: hot slot {slot} is not held")
                e.refcount -= 1
                self.index.touch(e)

    def promote(self, keys: Sequence[bytes], to: str = "warm") -> int:
        """Prefetch a prefix chain up to "warm" or "hot" without referencing it; returns pages done.
        Blocks while cold pages are read (outside the lock): for worker threads."""
        ticket = self.daemon.load(keys)
        ready = ticket.wait()
        with self._lock:
            try:
                if to != "hot":
                    return ready
                done = 0
                for key in keys[:ready]:
                    e = self.index.get(key)
                    if e is None or not self.mover.ensure_hot(e):
                        break
                    done += 1
                return done
            except OutOfCapacity:
                return done
            finally:
                self.daemon.end_load(ticket)

    # pages exchanged with peer instances, as cold-format records
    def export_records(self, namespace: bytes, keys: Sequence[bytes]) -> list[bytes]:
        """Records (kvstore.pages.record format) of a prefix chain of this namespace, from whichever tier
        holds each page; stops at the first page that is missing or unreadable."""
        out = []
        with self._lock:
            chain = []
            for key in keys:
                e = self.index.get(key)
                if e is None or e.namespace != namespace:
                    break
                chain.append(e)
        ticket = self.daemon.load([e.key for e in chain])   # cold pages come up to warm, outside the lock
        ticket.wait()
        with self._lock:
            try:
                for e in chain[:ticket.ready]:
                    page = self.mover.page_bytes(e)
                    if page is None:
                        break
                    out.append(record.encode_bytes(self.mover.header(e), page))
            finally:
                self.daemon.end_load(ticket)
        return out

    def import_records(self, records: Sequence[tuple[RecordHeader, bytes]], source_name: str = "peer") -> int:
        """Put verified pages (a prefix chain whose first parent is cached or the root) into warm,
        as cached pages; returns how many are now cached. The caller has verified them; their bytes
        are counted as `<source_name>_to_warm`."""
        source = PeerPages(self.spec, records, source_name)   # a read-only tier the mover reads into warm
        headers = [header for header, _ in records]
        return self.daemon.take_room(len(records), self.config.daemon.backpressure_timeout_s,
                                     lambda room: self.mover.admit(source, headers[:room]))

    def fetch_remote(self, tokens: Sequence[int], namespace: Namespace, known: int | None = None) -> tuple[int, int]:
        """Bring the pages of `tokens` that the remote tier holds beyond the cached prefix into warm.
        `known`: how many of the chain's pages the prefix index says the remote holds (None: ask it).
        Returns (pages cached before, pages added). Blocks for the network: for worker threads;
        failures are misses."""
        ps = self.spec.page_size
        local = self.match(tokens, namespace).num_pages
        if self.remote is None or (known is not None and known <= local) or len(tokens) // ps <= local:
            return local, 0
        keys = page_keys(namespace, tokens, ps)
        expect = [tokens_bytes(tokens[i * ps:(i + 1) * ps]) for i in range(local, len(keys))]
        added = self.remote.fetch(namespace.digest, keys[local:], expect, keys[local - 1] if local else namespace.digest,
                                  self._landing, None if known is None else known - local)
        return local, added

    def fetch_remote_named(self, names: Sequence[str], namespace: Namespace) -> int:
        """fetch_remote for named pages (kvstore.pages.keys): the leading pages of `names` not cached here that
        the remote tier holds, into warm. Returns the pages added."""
        keys = [named_key(namespace, n) for n in names]
        with self._lock:
            local = next((i for i, k in enumerate(keys) if k not in self.index), len(keys))
        if self.remote is None or local == len(keys):
            return 0
        return self.remote.fetch(namespace.digest, keys[local:], [name_tokens(n) for n in names[local:]],
                                 namespace.digest, self._landing, roots=True)

    # operator controls
    def pin(self, keys: Iterable[bytes], ttl_s: float | None = None) -> int:
        """Keep these pages in the tiers they are in until unpinned or ttl_s (config pin_ttl_s) passes."""
        ttl = self.config.pin_ttl_s if ttl_s is None else ttl_s
        with self._lock:
            until = self.index.now() + ttl
            found = [e for e in map(self.index.get, keys) if e is not None]
            for e in found:
                e.pin_until = max(e.pin_until, until)
            return len(found)

    def unpin(self, keys: Iterable[bytes]) -> int:
        with self._lock:
            found = [e for e in map(self.index.get, keys) if e is not None and e.pin_until]
            for e in found:
                e.pin_until = 0.0
            return len(found)

    # observability
    def residency(self, keys: Sequence[bytes] | None = None) -> dict[bytes, tuple[str, bytes] | None]:
        """Each key's fastest tier and namespace digest (None when not cached); all pages without keys."""
        with self._lock:
            if keys is None:
                return {k: (e.tier, e.namespace) for k, e in self.index.entries.items()}
            return {k: ((e.tier, e.namespace) if (e := self.index.get(k)) is not None else None) for k in keys}

    def tier_pages(self) -> dict[str, int]:
        """Pages per built-in tier, as stats()["tiers"][t]["pages"], without walking them (for samplers)."""
        with self._lock:
            return {name: self.index.count_in(name) for name in self.counts.tiers}

    def stats(self) -> dict:
        with self._lock:
            now = self.index.now()
            tiers, counts = {}, self.counts.snapshot()
            for name in counts["tiers"]:
                tier, cfg = self._by_name.get(name), getattr(self.config, name, None)
                entries = list(self.index.in_tier(name)) if tier is not None else []
                tiers[name] = {
                    "capacity_bytes": tier.capacity_bytes if tier is not None else 0,
                    "used_bytes": tier.used_bytes if tier is not None else 0,
                    "pages": len(entries),
                    "referenced_pages": sum(1 for e in entries if e.refcount),
                    "pinned_pages": sum(1 for e in entries if e.pinned(now)),
                    "high_watermark": cfg.high_watermark if cfg else 1.0,
                    "low_watermark": cfg.low_watermark if cfg else 1.0,
                    **counts["tiers"][name]}
            tiers["hot"]["allocated_pages"] = len(self._owned)
            tiers["warm"]["allocated_pages"] = len(self._warm_owned)
            tiers["warm"]["leased_pages"] = sum(1 for e in self.index.warm_slots.values() if e.leases)
            tiers["warm"]["loading_pages"] = len(self.mover.reading)
            if self.remote is not None:
                tiers["remote"] = self.remote.stats()
            return {"page_bytes": self.spec.page_bytes, "spec": self.spec.describe(), "tiers": tiers,
                    "bytes_moved": counts["bytes_moved"], "entries": len(self.index),
                    "corrupt_pages": counts["corrupt_pages"] + (self.remote.corrupt if self.remote is not None else 0),
                    "mismatched_pages": counts["mismatched_pages"],
                    "dropped_pages": counts["dropped_pages"], "dropped_by_reason": counts["dropped_by_reason"],
                    "write_behind": self.daemon.stats(), "cold_write_errors": self.io.write_errors,
                    "cold": self.cold_state(), "cold_indexing": dict(self.indexing),
                    "eviction_policy": self.mover.policy, "write_policy": self.config.write_policy}

    def cold_state(self) -> dict:
        """The cold tier's write health: failed write-behind batches, the last error, whether it is
        full (even after evicting), records evicted because the disk (not cold.max_bytes) had no
        room, and whether the disk is what bounds it now. Counters only: no lock taken."""
        return {"enabled": self.cold is not None, **self.io.cold_state(),
                "disk_bound": self.cold is not None and self.cold.disk_bound}

    def audit(self, cold: bool = True) -> dict:
        """Check the index against the tiers. `problems` is empty when everything agrees. The cold
        check reads every record's key (LMDB): `cold=False` skips it (the engine's debug checks)."""
        with self._lock:
            problems = []
            owned = {"hot": self._owned, "warm": self._warm_owned | self.mover.reading}
            for name in (t for t in self.mover.names if t in self.mover.memory):
                pool, slots = self._by_name[name].pool, set(self.index.at[name]) | owned.get(name, set())
                used = {s for s in range(pool.num_slots) if pool.is_used(s)}
                if used != slots:
                    problems.append(f"{name}: {len(used)} slots used, {len(slots)} accounted for")
            cold_keys = {e.key for e in self.index.in_tier("cold")}
            if cold and self.cold is not None:
                records = set(self.cold.sizes())
                in_flight = self.mover.deleting | {e.key for e in self.index.entries.values() if e.writing}
                if not cold_keys <= records or not records <= cold_keys | self.mover.unindexed | in_flight:
                    problems.append("cold: records and index disagree")
            for tier in self.tiers:
                if tier.used_bytes > tier.capacity_bytes:
                    problems.append(f"{tier.name}: {tier.used_bytes} bytes used > {tier.capacity_bytes}")
            for e in self.index.entries.values():
                if not e.residency:
                    problems.append(f"{e.key.hex()[:12]}: indexed but in no tier")
                if e.refcount and e.hot is None:
                    problems.append(f"{e.key.hex()[:12]}: referenced without a hot copy")
                if e.leases and e.warm is None:
                    problems.append(f"{e.key.hex()[:12]}: leased without a warm copy")
            return {"referenced_pages": sum(1 for e in self.index.entries.values() if e.refcount),
                    "total_refcount": sum(e.refcount for e in self.index.entries.values()),
                    "allocated_slots": len(self._owned), "problems": problems}
