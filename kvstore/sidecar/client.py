"""Client of the kvstore sidecar (`kvstore sidecar`): SidecarClient (blocking) and
AsyncSidecarClient (asyncio), with the same methods.

    with SidecarClient("/run/kvstore/kvstore.sock", spec, model="llama-3-8b") as kv:
        hit = kv.lookup(tokens)                 # how many leading pages are cached, and where
        kv.put(tokens, pages)                   # pages: [n, layers, 2, page_size, kv_heads, head_dim]
        cached = kv.get(tokens)                 # the cached prefix's pages, copied out

Page bytes go through the sidecar's warm tier, a shared-memory segment this process maps: put
writes into slots the sidecar hands out, get copies out of slots it leases to this client. With
use_shm=False they travel in the socket frames instead (for a client that cannot map it).
layout names a client's own byte layout of a page when it is not kvstore's page-first one (another
engine's KV blocks kept as opaque bytes of the same size); it is part of the namespace.
populate=True maps the whole segment at connect (one pass, instead of a page fault on the first
use of each slot), and get(..., out=buffer) copies into a reused buffer instead of new memory:
what a long-running engine wants.
Zero-copy users handle the slots themselves: `lease = kv.get_slots(tokens)`, read `kv.view(slot)`
for each slot, then `kv.release(lease.slots)`; to store, `slots = kv.alloc(n)`, write each
`kv.view(slot)`, then `kv.put_slots(tokens, slots)`. An engine that names its pages itself (a hash
of the prefix up to each page, as SGLang's HiCache does) uses lookup_names(names),
get_slots(names=...) and put_named(names, slots) instead of tokens. The sidecar takes slots back after
sidecar.lease_s without a request from this client (`ping()` renews them).

Errors: SidecarError when the sidecar refuses a request (its one-line reason), and
SidecarUnavailable when it cannot be reached or the connection is lost. A put that the sidecar
could store only in part (its disk behind the puts for longer than daemon.backpressure_timeout_s)
raises NotStored, naming the pages not stored; `keys` has those that were.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any, Sequence

import torch

from kvstore.pages.spec import KVSpec
from kvstore.sidecar.client_ops import ClientOps, Lease, Lookup, Op, map_segment, populate_mapping, step
from kvstore.sidecar.protocol import HEADER, NotStored, SidecarError, SidecarUnavailable, decode_reply

__all__ = ["AsyncSidecarClient", "Lease", "Lookup", "NotStored", "SidecarClient", "SidecarError",
           "SidecarUnavailable", "map_segment", "populate_mapping"]

SOCKET_BUFFER_BYTES = 4 << 20   # the bytes fallback: fewer, larger copies through the socket


class SidecarClient(ClientOps):
    """A blocking client; one request at a time (not thread-safe: one client per thread)."""

    def __init__(self, socket_path: str | Path, spec: KVSpec, model: str, tenant: str = "", salt: str = "",
                 use_shm: bool = True, timeout: float | None = 60.0, client: str = "", populate: bool = False,
                 layout: str = ""):
        super().__init__(socket_path, spec, model, tenant, salt, use_shm, client, populate, layout)
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
            return decode_reply(rid, self._recv(length))
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
            finished, value = step(op, reply, error)
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

    def lookup_names(self, names: Sequence[str]) -> Lookup:
        """How many leading pages of `names` (an engine's own page names) are cached (no side effects)."""
        return self._drive(self._lookup(None, names))

    def put(self, tokens: Sequence[int], pages: torch.Tensor, start_page: int = 0) -> list[bytes]:
        """Store pages start_page.. of `tokens` (pages: [n, *spec.page_shape]); returns their keys.
        Page start_page - 1 must be cached already. Raises NotStored when only the first pages
        could be stored (the sidecar's write-behind stayed behind past its bound)."""
        return self._drive(self._put(tokens, pages, start_page))

    def get(self, tokens: Sequence[int], max_pages: int | None = None, out: torch.Tensor | None = None
            ) -> torch.Tensor:
        """The cached prefix of `tokens` (at most max_pages pages): [n, *spec.page_shape], a copy; into
        out[:n] when `out` is given (a reused buffer saves allocating, and faulting in, new memory)."""
        return self._drive(self._get(tokens, max_pages, out))

    def get_slots(self, tokens: Sequence[int] | None = None, max_pages: int | None = None, *,
                  keys: Sequence[bytes] | None = None, start_page: int = 0,
                  names: Sequence[str] | None = None) -> Lease:
        """Lease the warm slots holding the cached prefix (zero copy: read them with view(slot)),
        until release(lease.slots); of the leading cached pages of `keys` or `names` when given."""
        return self._drive(self._get_slots(tokens, max_pages, keys, start_page, names))

    def alloc(self, n: int, wait_s: float | None = None) -> list[int]:
        """n warm slots for this client to fill in place (view(slot)), then put_slots() or release().
        While the sidecar's write-behind is behind, it waits up to wait_s (at most the sidecar's
        daemon.backpressure_timeout_s, its default) before it refuses (SidecarError); an engine's
        step that must not stall passes 0."""
        return self._drive(self._alloc(n, wait_s))

    def put_slots(self, tokens: Sequence[int], slots: Sequence[int], start_page: int = 0) -> list[bytes]:
        """Store the pages written into slots from alloc() as pages start_page.. of `tokens`."""
        return self._drive(self._put_slots(tokens, slots, start_page))

    def put_named(self, names: Sequence[str], slots: Sequence[int]) -> list[bytes]:
        """Store the pages written into slots from alloc(), slot i as the page called names[i]."""
        return self._drive(self._put_named(names, slots))

    def release(self, slots: Sequence[int]) -> None:
        """End this client's leases on slots from get_slots(), or give back unused slots from alloc()."""
        self._drive(self._release(slots))

    def clear(self) -> dict:
        """Remove every page of this client's namespace (model, tenant, salt, layout) from the store:
        {"pages": removed, "kept": leased or pinned now, so kept}."""
        return self._drive(self._clear())

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


class AsyncSidecarClient(ClientOps):
    """The asyncio client: `async with AsyncSidecarClient(...) as kv:` or `await kv.connect()`.
    Tasks may share one client; its requests take turns on the connection."""

    def __init__(self, socket_path: str | Path, spec: KVSpec, model: str, tenant: str = "", salt: str = "",
                 use_shm: bool = True, timeout: float | None = 60.0, client: str = "", populate: bool = False,
                 layout: str = ""):
        super().__init__(socket_path, spec, model, tenant, salt, use_shm, client, populate, layout)
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
        return decode_reply(rid, body)

    async def _drive(self, op: Op, offload: bool = False) -> Any:
        """Run an op; with offload, its steps (page copies) run in a worker thread, off the event loop."""
        reply, error = None, None
        while True:
            finished, value = await asyncio.to_thread(step, op, reply, error) if offload else step(op, reply, error)
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

    async def lookup_names(self, names: Sequence[str]) -> Lookup:
        return await self._drive(self._lookup(None, names))

    async def put(self, tokens: Sequence[int], pages: torch.Tensor, start_page: int = 0) -> list[bytes]:
        return await self._drive(self._put(tokens, pages, start_page), offload=True)

    async def get(self, tokens: Sequence[int], max_pages: int | None = None, out: torch.Tensor | None = None
                  ) -> torch.Tensor:
        return await self._drive(self._get(tokens, max_pages, out), offload=True)

    async def get_slots(self, tokens: Sequence[int] | None = None, max_pages: int | None = None, *,
                        keys: Sequence[bytes] | None = None, start_page: int = 0,
                        names: Sequence[str] | None = None) -> Lease:
        return await self._drive(self._get_slots(tokens, max_pages, keys, start_page, names))

    async def alloc(self, n: int, wait_s: float | None = None) -> list[int]:
        return await self._drive(self._alloc(n, wait_s))

    async def put_slots(self, tokens: Sequence[int], slots: Sequence[int], start_page: int = 0) -> list[bytes]:
        return await self._drive(self._put_slots(tokens, slots, start_page))

    async def put_named(self, names: Sequence[str], slots: Sequence[int]) -> list[bytes]:
        return await self._drive(self._put_named(names, slots))

    async def release(self, slots: Sequence[int]) -> None:
        await self._drive(self._release(slots))

    async def clear(self) -> dict:
        return await self._drive(self._clear())

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
