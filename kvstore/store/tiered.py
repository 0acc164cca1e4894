"""TieredStore: the one facade the engine and the services call.

Pages live in an ordered list of tiers, hot (DeviceTier), warm (HostTier) and cold (DiskTier),
built by name from the config (tiers/build.py), are named by hash-chained keys (keys.py), indexed
by PageIndex (where, who holds them, how used), moved by PageMover and counted by MoveStats.

The store is built of parts, each given the narrow core they share (core.py: the lock, the
config and spec, the tiers, the index, the mover) and what else they need, never the store:
- HotPages (hot.py): the engine's verbs on hot pages (allocate, acquire, commit, release);
- WarmSharing (sharing.py): another process sharing the warm tier (the sidecar's client):
  lease_warm(keys) / allocate_warm(n) -> fill -> commit_warm(tokens, slots) -> release_warm(slots);
- TierMaintenance (kvstore.movement.maintenance): moving pages down, on request and by watermarks;
- the Daemon (kvstore.movement.daemon), the store's one background component, and its PageIO;
- RemoteFetch (fetch.py): pages of the remote tier into warm.
The store's verbs that are a part's are that part's methods (`Verb`: `store.evict` is
`store.maintenance.evict`); the store itself opens and closes the parts, indexes the cold tier,
trades records with peers, pins, and reports (stats, audit, snapshot).

The store is the one door: the engine, the sidecar, the job runner, the admin API and the tests
all call its verbs (event loops through `daemon.run`, on worker threads). The engine's requests
go through a CacheHandle (handle.py): `store.handle(namespace)`, then match -> load (cold pages
up to warm, in the background) -> attach (hold the cached prefix in hot) -> grow (fresh hot
slots) -> fill -> commit -> release. Released pages stay cached (refcount 0) until evicted.

Retention: a committed or put page joins the write-behind queue at once; the Daemon writes it to
cold, demotes by watermarks, loads and trims. No page leaves the store while cold could take it:
a page without a cold copy stays in memory until written, and producers wait (bounded) for room
instead (Daemon.room_for).

Thread model: every public method takes the core's one re-entrant lock. Methods the engine calls
(match, acquire, allocate, release, hot_budget) work at memory speed and never touch the disk.
Disk work (loads, write-behind, cold eviction) runs on the Daemon's threads outside the lock, or
on the caller's thread for the blocking methods meant for worker threads (promote, lease_warm,
allocate_warm, evict, flush, rebalance, export_records, close). Readers that must not take the
lock (the admin views, the dashboard's sampler) read `snapshot()`.
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
from typing import Iterable, Sequence

import torch

from kvstore.config import Config
from kvstore.datadir import DataDir
from kvstore.errors import KVStoreError
from kvstore.movement.daemon import Daemon
from kvstore.movement.maintenance import TierMaintenance
from kvstore.pages import record
from kvstore.pages.keys import Namespace
from kvstore.pages.record import RecordHeader
from kvstore.pages.spec import KVSpec
from kvstore.placement.index import PageEntry
from kvstore.remote import head_room, open_remote
from kvstore.store.core import Listener, Match, StoreCore  # noqa: F401 (Match: re-exported)
from kvstore.store.fetch import RemoteFetch
from kvstore.store.handle import CacheHandle
from kvstore.store.hot import HotPages
from kvstore.store.sharing import WarmSharing
from kvstore.store.snapshot import StoreSnapshot, take_snapshot
from kvstore.tiers.base import Tier
from kvstore.tiers.build import Layer, build_tiers, layout
from kvstore.tiers.device import resolve_device
from kvstore.tiers.peer_pages import PeerPages

log = logging.getLogger("kvstore.store")
INDEX_WAIT_S = 2.0   # how long services wait for the cold tier's index before serving without it


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class Verb:
    """A verb of the store that is one of its parts' methods: `store.<name>` is
    `store.<part>.<name>` (the part's docstring says what it does)."""

    def __init__(self, part: str):
        self.part = part

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, store: "TieredStore | None", owner: type | None = None):
        return self if store is None else getattr(getattr(store, self.part), self.name)


class TieredStore:
    def __init__(self, config: Config, spec: KVSpec | None = None, model_id: str | None = None,
                 extra_tiers: Sequence[Layer] = ()):
        """`extra_tiers`: (role, backend, settings) of tiers to place between warm and cold."""
        self.config = config
        device = resolve_device(config.hot.device)
        spec = spec or config.kv_spec(device.type)
        self.model_id = model_id or config.model
        pool = config.hot.pool
        pool_bytes = int(pool * free_memory_bytes(device)) if isinstance(pool, float) else pool
        if pool_bytes < spec.page_bytes:
            raise KVStoreError(f"hot.pool ({pool_bytes} bytes) is smaller than one page ({spec.describe()})")
        self.data_dir = (DataDir(config.data_dir).lock() if config.cold.enabled or config.warm.shared_memory
                         else None)
        tiers: list[Tier] = []
        try:
            tiers = build_tiers(spec, layout(config, spec, device, pool_bytes,
                                             self.data_dir.shm_name if self.data_dir else None, extra_tiers,
                                             head_room(config, spec)))
            remote = open_remote(config, spec)
        except BaseException:
            for tier in tiers:
                tier.close()
            if self.data_dir is not None:
                self.data_dir.unlock()
            raise
        self.core = core = StoreCore(config, spec, tiers, remote)
        self.spec, self.tiers, self.remote = spec, core.tiers, remote
        self.hot, self.warm, self.cold = core.hot, core.warm, core.cold
        self.index, self.mover, self.counts = core.index, core.mover, core.counts
        self.daemon = Daemon(core)
        self.io = self.daemon.io   # the disk work, on the daemon's threads and worker threads
        self.pages = HotPages(core, self.daemon)
        self.sharing = WarmSharing(core, self.daemon)
        self.maintenance = TierMaintenance(core, self.daemon)
        self.indexing = {"done": self.cold is None, "pages": 0}
        self._closing = False
        self._indexer: threading.Thread | None = None
        if self.cold is not None:
            self._indexer = threading.Thread(target=self._index_cold, name="kvstore-cold-index", daemon=True)
            self._indexer.start()
        self.daemon.start(self.maintenance.rebalance)
        self.fetcher = RemoteFetch(core, self.daemon)

    # the parts' verbs (see hot.py, sharing.py, kvstore.movement.maintenance, fetch.py)
    match = Verb("core")
    allocate = Verb("pages")
    commit_keys = Verb("pages")
    acquire = Verb("pages")
    release = Verb("pages")
    promote = Verb("pages")
    hot_budget = Verb("pages")
    admission_budget = Verb("pages")
    writes_pending = Verb("pages")
    allocate_warm = Verb("sharing")
    warm_shortage = Verb("sharing")
    commit_warm = Verb("sharing")
    commit_warm_named = Verb("sharing")
    lease_warm = Verb("sharing")
    lease_in_memory = Verb("sharing")
    release_warm = Verb("sharing")
    evict = Verb("maintenance")
    clear_namespace = Verb("maintenance")
    flush = Verb("maintenance")
    rebalance = Verb("maintenance")
    fetch_remote = Verb("fetcher")
    fetch_remote_named = Verb("fetcher")

    @property
    def hot_pages(self) -> int:
        """Pages the hot tier holds in all."""
        return self.hot.num_pages

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
                with self.core.lock:
                    self.index.compute_depths(keys[i:i + 4096], done)
        except KVStoreError as exc:
            log.warning("indexing the cold tier stopped: %s", exc)
        finally:
            self.indexing["done"] = True

    def _index_chunk(self, chunk: list) -> None:
        with self.core.lock:
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
        with self.core.lock:
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
        self.core.listeners.append(fn)

    def handle(self, namespace: Namespace) -> CacheHandle:
        """A request's door to its pages (see handle.py)."""
        return CacheHandle(self.core, self.daemon, self.pages, self.sharing, namespace)

    # pages exchanged with peer instances, as cold-format records
    def export_records(self, namespace: bytes, keys: Sequence[bytes]) -> list[bytes]:
        """Records (kvstore.pages.record format) of a prefix chain of this namespace, from whichever tier
        holds each page; stops at the first page that is missing or unreadable."""
        out = []
        with self.core.lock:
            chain = []
            for key in keys:
                e = self.index.get(key)
                if e is None or e.namespace != namespace:
                    break
                chain.append(e)
        ticket = self.daemon.load([e.key for e in chain])   # cold pages come up to warm, outside the lock
        ticket.wait()
        with self.core.lock:
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

    # operator controls
    def pin(self, keys: Iterable[bytes], ttl_s: float | None = None) -> int:
        """Keep these pages in the tiers they are in until unpinned or ttl_s (config pin_ttl_s) passes."""
        ttl = self.config.pin_ttl_s if ttl_s is None else ttl_s
        with self.core.lock:
            until = self.index.now() + ttl
            found = [e for e in map(self.index.get, keys) if e is not None]
            for e in found:
                e.pin_until = max(e.pin_until, until)
            return len(found)

    def unpin(self, keys: Iterable[bytes]) -> int:
        with self.core.lock:
            found = [e for e in map(self.index.get, keys) if e is not None and e.pin_until]
            for e in found:
                e.pin_until = 0.0
            return len(found)

    # observability
    def residency(self, keys: Sequence[bytes] | None = None) -> dict[bytes, tuple[str, bytes] | None]:
        """Each key's fastest tier and namespace digest (None when not cached); all pages without keys."""
        with self.core.lock:
            if keys is None:
                return {k: (e.tier, e.namespace) for k, e in self.index.entries.items()}
            return {k: ((e.tier, e.namespace) if (e := self.index.get(k)) is not None else None) for k in keys}

    def tier_pages(self) -> dict[str, int]:
        """Pages per built-in tier, as stats()["tiers"][t]["pages"], without walking them (for samplers)."""
        with self.core.lock:
            return {name: self.index.count_in(name) for name in self.counts.tiers}

    def stats(self) -> dict:
        with self.core.lock:
            now = self.index.now()
            tiers, counts = {}, self.counts.snapshot()
            for name in counts["tiers"]:
                tier, cfg = self.core.by_name.get(name), getattr(self.config, name, None)
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
            tiers["hot"]["allocated_pages"] = len(self.core.owned)
            tiers["warm"]["allocated_pages"] = len(self.core.warm_owned)
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
        with self.core.lock:
            problems = []
            owned = {"hot": self.core.owned, "warm": self.core.warm_owned | self.mover.reading}
            for name in (t for t in self.mover.names if t in self.mover.memory):
                pool, slots = self.core.by_name[name].pool, set(self.index.at[name]) | owned.get(name, set())
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
                    "allocated_slots": len(self.core.owned), "problems": problems}

    def snapshot(self, pages: bool | Iterable[bytes] = False, tier: str | None = None) -> StoreSnapshot:
        """The store now, immutable (snapshot.py), for readers that must not take the lock: the tiers'
        byte counters, the bytes moved, write-behind and drops; with `pages`, the pages too (True:
        every page, O(pages), or with `tier` those it holds; or the keys wanted)."""
        return take_snapshot(self.core, self.daemon, pages, tier)
