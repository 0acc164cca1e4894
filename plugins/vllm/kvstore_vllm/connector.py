"""KVStoreConnector: vLLM's KV connector (KVConnectorBase_V1) over a kvstore sidecar.

vLLM loads it with

    kv_transfer_config={"kv_connector": "KVStoreConnector",
                        "kv_connector_module_path": "kvstore_vllm.connector",
                        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                        "kv_connector_extra_config": {"socket": "/run/kvstore/kvstore.sock"}}

Scheduler side: for a new request, one lookup tells how many leading full blocks of its prompt
the sidecar holds (never the whole prompt: vLLM computes at least its last token); blocks that are
only in the cold tier load asynchronously (the request waits, the others run). Each step's
metadata tells the workers which blocks to load and which newly filled blocks to save.
Worker side: loads copy leased warm slots into the allocated vLLM blocks before the forward pass
reads them; saves copy each newly filled block into warm slots after the step and commit them.
A page that cannot be served (corrupted, evicted since the lookup, the sidecar gone) is reported
through get_block_ids_with_load_errors, and vLLM recomputes it (kv_load_failure_policy
"recompute"; with "fail", vLLM fails such requests instead).

Page bytes move through the sidecar's shared-memory warm tier; the socket carries slot numbers.
A vLLM block is stored as opaque bytes: the namespace names vLLM's layout, the model (and LoRA),
the KV dtype, the block size, and the request's cache_salt, so such pages are served only to the
same configuration. When the sidecar is down, vLLM serves without it (no hits, no saves) and the
connector reconnects by itself.

Extra config (kv_connector_extra_config): socket (or the environment variable
KVSTORE_SIDECAR_SOCKET), model_id (default: vLLM's model name or path and revision), tenant,
retry_s (seconds between reconnects, default 2), load_cold_async (default true).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                              KVConnectorRole, KVConnectorWorkerMetadata)

from kvstore.pages.spec import DTYPES, KVSpec
from kvstore.sidecar.client import SidecarError, SidecarUnavailable
from kvstore_vllm.blocks import blocks_to_slots, check_layers, layer_order, slots_to_blocks
from kvstore_vllm.link import Scope, SidecarLink, log

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

LAYOUT_VERSION = "vllm-blocks-v1"


@dataclass
class Transfer:
    """Pages start_page.. of a request's tokens, to or from vLLM blocks block_ids (one per page)."""

    req_id: str
    scope: Scope
    tokens: list[int]          # the request's tokens up to the last page moved
    block_ids: list[int]
    start_page: int
    is_async: bool = False


@dataclass
class KVStoreMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


@dataclass
class KVStoreWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: the first page of each request that did not load, so the scheduler saves
    the pages vLLM recomputes in their place."""

    failed: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = dict(self.failed)
        for req_id, page in getattr(other, "failed", {}).items():
            merged[req_id] = min(page, merged.get(req_id, page))
        return KVStoreWorkerMetadata(merged)


@dataclass
class _Tracked:
    """Scheduler-side state of a live request."""

    request: Any
    scope: Scope
    block_ids: list[int] = field(default_factory=list)
    stored_pages: int = 0      # leading pages the sidecar holds (loaded, found, or saved by us)


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")     # kvstore names page dtypes as torch does
    if name in DTYPES:
        return name
    raise ValueError(f"kvstore connector: vLLM's KV cache dtype {dtype} has no kvstore page dtype")


def page_spec(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None") -> tuple[KVSpec, list[str]]:
    """The kvstore page geometry of vLLM's KV cache: one page per block, all attention layers."""
    block_size = vllm_config.cache_config.block_size
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1 or not hasattr(groups[0].kv_cache_spec, "num_kv_heads"):
        raise ValueError("kvstore connector: only models with a single attention KV cache group are supported "
                         f"(this one has {len(groups)} groups)")
    spec = groups[0].kv_cache_spec
    head_size_v = getattr(spec, "head_size_v", None) or spec.head_size
    if head_size_v != spec.head_size:
        raise ValueError("kvstore connector: K and V head sizes differ; not supported")
    names = layer_order(groups[0].layer_names)
    return KVSpec(num_layers=len(names), num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
                  dtype=_dtype_name(spec.dtype), page_size=block_size), names


class KVStoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        socket_path = extra.get("socket") or os.environ.get("KVSTORE_SIDECAR_SOCKET")
        if not socket_path:
            raise ValueError("kvstore connector: set kv_connector_extra_config.socket (or KVSTORE_SIDECAR_SOCKET) "
                             "to the kvstore sidecar's socket path")
        self.spec, self.layer_names = page_spec(vllm_config, kv_cache_config)
        self.block_size = self.spec.page_size
        mc = vllm_config.model_config
        self.model_id = str(extra.get("model_id") or f"{mc.model}@{mc.revision or 'main'}")
        from vllm import __version__ as vllm_version
        from vllm.platforms import current_platform
        # the engine and its block layout; a new vLLM minor version may change the layout
        self.layout = f"{LAYOUT_VERSION}/vllm-{'.'.join(vllm_version.split('.')[:2])}/{current_platform.device_type}"
        self.load_cold_async = bool(extra.get("load_cold_async", True))
        retry_s = float(extra.get("retry_s", 2.0))
        tenant = str(extra.get("tenant", ""))
        side = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self.link = SidecarLink(str(socket_path), self.spec, self.layout, tenant, retry_s, f"vllm-{side}")
        log.info("kvstore connector (%s): sidecar %s, model %r, %s", side, socket_path, self.model_id,
                 self.spec.describe())
        # scheduler side
        self._tracked: dict[str, _Tracked] = {}
        self._matched: dict[str, tuple[int, int, dict[str, int]]] = {}  # req -> (local tokens, hit pages, tiers)
        self._loads: list[Transfer] = []
        # worker side
        self._layers: list[torch.Tensor] = []
        self._errors: set[int] = set()
        self._failed_now: set[str] = set()   # requests whose load failed in this step: save nothing of theirs
        self._failed_pages: dict[str, int] = {}   # request -> first page that did not load, for the scheduler
        self._failed_lock = threading.Lock()      # asynchronous loads report from their thread
        self._async_link = SidecarLink(str(socket_path), self.spec, self.layout, tenant, retry_s, f"vllm-{side}-async")
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: dict[str, tuple[Future, Transfer]] = {}
        self.counters = {"lookups": 0, "hit_tokens": 0, "loaded_pages": 0, "failed_pages": 0, "saved_pages": 0}

    # the namespace of a request
    def _scope(self, request: "Request") -> Scope:
        model = self.model_id
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            model += f"+lora:{lora.lora_name}:{lora.lora_int_id}"
        return Scope(model=model, salt=getattr(request, "cache_salt", None) or "")

    # ---- scheduler side -------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens = request.prompt_token_ids
        if not tokens or getattr(request, "mm_features", None):
            return 0, False   # multimodal inputs: the KV depends on more than the token ids
        usable = (len(tokens) - 1) // self.block_size    # vLLM must compute at least the last token
        if usable * self.block_size <= num_computed_tokens:
            return 0, False
        lookup_tokens = tokens[:usable * self.block_size]
        found = self.link.run(self._scope(request), "lookup", lambda c: c.lookup(lookup_tokens))
        if found is None:
            return 0, False
        self.counters["lookups"] += 1
        hit = min(found.pages, usable)
        first = num_computed_tokens // self.block_size
        if hit <= first:
            self._matched[request.request_id] = (num_computed_tokens, hit, {})
            return 0, False
        tiers: dict[str, int] = {}
        for tier in found.tiers[first:hit]:
            tiers[tier] = tiers.get(tier, 0) + self.block_size
        self._matched[request.request_id] = (num_computed_tokens, hit, tiers)
        return hit * self.block_size - num_computed_tokens, self._is_async(tiers)

    def _is_async(self, tiers: dict[str, int]) -> bool:
        """Pages in the cold tier load in the background while other requests run."""
        return self.load_cold_async and "cold" in tiers

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
        tiers = self._matched.get(request.request_id, (0, 0, {}))[2]
        if not num_external_tokens:
            return {}
        cold = min(tiers.get("cold", 0), num_external_tokens)
        out = {CacheHitSource.HOST: num_external_tokens - cold, CacheHitSource.DISK: cold}
        return {k: v for k, v in out.items() if v}

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        req_id = request.request_id
        tracked = self._tracked.get(req_id)
        if tracked is None:
            tracked = self._tracked[req_id] = _Tracked(request, self._scope(request))
        local, hit, tiers = self._matched.get(req_id, (0, 0, {}))
        tracked.stored_pages = max(tracked.stored_pages, hit)
        if num_external_tokens <= 0:
            return
        first, n = local // self.block_size, num_external_tokens // self.block_size
        block_ids = list(blocks.get_block_ids()[0])
        tokens = list(request.prompt_token_ids[:(first + n) * self.block_size])
        self._loads.append(Transfer(req_id, tracked.scope, tokens, block_ids[first:first + n], first,
                                    self._is_async(tiers)))
        self.counters["hit_tokens"] += num_external_tokens

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KVStoreMetadata(loads=self._loads)
        self._loads = []
        for load in meta.loads:
            self._matched.pop(load.req_id, None)
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0])
                self._plan_save(meta, new.req_id, tracked, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                tracked.block_ids.extend(new_blocks[0])
            self._plan_save(meta, req_id, tracked, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _plan_save(self, meta: KVStoreMetadata, req_id: str, tracked: _Tracked, computed: int) -> None:
        """Save the pages that are full of computed KV after this step and not in the sidecar yet."""
        request = tracked.request
        if not request.prompt_token_ids or getattr(request, "mm_features", None):
            return
        all_tokens = request.all_token_ids
        end = min(computed, len(all_tokens), len(tracked.block_ids) * self.block_size) // self.block_size
        if end <= tracked.stored_pages:
            return
        start = tracked.stored_pages
        meta.saves.append(Transfer(req_id, tracked.scope, list(all_tokens[:end * self.block_size]),
                                   tracked.block_ids[start:end], start))
        tracked.stored_pages = end

    def update_connector_output(self, connector_output: Any) -> None:
        """Pages that did not load are recomputed by vLLM: save them again as they fill."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        for req_id, page in getattr(meta, "failed", {}).items():
            tracked = self._tracked.get(req_id)
            if tracked is not None:
                tracked.stored_pages = min(tracked.stored_pages, page)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        return False, None   # saves happen in the step that fills a block: the blocks are free to go now

    # ---- worker side ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"kvstore connector: no KV cache for layers {missing[:3]}")
        self._layers = [kv_caches[n] for n in self.layer_names]
        check_layers(self._layers, self.layer_names, self.spec)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreMetadata)
        for load in meta.loads:
            if load.is_async:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-load")
                self._inflight[load.req_id] = (self._pool.submit(self._load, self._async_link, load), load)
            else:
                failed = self._load(self.link, load)
                if failed:
                    self._errors |= failed
                    self._failed_now.add(load.req_id)

    def _load(self, link: SidecarLink, load: Transfer) -> set[int]:
        """Copy the pages into their blocks; the ids of the blocks that could not be loaded."""
        def copy_in(client) -> int:
            lease = client.get_slots(load.tokens, len(load.block_ids), start_page=load.start_page)
            try:
                slots_to_blocks(client.warm_pages, lease.slots, self._layers, load.block_ids[:len(lease.slots)])
            finally:
                if lease.slots:
                    client.release(lease.slots)
            return len(lease.slots)

        got = link.run(load.scope, "load", copy_in) or 0
        failed = set(load.block_ids[got:])
        if failed:
            with self._failed_lock:
                self._failed_pages[load.req_id] = load.start_page + got
        self.counters["loaded_pages"] += got
        self.counters["failed_pages"] += len(failed)
        if failed:
            log.warning("kvstore: request %s: %d of %d blocks could not be loaded; vLLM recomputes them",
                        load.req_id, len(failed), len(load.block_ids))
        log.info("kvstore: request %s: loaded %d tokens (%d blocks) from kvstore, after the %d that vLLM's own "
                 "prefix cache held", load.req_id, got * self.block_size, got, load.start_page * self.block_size)
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return   # synchronous loads finish in start_load_kv, for every layer

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return   # a block is saved whole, in wait_for_save, once every layer has computed it

    def wait_for_save(self):
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVStoreMetadata):
            return
        failed, self._failed_now = self._failed_now, set()
        for save in meta.saves:
            # this step computed that request's blocks on top of blocks that did not load: vLLM
            # discards them and recomputes; saving them would cache KV that is wrong
            if save.req_id not in failed:
                self._save(save)

    def _save(self, save: Transfer) -> None:
        """Copy the blocks into fresh warm slots and commit them as the request's pages (best effort:
        with no room, the sidecar's write-behind behind, or an earlier page of the chain gone, they
        are a later miss)."""
        def copy_out(client) -> int:
            slots = client.alloc(len(save.block_ids), wait_s=0)   # the step never waits for the sidecar's disk
            try:
                blocks_to_slots(self._layers, save.block_ids, client.warm_pages, slots)
                client.put_slots(save.tokens, slots, save.start_page)
            except SidecarError as exc:
                if not isinstance(exc, SidecarUnavailable):
                    client.release(slots)
                raise
            return len(slots)

        self.counters["saved_pages"] += self.link.run(save.scope, "save", copy_out) or 0

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = {req_id for req_id, (fut, _) in self._inflight.items() if fut.done()}
        for req_id in done:
            fut, load = self._inflight.pop(req_id)
            try:
                self._errors |= fut.result()
            except Exception as exc:  # noqa: BLE001 - a broken load is a miss, never a crash
                log.warning("kvstore: request %s: load failed: %s", req_id, exc)
                self._errors |= set(load.block_ids)
        return None, (done or None)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        with self._failed_lock:
            if not self._failed_pages:
                return None
            failed, self._failed_pages = self._failed_pages, {}
        return KVStoreWorkerMetadata(failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def shutdown(self):
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.link.close()
        self._async_link.close()
