"""The warm tier: page-first slots in one host buffer.

Layout: pages [slots, layers, 2, page_size, kv_heads, head_dim]; raw [slots, page_bytes] is the
same memory as bytes (what the cold tier reads and writes); `buffer` is all of it, flat. With
`head_room`, each slot's page is preceded by that many bytes of its own (a multiple of 64; the
slots then lie `stride` bytes apart, every page 64-byte aligned): a remote read lands a whole
record there, its head just before its page (kvstore.remote.landing), in one transfer. The buffer is pinned when CUDA is
present (fast, async DMA to and from the hot tier), and may live in a POSIX shared-memory
segment so another process (the sidecar's client) can map it; else it is in transparent huge
pages, faulted in by a thread of its own after start (buffers.Populator), so that no request
pays for a slot's first write.

Rules: a SlotTier (tiers/base.py): slots come from a SlotPool; a slot's bytes are undefined until written. Callers hold
the store lock while they allocate, free or write slots. A shared segment is named by the
caller (DataDir.shm_name: one name per data directory, 0600) and unlinked by `close`; the
caller holds the data directory's lock, so a segment of that name found at start was left by
a process that died without closing: it is unlinked and made anew.
"""

from __future__ import annotations

import logging
from multiprocessing import shared_memory

import torch

from kvstore.pages.spec import KVSpec
from kvstore.tiers.base import TIER_BACKENDS, SlotPool, SlotTier
from kvstore.tiers.buffers import Populator, as_byte_view, huge_page_buffer, round_up

log = logging.getLogger("kvstore.warm")


class HostTier(SlotTier):
    name = "warm"

    def __init__(self, spec: KVSpec, num_slots: int, pin: bool | None = None, shared: bool = False,
                 shm_name: str | None = None, head_room: int = 0):
        """`shared`: in a POSIX shared-memory segment, named `shm_name` (random when None); its slots
        are contiguous (another process maps them so), so it takes no head_room."""
        super().__init__(spec)
        if head_room % 64 or head_room < 0 or (head_room and shared):
            raise ValueError(f"head_room must be a multiple of 64 bytes, and 0 for shared memory: {head_room}")
        self.head_room = head_room
        self.stride = slot_stride(spec, head_room)
        nbytes = num_slots * self.stride
        self.shm: shared_memory.SharedMemory | None = None
        self._registered_ptr: int | None = None
        self._populator: Populator | None = None
        if shared and nbytes:
            self.shm = _create_segment(shm_name, nbytes)
            buf = torch.frombuffer(self.shm.buf, dtype=torch.uint8, count=nbytes)
            if pin is None and torch.cuda.is_available():
                torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
                self._registered_ptr = buf.data_ptr()
        else:
            pin = torch.cuda.is_available() if pin is None else pin
            if pin and nbytes:
                buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            else:   # in huge pages, faulted in behind the caller's back (Populator)
                buf = huge_page_buffer(nbytes)
                self._populator = Populator(buf, "kvstore-warm-populate")
        self.buffer = buf
        self.raw = buf.view(num_slots, self.stride)[:, head_room:head_room + spec.page_bytes]  # [slots, page_bytes]
        # [slots, layers, 2, page_size, kv_heads, head_dim]
        self.pages = self.raw.view(spec.torch_dtype).view(num_slots, *spec.page_shape)
        self.pool = SlotPool(num_slots)

    @property
    def shm_name(self) -> str | None:
        return self.shm.name if self.shm else None

    def payloads(self, slots) -> list:
        return [self.raw[s].numpy() for s in slots]   # views: valid while the slots hold these pages

    def targets(self, slots) -> list:
        """Writable host views of these slots (what an I/O tier reads into)."""
        return [self.raw[s] for s in slots]

    def store_pages(self, slots, payloads) -> None:
        for s, p in zip(slots, payloads):
            self.raw[s].numpy()[:] = as_byte_view(p)

    def close(self) -> None:
        if self._populator is not None:
            self._populator.stop()
        self.raw = self.pages = self.buffer = torch.empty(0)
        if self.shm is not None:
            if getattr(self, "_registered_ptr", None):
                torch.cuda.cudart().cudaHostUnregister(self._registered_ptr)
            self.shm.close()
            self.shm.unlink()
            self.shm = None


def slot_stride(spec: KVSpec, head_room: int) -> int:
    """Bytes from one warm slot to the next: the page, or with head_room the room and the page, to 64 bytes."""
    return spec.page_bytes if not head_room else round_up(head_room + spec.page_bytes, 64)


@TIER_BACKENDS.register("host")
def host_tier(role: str, spec: KVSpec, num_slots: int, shared: bool = False, shm_name: str | None = None,
              head_room: int = 0, **_) -> HostTier:
    """Pinned host memory (a shared-memory segment when `shared`): the warm tier."""
    tier = HostTier(spec, num_slots, shared=shared, shm_name=shm_name, head_room=head_room)
    tier.name = role
    return tier


def _create_segment(name: str | None, nbytes: int) -> shared_memory.SharedMemory:
    """A new segment; one of the same name left by a dead process is unlinked first."""
    try:
        return shared_memory.SharedMemory(name=name, create=True, size=nbytes)
    except FileExistsError:
        stale = shared_memory.SharedMemory(name=name)
        size = stale.size
        stale.close()
        stale.unlink()
        log.warning("removed the shared-memory segment /dev/shm/%s (%d bytes) left by a process that did not "
                    "stop cleanly", name, size)
    return shared_memory.SharedMemory(name=name, create=True, size=nbytes)
