"""The hot tier: the paged KV pool the attention kernels read, on the GPU (CPU when there is none).

Layout: one tensor per layer in FlashInfer's NHD paged layout with K and V apart, all views of
one buffer:
    kv     [layers, 2, pages, page_size, kv_heads, head_dim]
    layers [2, pages, page_size, kv_heads, head_dim]  (kv[l]; K is kv[l][0], V kv[l][1])
With K and V apart, the keys of consecutive slots are one strided run of tokens, so attention
reads a run of a sequence's pages where it lies, without gathering it first.

Rules: a SlotTier (tiers/base.py): slots come from a SlotPool; a slot's bytes are whatever was last written. Copies to and
from the warm tier complete before the call returns (on CUDA they run on a dedicated copy
stream that first waits for the compute stream, and end with an event), so the caller may free
the source slot at once; on the CPU they run on the calling thread alone (copy_serial: the
store's threads must not start thread teams beside the engine's). Callers hold the store lock.
"""

from __future__ import annotations

import torch

from kvstore.pages.spec import KVSpec
from kvstore.tiers.base import TIER_BACKENDS, SlotPool, SlotTier, done, runs
from kvstore.tiers.buffers import copy_bytes_serial, copy_serial, huge_page_buffer
from kvstore.tiers.host import HostTier


def _dma_runs(src: list[int], dst: list[int], warm: HostTier) -> list[tuple[int, int, int]]:
    """runs(src, dst) for copies between the device and warm, each one DMA: a run of warm slots is
    contiguous only where warm leaves no head room between its pages; else one page a copy (PyTorch
    would stage a strided host run through unpinned memory, and copy it synchronously)."""
    if not warm.head_room:
        return runs(src, dst)
    return [(s, d, 1) for s, d in zip(src, dst)]


@TIER_BACKENDS.register("device")
def device_tier(role: str, spec: KVSpec, num_slots: int, device: str | torch.device = "cpu", **_) -> DeviceTier:
    """The paged KV pool on the GPU (or CPU): the hot tier."""
    tier = DeviceTier(spec, num_slots, device)
    tier.name = role
    return tier


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class DeviceTier(SlotTier):
    name = "hot"

    def __init__(self, spec: KVSpec, num_pages: int, device: str | torch.device = "cpu"):
        super().__init__(spec)
        self.device = torch.device(device)
        self.num_pages = num_pages
        # [layers, 2, pages, page_size, kv_heads, head_dim]
        shape = (spec.num_layers, *spec.layer_shape(num_pages))
        if self.device.type == "cpu":   # zeroed at start, in huge pages as warm is
            self.kv = huge_page_buffer(num_pages * spec.page_bytes, zero=True) \
                .view(spec.torch_dtype).view(shape)
        else:
            self.kv = torch.zeros(shape, dtype=spec.torch_dtype, device=self.device)
        self.layers = list(self.kv.unbind(0))
        self.pool = SlotPool(num_pages)
        self.on_cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.on_cuda else None

    # the tier interface: the warm tier has fast paths (save_to, load_from), others go through host bytes
    def payloads(self, slots) -> list:
        gathered = self.gather(list(slots)).cpu() if slots else None   # [n, layers, 2, page_size, kv_heads, head_dim]
        return [gathered[i].view(torch.uint8).reshape(-1).numpy() for i in range(len(slots))]

    def store_pages(self, slots, payloads) -> None:
        if slots and not self.on_cuda:
            for slot, payload in zip(slots, payloads):
                copy_bytes_serial(self.pages_view(slot, 1)[0], payload)
        elif slots:
            pages = torch.stack([torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in payloads])
            self.scatter(list(slots), pages.view(self.spec.torch_dtype))

    def read_into(self, handles, dst, dst_slots):
        if isinstance(dst, HostTier):
            self.save_to(list(handles), dst, list(dst_slots))
            return done([True] * len(handles))
        return super().read_into(handles, dst, dst_slots)

    def write_from(self, src, src_slots, handles):
        if isinstance(src, HostTier):
            self.load_from(list(handles), src, list(src_slots))
            return done([True] * len(handles))
        return super().write_from(src, src_slots, handles)

    # page-first views of single pages (tests, the engine, the sidecar)
    def read_page(self, slot: int) -> torch.Tensor:
        """A page-first copy of one slot in host memory: [layers, 2, page_size, kv_heads, head_dim]."""
        return self.kv[:, :, slot].to("cpu", copy=True)

    def write_page(self, slot: int, page: torch.Tensor) -> None:
        self.kv[:, :, slot].copy_(page.view(self.spec.page_shape))

    def pages_view(self, start: int, n: int) -> torch.Tensor:
        """Slots start..start+n-1 seen page-first (a view): [n, layers, 2, page_size, kv_heads, head_dim]."""
        return self.kv[:, :, start:start + n].permute(2, 0, 1, 3, 4, 5)

    def gather(self, slots: list[int]) -> torch.Tensor:
        """Page-first copy of several slots on this device: [n, layers, 2, page_size, kv_heads, head_dim]."""
        if not self.on_cuda:
            out = torch.empty((len(slots), *self.spec.page_shape), dtype=self.spec.torch_dtype)
            for s, d, n in runs(slots, list(range(len(slots)))):
                copy_serial(out[d:d + n], self.pages_view(s, n))
            return out
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        return self.kv.index_select(2, idx).permute(2, 0, 1, 3, 4, 5).contiguous()

    def scatter(self, slots: list[int], pages: torch.Tensor) -> None:
        """Write page-first pages [n, layers, ...] (any device) into slots."""
        pages = pages.to(self.device, non_blocking=True).view(len(slots), *self.spec.page_shape)
        if not self.on_cuda:
            for s, d, n in runs(list(range(len(slots))), slots):
                copy_serial(self.pages_view(d, n), pages[s:s + n])
            return
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        self.kv.index_copy_(2, idx, pages.permute(1, 2, 0, 3, 4, 5))

    def save_to(self, slots: list[int], warm: HostTier, warm_slots: list[int]) -> None:
        """Copy hot slots into warm slots (page-first)."""
        if not slots:
            return
        if not self.on_cuda:
            for s, d, n in runs(slots, warm_slots):
                copy_serial(warm.pages[d:d + n], self.pages_view(s, n))
            return
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_stream(compute)  # the page's last writes are on the compute stream
            staging = self.gather(slots)  # on-device gather at HBM speed, then one DMA per run
            i = 0
            for _, d, n in _dma_runs(list(range(len(slots))), warm_slots, warm):
                warm.pages[d:d + n].copy_(staging[i:i + n], non_blocking=True)
                i += n
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        done.synchronize()

    def load_from(self, slots: list[int], warm: HostTier, warm_slots: list[int]) -> None:
        """Copy warm slots into hot slots."""
        if not slots:
            return
        if not self.on_cuda:
            for s, d, n in runs(warm_slots, slots):
                copy_serial(self.pages_view(d, n), warm.pages[s:s + n])
            return
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_stream(compute)  # earlier readers of these slots come first
            staging = torch.empty((len(slots), *self.spec.page_shape), dtype=self.spec.torch_dtype,
                                  device=self.device)
            i = 0
            for s, _, n in _dma_runs(warm_slots, list(range(len(slots))), warm):
                staging[i:i + n].copy_(warm.pages[s:s + n], non_blocking=True)
                i += n
            self.scatter(slots, staging)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        done.synchronize()

    def close(self) -> None:
        self.layers = []
        self.kv = torch.empty(0)
