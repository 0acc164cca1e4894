"""The sidecar data plane (`kvstore sidecar`): the store alone, next to an inference engine in
another process, which uses it through kvstore.client.SidecarClient.

Page bytes do not cross the socket: the warm tier lives in a POSIX shared-memory segment that
the client maps too ([slots, page_bytes], page-first pages), and requests carry slot numbers.

Frames: a 4-byte big-endian length, then a msgpack map {"op": ..., "id": ..., ...}. Every
request gets one reply, {"id", "ok": true, ...} or {"id", "ok": false, "error": "one line"}.
Keys travel as hex strings.

    hello    {spec, model, tenant, salt, client}  -> {shm, page_bytes, slots, lease_s, max_frame_bytes, frame_pages}
             checks the geometry and fixes the connection's namespace; every other op needs it first
    lookup   {tokens}                             -> {pages, tokens, tiers, counts, keys}   no side effects
    alloc    {n}                                  -> {slots}   warm slots for this client to fill
    put      {tokens, slots, start_page}          -> {keys}    the filled slots become cached pages
    put      {tokens, pages: [bytes], start_page} -> {keys}    fallback: the bytes come in the frame
    get      {tokens | keys, max_pages, start_page}  -> {keys, slots, cached}   leased warm slots of pages
             start_page.. of the cached prefix (cached: its length in pages; with keys, len(keys))
    get      {..., bytes: true}                   -> {keys, pages, cached}   fallback: bytes, no lease
    release  {slots}                              -> {}        ends leases (or frees unused alloc'd slots)
    stats                                         -> store.stats() and {"sidecar": ...}
    ping                                          -> {}

Leases: slots from alloc and get belong to their connection until put or release. They end
when the connection closes (the client died) or when it sends nothing for sidecar.lease_s (it
hangs; any request renews the lease). Committed pages stay in the store either way.

Errors: a request the store refuses (wrong spec, ops before hello, unknown slots, no room) gets
an error reply and the connection goes on. A malformed frame (bad length, over
sidecar.max_frame_bytes, not msgpack, not a map, unknown op, wrong field types) gets an error
reply, then that connection is closed; the others are served on.

Lifecycle: the REST admin API (kvstore.server.admin) listens on admin.port next to the socket.
Ready (`kvstore sidecar: ready on SOCKET` on stdout) once the cold tier is indexed and both listen.
SIGTERM or SIGINT drains: stop accepting, finish the requests in flight, write hot and warm
pages to cold (store.close(persist=True)), remove the socket file, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import logging
import os
import signal
import socket
import stat
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import msgpack
import numpy as np

from kvstore.config import Config, format_size
from kvstore.daemon import Daemon
from kvstore.errors import ConfigError, KVStoreError
from kvstore.keys import KEY_BYTES, Namespace
from kvstore.spec import KVSpec
from kvstore.store import TieredStore
from kvstore.tiers.buffers import keep_write_buffers

log = logging.getLogger("kvstore.sidecar")

HEADER = struct.Struct(">I")
SPEC_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "dtype", "page_size")
MAX_TOKEN = 2**31   # token ids are stored as int32
FRAME_SLACK = 64 * 1024   # room for everything but the pages in a bytes frame (at most 1/8 of one)
BYTES_FRAME_BYTES = 16 << 20   # the bytes fallback's pages per frame: about this much (reused heap memory)
DRAIN_TIMEOUT_S = 30.0   # SIGTERM: how long requests in flight may take before they are cut
SOCKET_BUFFER_BYTES = 4 << 20
REPLY_TIMEOUT_S = 5.0   # how long a closing connection may take to accept its last reply


class ProtocolError(KVStoreError):
    """A malformed frame: answered, then the connection is closed."""


# frames
async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> bytes | None:
    """The next frame's body; None at a clean end of stream. Raises ProtocolError."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ProtocolError("truncated frame header") from None
    (length,) = HEADER.unpack(header)
    if length == 0:
        raise ProtocolError("empty frame (length 0)")
    if length > max_bytes:
        raise ProtocolError(f"frame of {length} bytes is over sidecar.max_frame_bytes ({max_bytes})")
    try:
        return await reader.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError(f"truncated frame: {len(exc.partial)} of {length} bytes") from None


def encode_frame(message: dict) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def decode_request(body: bytes) -> dict:
    try:
        req = msgpack.unpackb(body, raw=False)
    except Exception:  # noqa: BLE001 - msgpack raises several types for bad input
        raise ProtocolError("frame is not valid msgpack") from None
    if not isinstance(req, dict):
        raise ProtocolError(f"frame is a msgpack {type(req).__name__}, not a map")
    if not isinstance(req.get("op"), str):
        raise ProtocolError("frame has no \"op\" string")
    if not isinstance(req.get("id"), (int, str, type(None))) or isinstance(req.get("id"), bool):
        raise ProtocolError("\"id\" must be an integer, a string or nil")
    return req


# fields: a wrong type is a malformed frame
def _get(req: dict, name: str, kind: type | tuple, default: Any = ..., what: str = "") -> Any:
    if name not in req:
        if default is ...:
            raise ProtocolError(f"{req['op']}: field \"{name}\" is missing")
        return default
    value = req[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ProtocolError(f"{req['op']}: field \"{name}\" must be {what or kind.__name__}")
    return value


def _count(req: dict, name: str, default: Any = ..., low: int = 0) -> Any:
    value = _get(req, name, (int, type(None)) if default is None else int, default, f"an integer >= {low}")
    if value is not None and value < low:
        raise ProtocolError(f"{req['op']}: field \"{name}\" must be an integer >= {low}")
    return value


def _ints(req: dict, name: str, below: int, what: str) -> list[int]:
    values = _get(req, name, list, what=f"a list of {what}")
    if not all(type(v) is int and 0 <= v < below for v in values):
        raise ProtocolError(f"{req['op']}: field \"{name}\" must be a list of {what}")
    return values


def _tokens(req: dict) -> list[int]:
    return _ints(req, "tokens", MAX_TOKEN, "token ids (integers in 0..2^31-1)")


def _keys(req: dict) -> list[bytes]:
    values = _get(req, "keys", list, what="a list of hex page keys")
    try:
        keys = [bytes.fromhex(v) for v in values]
    except (TypeError, ValueError):
        keys = []
    if len(keys) != len(values) or any(len(k) != KEY_BYTES for k in keys):
        raise ProtocolError(f"{req['op']}: field \"keys\" must be a list of {2 * KEY_BYTES}-digit hex page keys")
    return keys


@dataclass(eq=False)
class Session:
    """One client connection: its namespace and the warm slots it holds."""

    name: str
    writer: asyncio.StreamWriter
    namespace: Namespace | None = None
    allocated: set = field(default_factory=set)    # warm slots from alloc, not yet put
    leased: collections.Counter = field(default_factory=collections.Counter)   # warm slot -> leases
    last_seen: float = field(default_factory=time.monotonic)
    busy: bool = False

    @property
    def holds(self) -> int:
        return len(self.allocated) + sum(self.leased.values())

    def take_all(self) -> list[int]:
        """Forget every slot this session holds and return them (to release in the store)."""
        slots = list(self.allocated) + list(self.leased.elements())
        self.allocated.clear()
        self.leased.clear()
        return slots


class Sidecar:
    def __init__(self, config: Config, store: TieredStore, socket_path: Path, workers: int = 4):
        self.config, self.store, self.socket_path = config, store, socket_path
        self.spec: KVSpec = store.spec
        self.max_frame = config.sidecar.max_frame_bytes
        self.lease_s = config.sidecar.lease_s
        # pages per bytes frame: the fallback's frames stay under max_frame_bytes
        slack = min(FRAME_SLACK, self.max_frame // 8)
        self.frame_pages = min((self.max_frame - slack) // (self.spec.page_bytes + 128),
                               max(1, BYTES_FRAME_BYTES // self.spec.page_bytes))
        self.daemon = Daemon(store, workers=workers)
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
            "release": self.release, "stats": self.stats, "ping": self.ping}

    # lifecycle
    async def start(self) -> None:
        await self.daemon.start()
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
        """Stop accepting, let requests in flight finish, close every connection, stop the daemon."""
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
        await self.daemon.stop()
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
                frame = encode_frame({"id": rid, "ok": False, "error": _one_line(exc)})
            except Exception as exc:  # noqa: BLE001 - a bug: answer, log one line, drop this client only
                log.error("client %s: internal error: %s: %s", s.name, type(exc).__name__, _one_line(exc))
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
            log.warning("client %s: malformed frame, closing the connection: %s", s.name, _one_line(exc))
        if s.writer.is_closing():
            return
        s.writer.write(encode_frame({"id": rid, "ok": False, "error": _one_line(exc)}))
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
            log.error("client %s %s: releasing its warm slots failed: %s", s.name, why, _one_line(exc))

    async def _expire_leases(self) -> None:
        period = min(1.0, self.lease_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for s in list(self.sessions):
                if not s.busy and s.holds and now - s.last_seen > self.lease_s:
                    await self._end_leases(s, f"sent nothing for {self.lease_s:g} s (sidecar.lease_s), leases expired")

    # ops
    async def hello(self, s: Session, req: dict) -> dict:
        theirs = _get(req, "spec", dict, what="a map of " + ", ".join(SPEC_FIELDS))
        model = _get(req, "model", str, what="a string")
        tenant = _get(req, "tenant", str, "", "a string")
        salt = _get(req, "salt", str, "", "a string")
        client = _get(req, "client", str, "", "a string")
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
        s.namespace = Namespace.for_spec(model, self.spec, tenant, salt)
        if client:
            s.name = f"{s.name} {client[:64]!r}"
        log.info("client %s: hello (model %r)", s.name, model[:128])
        warm = self.store.warm
        return {"shm": warm.shm_name, "page_bytes": self.spec.page_bytes, "slots": warm.num_slots,
                "lease_s": self.lease_s, "max_frame_bytes": self.max_frame, "frame_pages": self.frame_pages,
                "spec": {f: getattr(self.spec, f) for f in SPEC_FIELDS}}

    async def lookup(self, s: Session, req: dict) -> dict:
        m = await self.daemon.run(self.store.match, _tokens(req), s.namespace)
        return {"pages": m.num_pages, "tokens": m.num_tokens, "tiers": m.tiers, "counts": m.counts(),
                "keys": [k.hex() for k in m.keys]}

    async def alloc(self, s: Session, req: dict) -> dict:
        n = _count(req, "n", low=1)
        if n > self.store.warm.num_slots:
            raise KVStoreError(f"alloc: {n} pages asked, the warm tier has {self.store.warm.num_slots} slots")
        slots = await self.daemon.run(self.store.allocate_warm, n)
        s.allocated.update(slots)
        return {"slots": slots}

    async def put(self, s: Session, req: dict) -> dict:
        tokens = _tokens(req)
        start = _count(req, "start_page", 0)
        inline = "pages" in req
        if inline:
            pages = _get(req, "pages", list, what="a list of page bytes")
            if not all(isinstance(p, bytes) for p in pages):
                raise ProtocolError("put: field \"pages\" must be a list of bytes")
            if any(len(p) != self.spec.page_bytes for p in pages):
                raise KVStoreError(f"put: every page must be {self.spec.page_bytes} bytes ({self.spec.describe()})")
            slots = await self.daemon.run(self._write_pages, pages)
            s.allocated.update(slots)  # until committed: freed with the session if the request is cut
        else:
            slots = _ints(req, "slots", self.store.warm.num_slots, "warm slot numbers")
            stray = sorted(set(slots) - s.allocated)
            if stray or len(set(slots)) < len(slots):
                raise KVStoreError(f"put: warm slots {stray or slots} are not this client's (alloc them first; "
                                   "they are taken back after sidecar.lease_s without a request)")
        try:
            keys = await self.daemon.run(self.store.commit_warm, s.namespace, tokens, slots, start)
        except KVStoreError:
            if inline:  # the client never saw these slots
                s.allocated.difference_update(slots)
                await self.daemon.run(self.store.release_warm, slots)
            raise
        s.allocated.difference_update(slots)
        return {"keys": [k.hex() for k in keys]}

    def _write_pages(self, pages: list[bytes]) -> list[int]:
        slots = self.store.allocate_warm(len(pages))
        raw = self.store.warm.raw.numpy()  # [slots, page_bytes]; these slots are ours alone
        for slot, page in zip(slots, pages):
            raw[slot] = np.frombuffer(page, dtype=np.uint8)
        return slots

    async def get(self, s: Session, req: dict) -> dict | bytes:
        start = _count(req, "start_page", 0)
        limit = _count(req, "max_pages", None, low=1)
        inline = _get(req, "bytes", bool, False, "true or false")
        keys = _keys(req) if "keys" in req else None
        tokens = _tokens(req) if keys is None else None
        if inline:
            if not self.frame_pages:
                raise KVStoreError(f"get: a page ({self.spec.page_bytes} bytes) does not fit in a frame "
                                   f"(sidecar.max_frame_bytes {self.max_frame})")
            limit = min(limit or self.frame_pages, self.frame_pages)

        def lease() -> tuple[list[bytes], list[int], int]:
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
        slots = _ints(req, "slots", self.store.warm.num_slots, "warm slot numbers")
        wanted = collections.Counter(slots)
        stray = sorted(slot for slot, n in wanted.items() if n > s.leased[slot] + (slot in s.allocated))
        if stray:
            raise KVStoreError(f"release: warm slots {stray} are not held by this client "
                               "(leases end after sidecar.lease_s without a request)")
        await self.daemon.run(self.store.release_warm, slots)
        for slot, n in wanted.items():
            lease_n = min(n, s.leased[slot])
            s.leased[slot] -= lease_n
            if s.leased[slot] <= 0:
                del s.leased[slot]
            if n > lease_n:
                s.allocated.discard(slot)
        return {}

    async def stats(self, s: Session, req: dict) -> dict:
        out = await self.daemon.run(self.store.stats)
        out["sidecar"] = {"clients": len(self.sessions), "lease_s": self.lease_s,
                          "allocated_slots": sum(len(x.allocated) for x in self.sessions),
                          "leased_slots": sum(sum(x.leased.values()) for x in self.sessions),
                          "this_client": {"allocated_slots": len(s.allocated), "leased_slots": sum(s.leased.values())}}
        return out

    async def ping(self, s: Session, req: dict) -> dict:
        return {}


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _peer(writer: asyncio.StreamWriter) -> str:
    """' (pid N)' of the client process, where the OS tells it."""
    sock = writer.get_extra_info("socket")
    try:
        pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        return f" (pid {pid})"
    except (AttributeError, OSError):
        return ""


# the command
DESCRIPTION = """\
Run the tiered store alone, next to an inference engine in another process: a Unix socket
(msgpack frames) for control, page bytes through the warm tier in shared memory, which the
client (kvstore.client.SidecarClient) maps. The REST admin API listens on admin.port.

One line is printed when the sidecar is ready (after the cold tier is indexed):
  kvstore sidecar: ready on SOCKET
SIGTERM or SIGINT drains: finish the requests in flight, write hot and warm pages to cold,
remove the socket file, exit 0.
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("sidecar", help="run the store alone next to an external inference engine "
                                              "(Unix socket + shared memory)",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_options(p)
    p.set_defaults(func=run)
    return p


def _add_options(p: argparse.ArgumentParser) -> None:
    from kvstore.cli import add_config_options

    p.add_argument("--socket", metavar="PATH",
                   help="the Unix socket to serve (config key sidecar.socket; a relative path is under data_dir)")
    p.add_argument("--admin-port", metavar="N", help="the REST admin API's port, 0 for any free one "
                                                     "(config key admin.port, default 8081)")
    add_config_options(p)


def sidecar_config(args: argparse.Namespace) -> Config:
    """The config of `kvstore sidecar`: the flags, and the warm tier always in shared memory."""
    from kvstore.cli import config_from_args

    for key, value in (("sidecar.socket", args.socket), ("admin.port", args.admin_port)):
        if value is not None:
            args.set = [*args.set, f"{key}={value}"]
    args.set = [*args.set, "warm.shared_memory=true"]
    return config_from_args(args)


def claim_socket(path: Path) -> None:
    """Make `path` free to bind: refuse a live socket or another file there; remove a stale socket."""
    if len(os.fsencode(path)) > 107:
        raise ConfigError("sidecar.socket", str(path), "must be a path under 108 bytes (a Unix socket's limit)")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise KVStoreError(f"sidecar.socket: {path} exists and is not a socket; remove it or choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(str(path))
    except OSError:
        os.unlink(path)
        log.info("removed a stale socket file %s", path)
        return
    finally:
        probe.close()
    raise KVStoreError(f"another process is serving {path} (a kvstore sidecar already running?)")


def prefault_warm(store: TieredStore) -> None:
    """Touch all of the shared warm tier now: its memory is committed at start (a full /dev/shm is
    an error here, not a SIGBUS mid-request) and no put pays first-touch page faults later."""
    need = store.warm.capacity_bytes
    with contextlib.suppress(OSError):
        st = os.statvfs("/dev/shm")
        if need > st.f_bavail * st.f_frsize:
            raise KVStoreError(f"warm.bytes = {need}: the shared-memory filesystem /dev/shm has only "
                               f"{format_size(st.f_bavail * st.f_frsize)} free")
    store.warm.raw.zero_()


async def start_admin_api(sidecar: Sidecar) -> str:
    """The REST admin API (kvstore.server.admin) on admin.host:admin.port; returns its URL."""
    from kvstore.server.admin import admin_url, create_admin_app, start_admin

    app = create_admin_app(sidecar.store, sidecar.daemon, sidecar.config)
    sidecar.admin_runner = await start_admin(app, sidecar.config)
    return admin_url(sidecar.admin_runner)


async def serve(config: Config, store: TieredStore, path: Path) -> int:
    """Serve until SIGTERM or SIGINT, then drain. The caller closes the store."""
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(_log_loop_error)
    sidecar = Sidecar(config, store, path)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, sidecar.request_stop)
    try:
        await sidecar.start()
        url = await start_admin_api(sidecar)
    except BaseException:
        await sidecar.drain()
        raise
    log.info("warm tier: %d slots of %d bytes in shared memory %s; lease %g s",
             store.warm.num_slots, store.spec.page_bytes, store.warm.shm_name, config.sidecar.lease_s)
    print(f"kvstore sidecar: admin API on {url}", flush=True)
    print(f"kvstore sidecar: ready on {path}", flush=True)
    await sidecar.stopped.wait()
    return 0


def run(args: argparse.Namespace) -> int:
    config = sidecar_config(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    path = config.sidecar_socket.absolute()
    claim_socket(path)
    store = TieredStore(config)   # indexes the cold tier
    code = 1
    try:
        if store.warm.num_slots < 1:
            raise ConfigError("warm.bytes", config.warm.bytes, f"must hold at least one page "
                                                               f"({store.spec.page_bytes} bytes) for the sidecar")
        prefault_warm(store)
        # the bytes fallback allocates and frees a frame or two per request: keep them on the heap
        keep_write_buffers(BYTES_FRAME_BYTES, 16 * BYTES_FRAME_BYTES)
        code = asyncio.run(serve(config, store, path))
    finally:
        started = time.monotonic()
        try:
            store.close(persist=True)   # hot and warm pages to cold
        except KVStoreError as exc:
            log.error("closing the store failed: %s", _one_line(exc))
            code = 1
        else:
            if code == 0:
                log.info("stopped: pages written to cold in %.2f s", time.monotonic() - started)
    return code


def _log_loop_error(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    exc = context.get("exception")
    log.error("%s%s", context.get("message", "event loop error"), f": {type(exc).__name__}: {exc}" if exc else "")


def main(argv: list[str] | None = None) -> int:
    """`python -m kvstore.server.sidecar` is `kvstore sidecar`."""
    parser = argparse.ArgumentParser(prog="kvstore sidecar", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_options(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except KVStoreError as exc:
        print(f"kvstore: error: {_one_line(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
