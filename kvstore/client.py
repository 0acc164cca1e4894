"""Client of the kvstore sidecar (`kvstore sidecar`): SidecarClient (blocking) and
AsyncSidecarClient (asyncio), with the same methods.

    with SidecarClient("/run/kvstore/kvstore.sock", spec, model="llama-3-8b") as kv:
        hit = kv.lookup(tokens)                 # how many leading pages are cached, and where
        kv.put(tokens, pages)                   # pages: [n, layers, 2, page_size, kv_heads, head_dim]
        cached = kv.get(tokens)                 # the cached prefix's pages, copied out

Page bytes go through the sidecar's warm tier, a shared-memory segment this process maps: put
writes into slots the sidecar hands out, get copies out of slots it leases to this client. With
use_shm=False they travel in the socket frames instead (for a client that cannot map it).
populate=True maps the whole segment at connect (one pass, instead of a page fault on the first
use of each slot), and get(..., out=buffer) copies into a reused buffer instead of new memory:
what a long-running engine wants.
Zero-copy users handle the slots themselves: `lease = kv.get_slots(tokens)`, read `kv.view(slot)`
for each slot, then `kv.release(lease.slots)`; to store, `slots = kv.alloc(n)`, write each
`kv.view(slot)`, then `kv.put_slots(tokens, slots)`. The sidecar takes slots back after
sidecar.lease_s without a request from this client (`ping()` renews them).

Errors: SidecarError when the sidecar refuses a request (its one-line reason), and
SidecarUnavailable when it cannot be reached or the connection is lost.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import socket
import struct
import sys
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Any, Generator, Sequence

import msgpack
import numpy as np
import torch

from kvstore.errors import KVStoreError
from kvstore.spec import KVSpec
from kvstore.tiers.base import runs

HEADER = struct.Struct(">I")
SPEC_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "dtype", "page_size")
FRAME_SLACK = 4096   # a bytes frame's room for everything but its pages and tokens
MADV_POPULATE_WRITE = 23   # Linux >= 5.14
SOCKET_BUFFER_BYTES = 4 << 20   # the bytes fallback: fewer, larger copies through the socket

Op = Generator[dict, dict, Any]   # yields requests, receives their replies, returns the result


class SidecarError(KVStoreError):
    """The sidecar refused a request; the message is its reason."""


class SidecarUnavailable(SidecarError):
    """The sidecar cannot be reached, or the connection to it was lost."""


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


class _Protocol:
    """What both clients share: the hello, the shared mapping, and each op as a generator of requests."""

    def __init__(self, socket_path: str | Path, spec: KVSpec, model: str, tenant: str = "", salt: str = "",
                 use_shm: bool = True, client: str = "", populate: bool = False):
        self.socket_path = str(socket_path)
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
        body = msgpack.packb({**request, "id": rid}, use_bin_type=True)
        return rid, HEADER.pack(len(body)), body

    @staticmethod
    def _check(rid: int, body: bytes) -> dict:
        try:
            reply = msgpack.unpackb(body, raw=False)
        except Exception as exc:  # noqa: BLE001
            raise SidecarUnavailable(f"kvstore sidecar sent a frame that is not msgpack ({exc})") from None
        if not isinstance(reply, dict) or "ok" not in reply:
            raise SidecarUnavailable("kvstore sidecar sent a frame that is not a reply")
        if not reply["ok"]:
            raise SidecarError(reply.get("error") or "request refused")
        if reply.get("id") != rid:
            raise SidecarUnavailable(f"kvstore sidecar answered request {reply.get('id')}, expected {rid}")
        return reply

    def _unavailable(self, exc: BaseException, doing: str = "talk to") -> SidecarUnavailable:
        if doing == "talk to" and isinstance(exc, (BrokenPipeError, ConnectionResetError)):
            exc = EOFError("the sidecar closed the connection")
        why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        return SidecarUnavailable(f"cannot {doing} kvstore sidecar at {self.socket_path}: {why}")

    # hello and the mapping
    def _hello(self) -> Op:
        reply = yield {"op": "hello", "spec": {f: getattr(self.spec, f) for f in SPEC_FIELDS}, "model": self.model,
                       "tenant": self.tenant, "salt": self.salt, "client": self.client}
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

    # ops
    def _lookup(self, tokens: Sequence[int]) -> Op:
        r = yield {"op": "lookup", "tokens": _token_list(tokens)}
        return Lookup(r["pages"], r["tokens"], r["tiers"], [bytes.fromhex(k) for k in r["keys"]])

    def _put(self, tokens: Sequence[int], pages: torch.Tensor, start_page: int) -> Op:
        tokens = _token_list(tokens)
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
                k = min(n - done, max(1, self.info["slots"] // 2))
                slots = (yield {"op": "alloc", "n": k})["slots"]
                try:
                    for src, dst, run in runs(list(range(done, done + k)), slots):
                        self._raw[dst:dst + run].copy_(flat[src:src + run])
                    r = yield {"op": "put", "tokens": tokens[:(first + k) * ps], "slots": slots, "start_page": first}
                except SidecarError as exc:
                    if not isinstance(exc, SidecarUnavailable):
                        yield {"op": "release", "slots": slots}
                    raise
            else:
                k = min(n - done, self._frame_pages(len(tokens)))
                payload = flat[done:done + k].cpu().numpy()
                r = yield {"op": "put", "tokens": tokens[:(first + k) * ps], "start_page": first,
                           "pages": [memoryview(payload[i]) for i in range(k)]}
            keys += [bytes.fromhex(key) for key in r["keys"]]
            done += k
        return keys

    def _get_slots(self, tokens: Sequence[int] | None, max_pages: int | None, keys: Sequence[bytes] | None,
                   start_page: int) -> Op:
        req: dict = {"op": "get", "start_page": start_page, "max_pages": max_pages}
        if keys is not None:
            req["keys"] = [k.hex() for k in keys]
        else:
            req["tokens"] = _token_list(tokens)
        r = yield req
        return Lease([bytes.fromhex(k) for k in r["keys"]], r["slots"])

    def _get(self, tokens: Sequence[int], max_pages: int | None, out: torch.Tensor | None) -> Op:
        tokens = _token_list(tokens)
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

    def _alloc(self, n: int) -> Op:
        return (yield {"op": "alloc", "n": n})["slots"]

    def _put_slots(self, tokens: Sequence[int], slots: Sequence[int], start_page: int) -> Op:
        r = yield {"op": "put", "tokens": _token_list(tokens), "slots": [int(s) for s in slots],
                   "start_page": start_page}
        return [bytes.fromhex(k) for k in r["keys"]]

    def _release(self, slots: Sequence[int]) -> Op:
        yield {"op": "release", "slots": [int(s) for s in slots]}

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


def _step(op: Op, reply: dict | None, error: BaseException | None) -> tuple[bool, Any]:
    """Advance an op: (False, its next request) or (True, its result)."""
    try:
        return False, (op.throw(error) if error is not None else op.send(reply))
    except StopIteration as done:
        return True, done.value


def _token_list(tokens: Sequence[int]) -> list[int]:
    if isinstance(tokens, torch.Tensor):
        return tokens.tolist()
    return [int(t) for t in tokens]


class SidecarClient(_Protocol):
    """A blocking client; one request at a time (not thread-safe: one client per thread)."""

    def __init__(self, socket_path: str | Path, spec: KVSpec, model: str, tenant: str = "", salt: str = "",
                 use_shm: bool = True, timeout: float | None = 60.0, client: str = "", populate: bool = False):
        super().__init__(socket_path, spec, model, tenant, salt, use_shm, client, populate)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        self._buffer = bytearray()   # reused for large replies (the bytes fallback's pages)
        if not use_shm:
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                self._sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        try:
            self._sock.connect(self.socket_path)
        except OSError as exc:
            self._sock.close()
            raise self._unavailable(exc, "connect to") from None
        try:
            self._drive(self._hello())
        except BaseException:
            self.close()
            raise

    def _call(self, request: dict) -> dict:
        if self._sock is None:
            raise SidecarUnavailable(f"the connection to kvstore sidecar at {self.socket_path} is closed")
        rid, header, body = self._frame(request)
        try:
            if len(body) < 65536:
                self._sock.sendall(header + body)
            else:
                self._sock.sendall(header)
                self._sock.sendall(body)
            (length,) = HEADER.unpack(self._recv(HEADER.size))
            return self._check(rid, self._recv(length))
        except (OSError, EOFError) as exc:
            self._disconnect()
            raise self._unavailable(exc) from None

    def _recv(self, n: int) -> bytes | memoryview:
        if n > len(self._buffer):
            self._buffer = bytearray(n)
        view, got = memoryview(self._buffer)[:n], 0
        while got < n:
            k = self._sock.recv_into(view[got:])
            if not k:
                raise EOFError("the sidecar closed the connection")
            got += k
        return view

    def _drive(self, op: Op) -> Any:
        reply, error = None, None
        while True:
            finished, value = _step(op, reply, error)
            if finished:
                return value
            request, reply, error = value, None, None
            try:
                reply = self._call(request)
            except SidecarError as exc:
                error = exc

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    # the API
    def lookup(self, tokens: Sequence[int]) -> Lookup:
        """How many leading full pages of `tokens` are cached, and in which tiers (no side effects)."""
        return self._drive(self._lookup(tokens))

    def put(self, tokens: Sequence[int], pages: torch.Tensor, start_page: int = 0) -> list[bytes]:
        """Store pages start_page.. of `tokens` (pages: [n, *spec.page_shape]); returns their keys.
        Page start_page - 1 must be cached already."""
        return self._drive(self._put(tokens, pages, start_page))

    def get(self, tokens: Sequence[int], max_pages: int | None = None, out: torch.Tensor | None = None
            ) -> torch.Tensor:
        """The cached prefix of `tokens` (at most max_pages pages): [n, *spec.page_shape], a copy; into
        out[:n] when `out` is given (a reused buffer saves allocating, and faulting in, new memory)."""
        return self._drive(self._get(tokens, max_pages, out))

    def get_slots(self, tokens: Sequence[int] | None = None, max_pages: int | None = None, *,
                  keys: Sequence[bytes] | None = None, start_page: int = 0) -> Lease:
        """Lease the warm slots holding the cached prefix (zero copy: read them with view(slot)),
        until release(lease.slots)."""
        return self._drive(self._get_slots(tokens, max_pages, keys, start_page))

    def alloc(self, n: int) -> list[int]:
        """n warm slots for this client to fill in place (view(slot)), then put_slots() or release()."""
        return self._drive(self._alloc(n))

    def put_slots(self, tokens: Sequence[int], slots: Sequence[int], start_page: int = 0) -> list[bytes]:
        """Store the pages written into slots from alloc() as pages start_page.. of `tokens`."""
        return self._drive(self._put_slots(tokens, slots, start_page))

    def release(self, slots: Sequence[int]) -> None:
        """End this client's leases on slots from get_slots(), or give back unused slots from alloc()."""
        self._drive(self._release(slots))

    def stats(self) -> dict:
        return self._drive(self._stats())

    def ping(self) -> None:
        """Renew this client's leases (any request does)."""
        self._drive(self._ping())

    def close(self) -> None:
        """Disconnect; the sidecar releases this client's leases. Drop views from view() first."""
        self._disconnect()
        self._unmap()

    def __enter__(self) -> "SidecarClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncSidecarClient(_Protocol):
    """The asyncio client: `async with AsyncSidecarClient(...) as kv:` or `await kv.connect()`.
    Tasks may share one client; its requests take turns on the connection."""

    def __init__(self, socket_path: str | Path, spec: KVSpec, model: str, tenant: str = "", salt: str = "",
                 use_shm: bool = True, timeout: float | None = 60.0, client: str = "", populate: bool = False):
        super().__init__(socket_path, spec, model, tenant, salt, use_shm, client, populate)
        self.timeout = timeout
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._turn = asyncio.Lock()

    async def connect(self) -> "AsyncSidecarClient":
        try:
            self._reader, self._writer = await asyncio.wait_for(
                asyncio.open_unix_connection(self.socket_path, limit=1 << 20), self.timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            raise self._unavailable(exc, "connect to") from None
        try:
            await self._drive(self._hello())
        except BaseException:
            await self.close()
            raise
        return self

    async def _call(self, request: dict) -> dict:
        if self._writer is None:
            raise SidecarUnavailable(f"the connection to kvstore sidecar at {self.socket_path} is closed")
        rid, header, body = self._frame(request)
        try:
            async with self._turn:
                self._writer.write(header)
                self._writer.write(body)
                await asyncio.wait_for(self._writer.drain(), self.timeout)
                (length,) = HEADER.unpack(await asyncio.wait_for(self._reader.readexactly(HEADER.size), self.timeout))
                body = await asyncio.wait_for(self._reader.readexactly(length), self.timeout)
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
            await self._disconnect()
            if isinstance(exc, asyncio.IncompleteReadError):
                exc = EOFError("the sidecar closed the connection")
            raise self._unavailable(exc) from None
        except asyncio.CancelledError:  # a reply may still come: this connection is out of step now
            if self._writer is not None:
                self._writer.close()
                self._writer = self._reader = None
            raise
        return self._check(rid, body)

    async def _drive(self, op: Op, offload: bool = False) -> Any:
        """Run an op; with offload, its steps (page copies) run in a worker thread, off the event loop."""
        reply, error = None, None
        while True:
            finished, value = await asyncio.to_thread(_step, op, reply, error) if offload else _step(op, reply, error)
            if finished:
                return value
            request, reply, error = value, None, None
            try:
                reply = await self._call(request)
            except SidecarError as exc:
                error = exc

    async def _disconnect(self) -> None:
        writer, self._writer, self._reader = self._writer, None, None
        if writer is not None:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass

    # the API (see SidecarClient)
    async def lookup(self, tokens: Sequence[int]) -> Lookup:
        return await self._drive(self._lookup(tokens))

    async def put(self, tokens: Sequence[int], pages: torch.Tensor, start_page: int = 0) -> list[bytes]:
        return await self._drive(self._put(tokens, pages, start_page), offload=True)

    async def get(self, tokens: Sequence[int], max_pages: int | None = None, out: torch.Tensor | None = None
                  ) -> torch.Tensor:
        return await self._drive(self._get(tokens, max_pages, out), offload=True)

    async def get_slots(self, tokens: Sequence[int] | None = None, max_pages: int | None = None, *,
                        keys: Sequence[bytes] | None = None, start_page: int = 0) -> Lease:
        return await self._drive(self._get_slots(tokens, max_pages, keys, start_page))

    async def alloc(self, n: int) -> list[int]:
        return await self._drive(self._alloc(n))

    async def put_slots(self, tokens: Sequence[int], slots: Sequence[int], start_page: int = 0) -> list[bytes]:
        return await self._drive(self._put_slots(tokens, slots, start_page))

    async def release(self, slots: Sequence[int]) -> None:
        await self._drive(self._release(slots))

    async def stats(self) -> dict:
        return await self._drive(self._stats())

    async def ping(self) -> None:
        await self._drive(self._ping())

    async def close(self) -> None:
        await self._disconnect()
        self._unmap()

    async def __aenter__(self) -> "AsyncSidecarClient":
        return await self.connect()

    async def __aexit__(self, *exc) -> None:
        await self.close()
