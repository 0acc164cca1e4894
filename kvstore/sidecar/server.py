"""SidecarServer: the sidecar's Unix socket server. It serves the wire protocol (kvstore.sidecar.protocol)
to clients in other processes (kvstore.sidecar.client), one Session (its leases) per connection, and
runs the store's methods in the store daemon's worker threads (store.daemon.run).

Page bytes do not cross the socket: the warm tier lives in a POSIX shared-memory segment that
the client maps too ([slots, page_bytes], page-first pages), and requests carry slot numbers.

Errors: a request the store refuses (wrong spec, ops before hello, unknown slots, no room) gets
an error reply and the connection goes on. A malformed frame (bad length, over
sidecar.max_frame_bytes, not msgpack, not a map, unknown op, wrong field types) gets an error
reply, then that connection is closed; the others are served on.

Backpressure: a put's slots come from allocate_warm, which waits (daemon.backpressure_timeout_s)
while the write-behind queue is at its bound; past it an alloc with `partial` gets the slots that
fit and the reply's `short` says why, and an inline put stores the pages that fit and names the
others (`not_stored`). Nothing acknowledged is dropped.

Draining (SIGTERM): stop accepting, finish the requests in flight, close every connection (their
leases end); the command (kvstore.sidecar.command) then closes the store, whose daemon writes
every page not yet in cold before it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import numpy as np

from kvstore.config import Config
from kvstore.errors import ConfigError, KVStoreError
from kvstore.pages.keys import Namespace, named_key
from kvstore.sidecar.protocol import (SPEC_FIELDS, ProtocolError, decode_request, encode_frame, error_frame, get_count,
                              get_field, get_ints, get_keys, get_names, get_tokens, one_line, read_frame, spec_fields)
from kvstore.pages.spec import KVSpec
from kvstore.sidecar.session import Session
from kvstore.store.tiered import TieredStore

log = logging.getLogger("kvstore.sidecar")

FRAME_SLACK = 64 * 1024   # room for everything but the pages in a bytes frame (at most 1/8 of one)
BYTES_FRAME_BYTES = 16 << 20   # the bytes fallback's pages per frame: about this much (reused heap memory)
DRAIN_TIMEOUT_S = 30.0   # SIGTERM: how long requests in flight may take before they are cut
SOCKET_BUFFER_BYTES = 4 << 20
REPLY_TIMEOUT_S = 5.0   # how long a closing connection may take to accept its last reply


class SidecarServer:
    def __init__(self, config: Config, store: TieredStore, socket_path: Path):
        self.config, self.store, self.socket_path = config, store, socket_path
        self.spec: KVSpec = store.spec
        self.max_frame = config.sidecar.max_frame_bytes
        self.lease_s = config.sidecar.lease_s
        # pages per bytes frame: the fallback's frames stay under max_frame_bytes
        slack = min(FRAME_SLACK, self.max_frame // 8)
        self.frame_pages = min((self.max_frame - slack) // (self.spec.page_bytes + 128),
                               max(1, BYTES_FRAME_BYTES // self.spec.page_bytes))
        self.daemon = store.daemon
        self.sessions: set[Session] = set()
        self.handlers: set[asyncio.Task] = set()
        self.draining = False
        self.stopped = asyncio.Event()
        self.server: asyncio.AbstractServer | None = None
        self.admin_runner = None   # the REST admin API's aiohttp runner, once started
        self._socket_inode: int | None = None
        self._tasks: list[asyncio.Task] = []
        self._drain_task: asyncio.Task | None = None
        self._connections = 0
        # an op answers the fields of its reply, or the whole reply frame it encoded itself
        self.ops: dict[str, Callable[[Session, dict], Awaitable[dict | bytes]]] = {
            "hello": self.hello, "lookup": self.lookup, "alloc": self.alloc, "put": self.put, "get": self.get,
            "release": self.release, "clear": self.clear, "stats": self.stats, "ping": self.ping}

    # lifecycle
    async def start(self) -> None:
        old = os.umask(0o177)  # the socket file is born 0600
        try:
            self.server = await asyncio.start_unix_server(self._serve_client, path=str(self.socket_path),
                                                          limit=16 << 20)
        finally:
            os.umask(old)
        os.chmod(self.socket_path, 0o600)
        self._socket_inode = os.stat(self.socket_path).st_ino
        self._tasks.append(asyncio.create_task(self._expire_leases(), name="sidecar-leases"))

    def request_stop(self) -> None:
        """Start draining (from a signal handler); `stopped` is set when done."""
        if self._drain_task is None:
            self._drain_task = asyncio.create_task(self.drain(), name="sidecar-drain")

    async def drain(self) -> None:
        """Stop accepting, let requests in flight finish, close every connection."""
        if self.draining:
            return
        self.draining = True
        log.info("draining: %d clients connected", len(self.sessions))
        if self.admin_runner is not None:
            from kvstore.server.admin import set_draining
            set_draining(self.admin_runner.app)
        if self.server is not None:
            self.server.close()
        self._remove_socket()
        for s in list(self.sessions):
            if not s.busy:
                s.writer.close()  # an idle client's read ends; a busy one closes after its reply
        if self.handlers:
            _, late = await asyncio.wait(set(self.handlers), timeout=DRAIN_TIMEOUT_S)
            for t in late:
                t.cancel()
            if late:
                log.warning("drain: %d requests still running after %.0f s were cut", len(late), DRAIN_TIMEOUT_S)
                await asyncio.wait(late)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.admin_runner is not None:
            await self.admin_runner.cleanup()
        self.stopped.set()

    def _remove_socket(self) -> None:
        """Unlink the socket file, unless another sidecar has replaced it since."""
        with contextlib.suppress(OSError):
            if os.stat(self.socket_path).st_ino == self._socket_inode:
                os.unlink(self.socket_path)

    # connections
    async def _serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections += 1
        session = Session(f"#{self._connections}{_peer(writer)}", writer)
        sock = writer.get_extra_info("socket")
        with contextlib.suppress(AttributeError, OSError):   # fewer, larger copies for the bytes fallback
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        task = asyncio.current_task()
        self.sessions.add(session)
        self.handlers.add(task)
        try:
            await self._session_loop(session, reader)
        except (ConnectionError, OSError):
            pass  # the client went away; its leases end below
        except asyncio.CancelledError:
            log.warning("client %s: request cut short by shutdown", session.name)
        except Exception as exc:  # noqa: BLE001 - a bug must not kill the server or spill a traceback
            log.error("client %s: internal error: %s: %s", session.name, type(exc).__name__, exc)
        finally:
            self.sessions.discard(session)
            await self._end_leases(session, "disconnected")
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), REPLY_TIMEOUT_S)
            self.handlers.discard(task)

    async def _session_loop(self, s: Session, reader: asyncio.StreamReader) -> None:
        while not self.draining:
            try:
                body = await read_frame(reader, self.max_frame)
            except ProtocolError as exc:
                await self._refuse(s, None, exc)
                return
            if body is None:
                return
            s.busy, s.last_seen = True, time.monotonic()
            rid = None
            try:
                req = decode_request(body)
                del body
                rid = req.get("id")
                op = self.ops.get(req["op"])
                if op is None:
                    raise ProtocolError(f"unknown op {req['op'][:40]!r}; known: {', '.join(self.ops)}")
                if s.namespace is None and req["op"] != "hello":
                    raise KVStoreError(f"{req['op']}: say hello first (spec and namespace)")
                result = await op(s, req)
                frame = result if isinstance(result, bytes) else encode_frame({"id": rid, "ok": True, **result})
            except ProtocolError as exc:
                await self._refuse(s, rid, exc)
                return
            except KVStoreError as exc:
                frame = error_frame(rid, exc)
            except Exception as exc:  # noqa: BLE001 - a bug: answer, log one line, drop this client only
                log.error("client %s: internal error: %s: %s", s.name, type(exc).__name__, one_line(exc))
                await self._refuse(s, rid, KVStoreError(f"internal error in the sidecar: {type(exc).__name__}"),
                                   log_it=False)
                return
            finally:
                s.last_seen = time.monotonic()
            s.writer.write(frame)
            del frame
            await s.writer.drain()
            s.busy, s.last_seen = False, time.monotonic()

    async def _refuse(self, s: Session, rid: Any, exc: Exception, log_it: bool = True) -> None:
        """Answer a malformed frame with an error; the caller then closes the connection."""
        if log_it:
            log.warning("client %s: malformed frame, closing the connection: %s", s.name, one_line(exc))
        if s.writer.is_closing():
            return
        s.writer.write(error_frame(rid, exc))
        with contextlib.suppress(Exception):
            await asyncio.wait_for(s.writer.drain(), REPLY_TIMEOUT_S)

    async def _end_leases(self, s: Session, why: str) -> None:
        slots = s.take_all()
        if not slots:
            return
        try:
            await self.daemon.run(self.store.release_warm, slots)
            log.info("client %s %s: %d warm slots released", s.name, why, len(slots))
        except KVStoreError as exc:
            log.error("client %s %s: releasing its warm slots failed: %s", s.name, why, one_line(exc))

    async def _expire_leases(self) -> None:
        period = min(1.0, self.lease_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for s in list(self.sessions):
                if s.expired(now, self.lease_s):
                    await self._end_leases(s, f"sent nothing for {self.lease_s:g} s (sidecar.lease_s), leases expired")

    # ops
    async def hello(self, s: Session, req: dict) -> dict:
        theirs = get_field(req, "spec", dict, what="a map of " + ", ".join(SPEC_FIELDS))
        model = get_field(req, "model", str, what="a string")
        tenant = get_field(req, "tenant", str, "", "a string")
        salt = get_field(req, "salt", str, "", "a string")
        client = get_field(req, "client", str, "", "a string")
        layout = get_field(req, "layout", str, "", "a string")
        if len(layout) > 256:
            raise KVStoreError("hello: layout must be at most 256 characters")
        missing = [f for f in SPEC_FIELDS if f not in theirs]
        if missing:
            raise ProtocolError(f"hello: spec lacks {', '.join(missing)}")
        try:
            spec = KVSpec(**{f: theirs[f] for f in SPEC_FIELDS})
        except (ConfigError, TypeError) as exc:
            raise KVStoreError(f"hello: bad spec: {exc}") from None
        diffs = [f"{f} {getattr(spec, f)!r} (sidecar: {getattr(self.spec, f)!r})" for f in SPEC_FIELDS
                 if getattr(spec, f) != getattr(self.spec, f)]
        if diffs:
            raise KVStoreError(f"hello: spec differs from the sidecar's: {', '.join(diffs)}")
        if not model:
            raise KVStoreError("hello: model must name the model (a non-empty string)")
        s.namespace = Namespace.for_spec(model, self.spec, tenant, salt, layout)
        if client:
            s.name = f"{s.name} {client[:64]!r}"
        log.info("client %s: hello (model %r)", s.name, model[:128])
        warm = self.store.warm
        return {"shm": warm.shm_name, "page_bytes": self.spec.page_bytes, "slots": warm.num_slots,
                "lease_s": self.lease_s, "max_frame_bytes": self.max_frame, "frame_pages": self.frame_pages,
                "spec": spec_fields(self.spec)}

    async def lookup(self, s: Session, req: dict) -> dict:
        if "names" in req:
            names = get_names(req)
            if self.store.remote is not None:   # the named pages the remote tier holds, to warm
                await self.daemon.run(self.store.fetch_remote_named, names, s.namespace)
            return await self.daemon.run(self._lookup_named, s.namespace, names)
        tokens = get_tokens(req)
        if self.store.remote is not None:   # the pages beyond the cached prefix that the remote tier holds, to warm
            await self.daemon.run(self.store.fetch_remote, tokens, s.namespace)
        m = await self.daemon.run(self.store.match, tokens, s.namespace)
        return {"pages": m.num_pages, "tokens": m.num_tokens, "tiers": m.tiers, "counts": m.counts(),
                "keys": [k.hex() for k in m.keys]}

    def _lookup_named(self, namespace: Namespace, names: list[str]) -> dict:
        keys, tiers = [], []
        for key, where in self.store.residency([named_key(namespace, n) for n in names]).items():
            if where is None or where[1] != namespace.digest:
                break
            keys.append(key)
            tiers.append(where[0])
        counts = {t: tiers.count(t) for t in dict.fromkeys(tiers)}
        return {"pages": len(keys), "tokens": len(keys) * self.spec.page_size, "tiers": tiers, "counts": counts,
                "keys": [k.hex() for k in keys]}

    async def alloc(self, s: Session, req: dict) -> dict:
        n = get_count(req, "n", low=1)
        partial = get_field(req, "partial", bool, False, "true or false")
        wait_s = get_field(req, "wait_s", (int, float), None, "a number of seconds >= 0")
        if wait_s is not None and not 0 <= wait_s < float("inf"):
            raise ProtocolError("alloc: field \"wait_s\" must be a number of seconds >= 0")
        if n > self.store.warm.num_slots:
            raise KVStoreError(f"alloc: {n} pages asked, the warm tier has {self.store.warm.num_slots} slots")
        slots, short = await self.daemon.run(self._allocate, n, partial, wait_s)
        s.allocated.update(slots)
        return {"slots": slots, **({"short": short} if short else {})}

    def _allocate(self, n: int, partial: bool, wait_s: float | None = None) -> tuple[list[int], str]:
        """Up to n warm slots (all n unless `partial`) and, when fewer, why (a worker thread). It waits
        for write-behind at most daemon.backpressure_timeout_s, or the client's wait_s if shorter."""
        bound = self.config.daemon.backpressure_timeout_s
        slots = self.store.allocate_warm(n, min(bound, wait_s) if wait_s is not None else bound, partial)
        if len(slots) == n:
            return slots, ""
        return slots, self.store.warm_shortage(n)

    async def put(self, s: Session, req: dict) -> dict:
        names = get_names(req) if "names" in req else None
        tokens = get_tokens(req) if names is None else []
        start = get_count(req, "start_page", 0)
        if names is not None and start:
            raise ProtocolError("put: named pages take no \"start_page\"")
        inline = "pages" in req
        short = ""
        if inline:
            pages = get_field(req, "pages", list, what="a list of page bytes")
            if not all(isinstance(p, bytes) for p in pages):
                raise ProtocolError("put: field \"pages\" must be a list of bytes")
            if any(len(p) != self.spec.page_bytes for p in pages):
                raise KVStoreError(f"put: every page must be {self.spec.page_bytes} bytes ({self.spec.describe()})")
            if len(pages) > self.store.warm.num_slots:
                raise KVStoreError(f"put: {len(pages)} pages sent, the warm tier has {self.store.warm.num_slots} "
                                   "slots (send fewer a frame)")
            _check_names(names, len(pages))
            slots, short = await self.daemon.run(self._write_pages, pages)
            s.allocated.update(slots)  # until committed: freed with the session if the request is cut
        else:
            slots = get_ints(req, "slots", self.store.warm.num_slots, "warm slot numbers")
            _check_names(names, len(slots))
            s.check_allocated(slots)
        try:
            if not slots:
                keys = []
            elif names is not None:
                keys = await self.daemon.run(self.store.commit_warm_named, s.namespace, names[:len(slots)], slots)
            else:
                keys = await self.daemon.run(self.store.commit_warm, s.namespace, tokens, slots, start)
        except KVStoreError:
            if inline:  # the client never saw these slots
                s.allocated.difference_update(slots)
                await self.daemon.run(self.store.release_warm, slots)
            raise
        s.allocated.difference_update(slots)
        reply: dict = {"keys": [k.hex() for k in keys]}
        if inline and len(slots) < len(pages):
            reply["not_stored"] = {"start_page": start + len(slots), "pages": len(pages) - len(slots), "why": short}
        return reply

    def _write_pages(self, pages: list[bytes]) -> tuple[list[int], str]:
        slots, short = self._allocate(len(pages), partial=True)
        raw = self.store.warm.raw.numpy()  # [slots, page_bytes]; these slots are ours alone
        for slot, page in zip(slots, pages):
            raw[slot] = np.frombuffer(page, dtype=np.uint8)
        return slots, short

    async def get(self, s: Session, req: dict) -> dict | bytes:
        start = get_count(req, "start_page", 0)
        limit = get_count(req, "max_pages", None, low=1)
        inline = get_field(req, "bytes", bool, False, "true or false")
        keys = get_keys(req) if "keys" in req else None
        names = get_names(req) if keys is None and "names" in req else None
        if names is not None:
            keys = [named_key(s.namespace, n) for n in names]
        tokens = get_tokens(req) if keys is None else None
        if inline:
            if not self.frame_pages:
                raise KVStoreError(f"get: a page ({self.spec.page_bytes} bytes) does not fit in a frame "
                                   f"(sidecar.max_frame_bytes {self.max_frame})")
            limit = min(limit or self.frame_pages, self.frame_pages)

        def lease() -> tuple[list[bytes], list[int], int]:
            if keys is None and self.store.remote is not None:
                self.store.fetch_remote(tokens, s.namespace)   # what the remote tier holds beyond the cache
            elif names is not None and self.store.remote is not None:
                self.store.fetch_remote_named(names, s.namespace)
            chain = keys if keys is not None else self.store.match(tokens, s.namespace).keys
            want = chain[start:start + limit] if limit else chain[start:]
            slots = self.store.lease_warm(want, s.namespace)
            return want[:len(slots)], slots, len(chain)

        got, slots, cached = await self.daemon.run(lease)
        reply = {"keys": [k.hex() for k in got], "cached": cached}
        if not inline:
            s.leased.update(slots)
            return {**reply, "slots": slots}
        raw = self.store.warm.raw.numpy()  # leased: these slots hold their pages until released

        def encode() -> bytes:  # off the event loop: one copy of each page, into the frame
            return encode_frame({"id": req["id"], "ok": True, **reply, "pages": [memoryview(raw[i]) for i in slots]})

        try:
            return await self.daemon.run(encode)
        finally:
            await self.daemon.run(self.store.release_warm, slots)

    async def release(self, s: Session, req: dict) -> dict:
        slots = get_ints(req, "slots", self.store.warm.num_slots, "warm slot numbers")
        wanted = s.check_held(slots)
        await self.daemon.run(self.store.release_warm, slots)
        s.forget(wanted)
        return {}

    async def clear(self, s: Session, req: dict) -> dict:
        pages, kept = await self.daemon.run(self.store.clear_namespace, s.namespace.digest)
        log.info("client %s: clear: %d pages of its namespace removed, %d in use kept", s.name, pages, kept)
        return {"pages": pages, "kept": kept}

    async def stats(self, s: Session, req: dict) -> dict:
        out = await self.daemon.run(self.store.stats)
        out["sidecar"] = {"clients": len(self.sessions), "lease_s": self.lease_s,
                          "allocated_slots": sum(len(x.allocated) for x in self.sessions),
                          "leased_slots": sum(sum(x.leased.values()) for x in self.sessions),
                          "this_client": {"allocated_slots": len(s.allocated), "leased_slots": sum(s.leased.values())}}
        return out

    async def ping(self, s: Session, req: dict) -> dict:
        return {}


def _check_names(names: list[str] | None, pages: int) -> None:
    if names is not None and len(names) != pages:
        raise KVStoreError(f"put: {len(names)} names for {pages} pages")


def _peer(writer: asyncio.StreamWriter) -> str:
    """' (pid N)' of the client process, where the OS tells it."""
    sock = writer.get_extra_info("socket")
    try:
        pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        return f" (pid {pid})"
    except (AttributeError, OSError):
        return ""
