"""ClientOps: what both sidecar clients (kvstore.sidecar.client) share: the hello, the mapping of the
sidecar's shared-memory warm tier, and each op as a generator of requests. An op yields each
request and receives its reply (or has the SidecarError thrown in); the blocking and the
asyncio client only differ in how they carry the frames (step() advances an op).
"""

from __future__ import annotations

import ctypes
import itertools
import sys
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Any, Generator, Sequence

import numpy as np
import torch

from kvstore.pages.spec import KVSpec
from kvstore.sidecar.protocol import NotStored, SidecarError, SidecarUnavailable, frame_parts, spec_fields
from kvstore.tiers.base import runs

FRAME_SLACK = 4096   # a bytes frame's room for everything but its pages and tokens
MADV_POPULATE_WRITE = 23   # Linux >= 5.14

Op = Generator[dict, dict, Any]   # yields requests, receives their replies, returns the result


@dataclass
class Lookup:
    pages: int               # leading full pages cached
    tokens: int              # pages x page_size
    tiers: list[str]         # the fastest tier of each page: hot, warm or cold
    keys: list[bytes]


@dataclass
class Lease:
    """Warm slots leased to this client, holding the pages named by `keys`, in order."""

    keys: list[bytes]
    slots: list[int]


_kept_mapped: list = []   # segments whose views outlived close(): mapped until the process exits


def map_segment(name: str) -> shared_memory.SharedMemory:
    """Map the sidecar's shared-memory segment without adopting it: this process must never unlink it
    (Python < 3.13 registers every mapped segment with a tracker that unlinks it at exit)."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name, track=False)
    shm = shared_memory.SharedMemory(name)
    resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 - the name the tracker knows
    return shm


def populate_mapping(buffer: torch.Tensor) -> bool:
    """Map all of a shared buffer into this process now (Linux MADV_POPULATE_WRITE), so the first
    copy into each slot does not pay page faults; a no-op where the kernel lacks it (before 5.14)."""
    if not sys.platform.startswith("linux") or not buffer.numel():
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(buffer.data_ptr(), buffer.numel() * buffer.element_size(), MADV_POPULATE_WRITE) == 0


class ClientOps:
    """What both clients share: the hello, the shared mapping, and each op as a generator of requests."""

    def __init__(self, socket_path: str | Path, spec: KVSpec, model: str, tenant: str = "", salt: str = "",
                 use_shm: bool = True, client: str = "", populate: bool = False, layout: str = ""):
        self.socket_path = str(socket_path)
        self.layout = layout
        self.populate = populate
        self.spec, self.model, self.tenant, self.salt = spec, model, tenant, salt
        self.use_shm = use_shm
        self.client = client
        self.info: dict = {}
        self._ids = itertools.count(1)
        self._shm: shared_memory.SharedMemory | None = None
        self._raw: torch.Tensor | None = None     # [slots, page_bytes] uint8, the sidecar's warm tier
        self._pages: torch.Tensor | None = None   # [slots, layers, 2, page_size, kv_heads, head_dim]

    # framing
    def _frame(self, request: dict) -> tuple[int, bytes, bytes]:
        rid = next(self._ids)
        return (rid, *frame_parts({**request, "id": rid}))

    def _unavailable(self, exc: BaseException, doing: str = "talk to") -> SidecarUnavailable:
        if doing == "talk to" and isinstance(exc, (BrokenPipeError, ConnectionResetError)):
            exc = EOFError("the sidecar closed the connection")
        why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        return SidecarUnavailable(f"cannot {doing} kvstore sidecar at {self.socket_path}: {why}")

    # hello and the mapping
    def _hello(self) -> Op:
        reply = yield {"op": "hello", "spec": spec_fields(self.spec), "model": self.model,
                       "tenant": self.tenant, "salt": self.salt, "client": self.client,
                       "layout": self.layout}
        self.info = reply
        if self.use_shm:
            self._map(reply["shm"], reply["slots"], reply["page_bytes"])
        return reply

    def _map(self, name: str, slots: int, page_bytes: int) -> None:
        try:
            shm = map_segment(name)
        except OSError as exc:
            raise SidecarError(f"cannot map the sidecar's shared memory {name!r}: {exc.strerror or exc} "
                               "(use_shm=False sends page bytes through the socket)") from None
        if shm.size < slots * page_bytes:
            shm.close()
            raise SidecarError(f"the sidecar's shared memory {name!r} is {shm.size} bytes, "
                               f"expected {slots} x {page_bytes}")
        self._shm = shm
        self._raw = torch.frombuffer(shm.buf, dtype=torch.uint8, count=slots * page_bytes).view(slots, page_bytes)
        self._pages = self._raw.view(self.spec.torch_dtype).view(slots, *self.spec.page_shape)
        if self.populate:
            populate_mapping(self._raw)

    def _unmap(self) -> None:
        self._raw = self._pages = None
        if self._shm is not None:
            try:
                self._shm.close()
            except BufferError:  # views from view() are still alive
                _kept_mapped.append(self._shm)
            self._shm = None

    def view(self, slot: int) -> torch.Tensor:
        """The page in a warm slot, in place in shared memory: [layers, 2, page_size, kv_heads, head_dim].
        Valid while this client holds the slot's lease; drop it before close()."""
        if self._pages is None:
            raise SidecarError("view: the shared memory is not mapped (use_shm=False, or closed)")
        return self._pages[slot]

    @property
    def warm_pages(self) -> torch.Tensor:
        """All of the sidecar's warm slots, in place in shared memory: [slots, layers, 2, page_size,
        kv_heads, head_dim]; index it with slots this client holds (batched copies of many pages)."""
        if self._pages is None:
            raise SidecarError("warm_pages: the shared memory is not mapped (use_shm=False, or closed)")
        return self._pages

    # ops
    def _lookup(self, tokens: Sequence[int] | None, names: Sequence[str] | None = None) -> Op:
        r = yield ({"op": "lookup", "names": list(names)} if names is not None
                   else {"op": "lookup", "tokens": token_list(tokens)})
        return Lookup(r["pages"], r["tokens"], r["tiers"], [bytes.fromhex(k) for k in r["keys"]])

    def _put(self, tokens: Sequence[int], pages: torch.Tensor, start_page: int) -> Op:
        tokens = token_list(tokens)
        flat = self._page_bytes(pages)   # [n, page_bytes] uint8
        n, ps = flat.shape[0], self.spec.page_size
        if (start_page + n) * ps > len(tokens):
            raise SidecarError(f"put: pages {start_page}..{start_page + n - 1} need {(start_page + n) * ps} tokens, "
                               f"got {len(tokens)}")
        keys: list[bytes] = []
        done = 0
        while done < n:
            first = start_page + done
            if self.use_shm:
                want = min(n - done, max(1, self.info["slots"] // 2))
                got = yield {"op": "alloc", "n": want, "partial": True}
                slots, short = got["slots"], got.get("short", "")
                k = len(slots)
                try:
                    for src, dst, run in runs(list(range(done, done + k)), slots):
                        self._raw[dst:dst + run].copy_(flat[src:src + run])
                    r = (yield {"op": "put", "tokens": tokens[:(first + k) * ps], "slots": slots, "start_page": first}
                         ) if k else {"keys": []}
                except SidecarError as exc:
                    if not isinstance(exc, SidecarUnavailable) and k:
                        yield {"op": "release", "slots": slots}
                    raise
            else:
                want = min(n - done, self._frame_pages(len(tokens)))
                payload = flat[done:done + want].cpu().numpy()
                r = yield {"op": "put", "tokens": tokens[:(first + want) * ps], "start_page": first,
                           "pages": [memoryview(payload[i]) for i in range(want)]}
                k, short = len(r["keys"]), r.get("not_stored", {}).get("why", "")
            keys += [bytes.fromhex(key) for key in r["keys"]]
            done += k
            if k < want:   # the sidecar's write-behind is behind: the rest is not stored
                raise NotStored(keys, start_page + done, n - done, short or "no room in the warm tier")
        return keys

    def _get_slots(self, tokens: Sequence[int] | None, max_pages: int | None, keys: Sequence[bytes] | None,
                   start_page: int, names: Sequence[str] | None = None) -> Op:
        req: dict = {"op": "get", "start_page": start_page, "max_pages": max_pages}
        if names is not None:
            req["names"] = list(names)
        elif keys is not None:
            req["keys"] = [k.hex() for k in keys]
        else:
            req["tokens"] = token_list(tokens)
        r = yield req
        return Lease([bytes.fromhex(k) for k in r["keys"]], r["slots"])

    def _get(self, tokens: Sequence[int], max_pages: int | None, out: torch.Tensor | None) -> Op:
        tokens = token_list(tokens)
        dest = None
        if out is not None:
            if not out.is_contiguous() or (not self.use_shm and out.device.type != "cpu"):
                raise SidecarError("get: out must be a contiguous tensor (on the CPU without shared memory)")
            dest = self._page_bytes(out, "get: out")   # [capacity, page_bytes], the same memory
            max_pages = len(dest) if max_pages is None else min(max_pages, len(dest))
        chunk = max(1, self.info["slots"] // 2) if self.use_shm else self._frame_pages(0)
        parts: list[torch.Tensor] = []
        got = 0
        while max_pages is None or got < max_pages:
            want = chunk if max_pages is None else min(chunk, max_pages - got)
            req = {"op": "get", "tokens": tokens, "start_page": got, "max_pages": want}
            if self.use_shm:
                slots = (yield req)["slots"]
                try:
                    part = (dest[got:got + len(slots)] if dest is not None
                            else torch.empty((len(slots), self.spec.page_bytes), dtype=torch.uint8))
                    for src, dst, run in runs(slots, list(range(len(slots)))):
                        part[dst:dst + run].copy_(self._raw[src:src + run])
                finally:
                    if slots:
                        yield {"op": "release", "slots": slots}
            else:
                pages = (yield {**req, "bytes": True})["pages"]
                part = (dest[got:got + len(pages)] if dest is not None
                        else torch.empty((len(pages), self.spec.page_bytes), dtype=torch.uint8))
                array = part.numpy()
                for i, page in enumerate(pages):
                    array[i] = np.frombuffer(page, dtype=np.uint8)
            parts.append(part)
            got += len(part)
            if len(part) < want:
                break
        if out is not None:
            return out[:got]
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        return flat.view(self.spec.torch_dtype).view(len(flat), *self.spec.page_shape)

    def _alloc(self, n: int, wait_s: float | None) -> Op:
        return (yield {"op": "alloc", "n": n, **({"wait_s": wait_s} if wait_s is not None else {})})["slots"]

    def _put_slots(self, tokens: Sequence[int], slots: Sequence[int], start_page: int) -> Op:
        r = yield {"op": "put", "tokens": token_list(tokens), "slots": [int(s) for s in slots],
                   "start_page": start_page}
        return [bytes.fromhex(k) for k in r["keys"]]

    def _put_named(self, names: Sequence[str], slots: Sequence[int]) -> Op:
        r = yield {"op": "put", "names": list(names), "slots": [int(s) for s in slots]}
        return [bytes.fromhex(k) for k in r["keys"]]

    def _release(self, slots: Sequence[int]) -> Op:
        yield {"op": "release", "slots": [int(s) for s in slots]}

    def _clear(self) -> Op:
        r = yield {"op": "clear"}
        return {"pages": r["pages"], "kept": r["kept"]}

    def _stats(self) -> Op:
        r = yield {"op": "stats"}
        return {k: v for k, v in r.items() if k not in ("id", "ok")}

    def _ping(self) -> Op:
        yield {"op": "ping"}

    # helpers
    def _page_bytes(self, pages: torch.Tensor, what: str = "put: pages") -> torch.Tensor:
        """[n, page_bytes] uint8 of page-first pages (a view when they are contiguous)."""
        shape = tuple(pages.shape[1:])
        if pages.dim() != 6 or shape != self.spec.page_shape or pages.dtype != self.spec.torch_dtype:
            raise SidecarError(f"{what} must be [n, {', '.join(map(str, self.spec.page_shape))}] of "
                               f"{self.spec.dtype}, got {list(pages.shape)} of {pages.dtype}")
        return pages.detach().contiguous().view(torch.uint8).view(len(pages), self.spec.page_bytes)

    def _frame_pages(self, num_tokens: int) -> int:
        """Pages that fit in one bytes frame next to `num_tokens` tokens."""
        room = self.info["max_frame_bytes"] - FRAME_SLACK - 5 * num_tokens
        n = min(room // (self.spec.page_bytes + 8), self.info["frame_pages"] or room)
        if n < 1:
            raise SidecarError(f"a page ({self.spec.page_bytes} bytes) does not fit in a frame of the sidecar "
                               f"(sidecar.max_frame_bytes {self.info['max_frame_bytes']}); use shared memory")
        return n


def step(op: Op, reply: dict | None, error: BaseException | None) -> tuple[bool, Any]:
    """Advance an op: (False, its next request) or (True, its result)."""
    try:
        return False, (op.throw(error) if error is not None else op.send(reply))
    except StopIteration as done:
        return True, done.value


def token_list(tokens: Sequence[int]) -> list[int]:
    if isinstance(tokens, torch.Tensor):
        return tokens.tolist()
    return [int(t) for t in tokens]
