"""KVStoreStorage: SGLang HiCache's L3 storage backend, kept in a `kvstore sidecar`.

Launch SGLang with it (the sidecar running beside it, on the same machine):

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore", "module_path": "kvstore_sglang.storage",
        "class_name": "KVStoreStorage", "interface_v1": 1, "socket": "/run/kvstore/kvstore.sock"}'

Each SGLang page (page_size tokens of every layer of this rank) is one kvstore page, named by
SGLang's page hash (a hash of the whole prefix up to it), in a namespace of the model name, the
page's kind and the parallel ranks: another model, or another TP or PP split, never sees it. The
sidecar keeps it in warm (shared memory), writes it to cold (LMDB) behind, checks it on every read
(a damaged page is a miss) and shares it through its Redis index and remote tier where configured.

Interface v1 (interface_v1: 1) moves pages between the host pool and the sidecar's shared memory
in one copy each way; the legacy batch_get / batch_set copy through SGLang's flat pages. With MLA
only the storage writer rank writes (SGLang skips the others' backups; so does this class).

Failures are misses: a sidecar that is down, killed or hung makes every call answer "not there"
within extra_config "timeout_s" (default 5 s); the class tries to reconnect at most every
"retry_s" (default 1 s) and logs one line per kind of failure with a backoff. No call returns
None or raises into SGLang's storage threads.

extra_config keys (besides SGLang's backend_name, module_path, class_name, interface_v1):
    socket      the sidecar's Unix socket (required)
    tenant      kvstore tenant (default ""): pages are never served across tenants
    timeout_s   bound of one sidecar request (default 5)
    retry_s     how long after a lost connection the next attempt waits (default 1)
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvstore.logbackoff import LogBackoff
from kvstore.sidecar.client import SidecarClient, SidecarError, SidecarUnavailable
from kvstore.tiers.base import runs
from kvstore_sglang.pages import PageMap

log = logging.getLogger("kvstore_sglang")

SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1", "interface_v2",
               "hicache_storage_pass_prefix_keys", "tp_lcm_size"}
OUR_KEYS = {"socket": str, "tenant": str, "timeout_s": (int, float), "retry_s": (int, float)}


def parse_extra_config(extra: Optional[dict]) -> dict:
    """Our keys of extra_config, checked: a wrong or unknown key is a ValueError naming it."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - SGLANG_KEYS - set(OUR_KEYS))
    if unknown:
        raise ValueError(f"kvstore: unknown extra_config key(s) {', '.join(unknown)}; known: {', '.join(OUR_KEYS)}")
    for key, kind in OUR_KEYS.items():
        if key in extra and (not isinstance(extra[key], kind) or isinstance(extra[key], bool)):
            raise ValueError(f"kvstore: extra_config {key!r} must be a {'number' if key.endswith('_s') else 'string'}, "
                             f"got {extra[key]!r}")
    if not extra.get("socket"):
        raise ValueError('kvstore: extra_config needs "socket": the Unix socket of a running `kvstore sidecar`')
    out = {"socket": extra["socket"], "tenant": extra.get("tenant", ""),
           "timeout_s": float(extra.get("timeout_s", 5.0)), "retry_s": float(extra.get("retry_s", 1.0))}
    for key in ("timeout_s", "retry_s"):
        if not 0 < out[key] < 3600:
            raise ValueError(f"kvstore: extra_config {key!r} must be a number of seconds in (0, 3600), got {out[key]}")
    return out


def namespace_layout(config: HiCacheStorageConfig, kind: str) -> str:
    """The part of the namespace that keeps ranks apart: MLA KV is the same on every TP rank."""
    parts = [f"sglang-{kind}-v1", f"pp{config.pp_rank}of{config.pp_size}"]
    if kind != "mla":
        parts.append(f"tp{config.tp_rank}of{config.tp_size}")
    if config.attn_cp_size > 1:
        parts.append(f"cp{config.attn_cp_rank}of{config.attn_cp_size}")
    if config.dcp_size > 1:
        parts.append(f"dcp{config.dcp_rank}of{config.dcp_size}")
    return "/".join(parts)


class Connections:
    """One sidecar client per SGLang storage thread (a client serves one thread), reconnected after
    a loss at most every retry_s. client() is None while the sidecar is unreachable."""

    def __init__(self, connect: Callable[[], SidecarClient], retry_s: float):
        self.connect, self.retry_s = connect, retry_s
        self.local = threading.local()
        self.lock = threading.Lock()
        self.all: list[SidecarClient] = []
        self.down_until = 0.0
        self.backoff: dict[str, LogBackoff] = {}

    def client(self) -> SidecarClient | None:
        kv = getattr(self.local, "kv", None)
        if kv is not None:
            return kv
        if time.monotonic() < self.down_until:
            return None
        try:
            kv = self.connect()
        except SidecarError as exc:
            self.lost(None, exc)
            return None
        with self.lock:
            self.all.append(kv)
        self.local.kv = kv
        self.backoff.pop("connect", None)
        return kv

    def lost(self, kv: SidecarClient | None, exc: BaseException) -> None:
        """The connection failed: drop it; every thread waits retry_s before it tries again."""
        self.down_until = time.monotonic() + self.retry_s
        if kv is not None:
            self.drop(kv)
        self.note("connect" if kv is None else "lost", f"kvstore sidecar unreachable, pages are misses: {exc}")

    def drop(self, kv: SidecarClient) -> None:
        with self.lock:
            if kv in self.all:
                self.all.remove(kv)
        if getattr(self.local, "kv", None) is kv:
            self.local.kv = None
        try:
            kv.close()
        except Exception:  # noqa: BLE001 - closing a broken connection
            pass

    def note(self, kind: str, message: str) -> None:
        count = self.backoff.setdefault(kind, LogBackoff()).due()
        if count:
            log.warning("%s%s", message, f" ({count} times since the last line)" if count > 1 else "")

    def close(self) -> None:
        with self.lock:
            clients, self.all = self.all, []
        for kv in clients:
            try:
                kv.close()
            except Exception:  # noqa: BLE001
                pass


class KVStoreStorage(HiCacheStorage):
    """HiCacheStorage on a kvstore sidecar; see the module docstring."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None):
        self.config = storage_config
        self.options = parse_extra_config(storage_config.extra_config)
        if getattr(storage_config, "should_split_heads", False):
            raise ValueError("kvstore: heterogeneous TP (tp_lcm_size with split heads) is not supported")
        self.model = storage_config.model_name or "sglang-model"
        self.writer = storage_config.is_storage_writer
        self.pages: PageMap | None = None
        self.conns: Connections | None = None
        self.metrics = storage_config.enable_storage_metrics   # SGLang's --enable-cache-report: get_stats
        self.metrics_lock = threading.Lock()
        self.recent: dict[str, list] = {"prefetch_pgs": [], "prefetch_bandwidth": [], "backup_pgs": [],
                                        "backup_bandwidth": []}

    # setup: the host pool tells the geometry
    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        if not isinstance(mem_pool_host, (MHATokenToKVPoolHost, MLATokenToKVPoolHost)):
            raise ValueError(f"kvstore: host pool {type(mem_pool_host).__name__} is not supported "
                             "(MHA and MLA token-to-KV host pools are)")
        self.pages = PageMap(mem_pool_host, isinstance(mem_pool_host, MLATokenToKVPoolHost))
        layout = namespace_layout(self.config, self.pages.kind)
        o = self.options

        def connect() -> SidecarClient:
            return SidecarClient(o["socket"], self.pages.spec, self.model, tenant=o["tenant"], layout=layout,
                                 timeout=o["timeout_s"], client=f"sglang {layout}")

        self.conns = Connections(connect, o["retry_s"])
        try:   # a wrong geometry is a launch error, not a stream of misses
            kv = self.conns.connect()
        except SidecarUnavailable as exc:
            log.warning("kvstore sidecar not reachable at launch (pages are misses until it is): %s", exc)
        except SidecarError as exc:
            raise ValueError(f"kvstore: {exc}; this rank's pages are {self.pages.describe()}: start the "
                             "sidecar with that geometry (its model and page_size)") from None
        else:
            kv.close()
        log.info("kvstore: pages of %s (%s, %s layout) in the sidecar at %s", self.model, self.pages.describe(),
                 self.pages.layout, o["socket"])

    # v1: host pages in place
    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        return self._call(lambda kv: kv.lookup_names(keys).pages, 0)

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        starts, started = self._page_starts(host_indices, len(keys)), time.perf_counter()
        got = self._call(lambda kv: self._read(kv, keys, lambda i, n: self.pages.host_pages(starts[i], n),
                                               runs_of=starts), 0)
        return self._outcome("prefetch", len(keys), got, started)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        if not self.writer:
            return [True] * len(keys)
        starts, started = self._page_starts(host_indices, len(keys)), time.perf_counter()
        stored = self._call(lambda kv: self._write(kv, keys, lambda i, n: self.pages.host_pages(starts[i], n),
                                                   runs_of=starts), 0)
        return self._outcome("backup", len(keys), stored, started)

    # legacy: SGLang's flat pages
    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None):
        if target_locations is None or len(target_locations) != len(keys):
            raise ValueError("kvstore: batch_get needs one target page (get_dummy_flat_data_page) per key")
        started = time.perf_counter()
        got = self._call(lambda kv: self._read(kv, keys, lambda i, n: self.pages.from_flat(target_locations[i])[None]),
                         0)
        self._outcome("prefetch", len(keys), got, started)
        return [t if i < got else None for i, t in enumerate(target_locations)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        if values is None or len(values) != len(keys):
            raise ValueError("kvstore: batch_set needs one page (get_data_page) per key")
        if not self.writer:
            return True
        started = time.perf_counter()
        stored = self._call(lambda kv: self._write(kv, keys, lambda i, n: self.pages.from_flat(values[i])[None]), 0)
        return all(self._outcome("backup", len(keys), stored, started))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # the rest of the interface
    def clear(self) -> bool:
        """Remove this rank's pages (its namespace) from the sidecar: all tiers; True when none is left
        (a page another engine is reading at this moment stays)."""
        result = self._call(lambda kv: kv.clear(), None)
        if result is None:
            return False
        log.info("kvstore: clear: %d pages removed, %d in use kept", result["pages"], result["kept"])
        return result["kept"] == 0

    def get_stats(self):
        """SGLang's StorageMetrics since the last call (pages and GB/s of each prefetch and backup call), with
        storage metrics on; else None. The sidecar's own counts are on its admin API (/v1/stats, /metrics)."""
        if not self.metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self.metrics_lock:
            recent = {k: v[:] for k, v in self.recent.items()}
            for v in self.recent.values():
                v.clear()
        return StorageMetrics(**recent)

    def close(self) -> None:
        if self.conns is not None:
            self.conns.close()

    # moving pages
    def _call(self, fn: Callable[[SidecarClient], Any], default: Any) -> Any:
        """fn(client), or `default` when the sidecar is down, lost or refuses (logged, with a backoff)."""
        conns = self.conns
        if conns is None:
            return default
        kv = conns.client()
        if kv is None:
            return default
        try:
            return fn(kv)
        except SidecarUnavailable as exc:
            conns.lost(kv, exc)
        except SidecarError as exc:
            conns.note("refused", f"kvstore sidecar refused a request, pages are misses: {exc}")
        return default

    def _read(self, kv: SidecarClient, keys: List[str], dest: Callable[[int, int], torch.Tensor],
              runs_of: Optional[List[int]] = None) -> int:
        """Copy the leading cached pages of `keys` from leased warm slots to dest(i, n) (pages i..i+n-1);
        returns how many."""
        lease = kv.get_slots(names=keys)
        try:
            self._copy(kv, lease.slots, dest, runs_of, into_host=True)
        finally:
            if lease.slots:
                kv.release(lease.slots)
        return len(lease.slots)

    def _write(self, kv: SidecarClient, keys: List[str], src: Callable[[int, int], torch.Tensor],
               runs_of: Optional[List[int]] = None) -> int:
        """Store pages src(i, n) as keys[i...] through warm slots; returns how many (all, or none)."""
        done, chunk = 0, max(1, kv.info["slots"] // 2)
        while done < len(keys):
            part = keys[done:done + chunk]
            slots = kv.alloc(len(part))
            try:
                self._copy(kv, slots, lambda i, n: src(done + i, n), runs_of[done:] if runs_of else None,
                           into_host=False)
                kv.put_named(part, slots)
            except SidecarError as exc:
                if not isinstance(exc, SidecarUnavailable):
                    kv.release(slots)
                raise
            done += len(part)
        return done

    def _copy(self, kv: SidecarClient, slots: List[int], host: Callable[[int, int], torch.Tensor],
              runs_of: Optional[List[int]], into_host: bool) -> None:
        """Copy between warm slots and host pages: one strided copy per run of pages consecutive on both sides."""
        if not slots:
            return
        warm = kv.warm_pages.view(torch.uint8).view(len(kv.warm_pages), -1)
        shape = self.pages.shape
        ps = self.pages.page_size
        index = [runs_of[i] // ps for i in range(len(slots))] if runs_of is not None else None
        groups = runs(index, slots) if index is not None else [(None, s, 1) for s in slots]
        i = 0
        for _, slot, n in groups:
            shared = warm[slot:slot + n].view(self.pages.dtype).view(n, *shape)
            pages = host(i, n)
            if into_host:
                pages.copy_(shared)
            else:
                shared.copy_(pages)
            i += n

    def _page_starts(self, host_indices: torch.Tensor, n: int) -> List[int]:
        ps = self.pages.page_size
        if host_indices.numel() != n * ps:
            raise ValueError(f"kvstore: {host_indices.numel()} host indices for {n} pages of {ps} tokens")
        return host_indices[::ps].tolist()

    def _outcome(self, op: str, asked: int, done: int, started: float) -> List[bool]:
        """SGLang's answer for a call that moved `done` of `asked` pages; recorded for get_stats."""
        if self.metrics and done:
            seconds = max(time.perf_counter() - started, 1e-9)
            with self.metrics_lock:
                self.recent[f"{op}_pgs"].append(done)
                self.recent[f"{op}_bandwidth"].append(done * self.pages.spec.page_bytes / seconds / 1e9)
        return [True] * done + [False] * (asked - done)
