"""The sidecar's wire protocol, shared by the server (kvstore.sidecar.command) and its clients
(kvstore.sidecar.client). Here, not under kvstore.server: a client must not import the admin server.

Frames: a 4-byte big-endian length, then a msgpack map {"op": ..., "id": ..., ...}. Every
request gets one reply, {"id", "ok": true, ...} or {"id", "ok": false, "error": "one line"}.
Keys travel as hex strings.

    hello    {spec, model, tenant, salt, client, layout}  -> {shm, page_bytes, slots, lease_s, max_frame_bytes, frame_pages}
             checks the geometry and fixes the connection's namespace; every other op needs it first;
             layout (optional) names the client's own byte layout of a page, part of the namespace
    lookup   {tokens}                             -> {pages, tokens, tiers, counts, keys}   no side effects
             but one: pages the remote tier holds beyond the cached prefix are brought into warm first
             (so does a get by tokens)
    lookup   {names}                              -> the same for named pages: how many leading names are cached
             (here too, and in a get by names, the remote tier's pages come to warm first)
    alloc    {n, partial, wait_s}                 -> {slots, short}   warm slots for this client to fill;
             waits (daemon.backpressure_timeout_s, or wait_s if shorter) while write-behind is
             behind; then with partial the slots that fit (maybe fewer, `short` says why),
             without it an error
    put      {tokens, slots, start_page}          -> {keys}    the filled slots become cached pages
    put      {tokens, pages: [bytes], start_page} -> {keys, not_stored}   fallback: the bytes come in
             the frame; the pages that fit are stored, not_stored {start_page, pages, why} names the rest
    put      {names, slots | pages}               -> the same for named pages (start_page 0): slot i
             holds the page the engine calls names[i] (kvstore.pages.keys: a name stands for its whole prefix)
    get      {tokens | keys | names, max_pages, start_page}  -> {keys, slots, cached}   leased warm slots of
             pages start_page.. of the cached prefix (cached: its length in pages; with keys or names, their number)
    get      {..., bytes: true}                   -> {keys, pages, cached}   fallback: bytes, no lease
    release  {slots}                              -> {}        ends leases (or frees unused alloc'd slots)
    clear                                         -> {pages, kept}   every page of this connection's namespace
             leaves the store (hot, warm and cold; pages leased or pinned now are kept, and counted)
    stats                                         -> store.stats() and {"sidecar": ...}
    ping                                          -> {}

Errors: ProtocolError is a malformed frame (the server answers it, then closes the connection);
a client sees SidecarError for a refused request and SidecarUnavailable for a lost connection.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgpack

from kvstore.errors import KVStoreError
from kvstore.pages.keys import KEY_BYTES, NAME_MAX
from kvstore.pages.spec import KVSpec

HEADER = struct.Struct(">I")
SPEC_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "dtype", "page_size")
MAX_TOKEN = 2**31   # token ids are stored as int32


class ProtocolError(KVStoreError):
    """A malformed frame: answered, then the connection is closed."""


class SidecarError(KVStoreError):
    """The sidecar refused a request; the message is its reason."""


class SidecarUnavailable(SidecarError):
    """The sidecar cannot be reached, or the connection to it was lost."""


class NotStored(SidecarError):
    """A put stored only its first pages: the sidecar had no room for the rest within its bound
    (write-behind behind the puts). `keys` are those stored, `start_page` and `pages` the rest."""

    def __init__(self, keys: list[bytes], start_page: int, pages: int, why: str):
        self.keys, self.start_page, self.pages = keys, start_page, pages
        last = start_page + pages - 1
        super().__init__(f"put: pages {start_page}..{last} not stored ({len(keys)} stored before them): {why}")


def spec_fields(spec: KVSpec) -> dict:
    """The geometry a hello carries, both ways."""
    return {f: getattr(spec, f) for f in SPEC_FIELDS}


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


# frames
def frame_parts(message: dict) -> tuple[bytes, bytes]:
    """(header, body) of a frame: a large body is sent without joining the two."""
    body = msgpack.packb(message, use_bin_type=True)
    return HEADER.pack(len(body)), body


def encode_frame(message: dict) -> bytes:
    header, body = frame_parts(message)
    return header + body


def error_frame(rid: Any, exc: BaseException) -> bytes:
    return encode_frame({"id": rid, "ok": False, "error": one_line(exc)})


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


def decode_reply(rid: int, body: bytes) -> dict:
    """The reply to request `rid`. Raises SidecarError (refused) or SidecarUnavailable (out of step)."""
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


# fields of a request: a wrong type is a malformed frame
def get_field(req: dict, name: str, kind: type | tuple, default: Any = ..., what: str = "") -> Any:
    if name not in req:
        if default is ...:
            raise ProtocolError(f"{req['op']}: field \"{name}\" is missing")
        return default
    value = req[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ProtocolError(f"{req['op']}: field \"{name}\" must be {what or kind.__name__}")
    return value


def get_count(req: dict, name: str, default: Any = ..., low: int = 0) -> Any:
    value = get_field(req, name, (int, type(None)) if default is None else int, default, f"an integer >= {low}")
    if value is not None and value < low:
        raise ProtocolError(f"{req['op']}: field \"{name}\" must be an integer >= {low}")
    return value


def get_ints(req: dict, name: str, below: int, what: str) -> list[int]:
    values = get_field(req, name, list, what=f"a list of {what}")
    if not all(type(v) is int and 0 <= v < below for v in values):
        raise ProtocolError(f"{req['op']}: field \"{name}\" must be a list of {what}")
    return values


def get_tokens(req: dict) -> list[int]:
    return get_ints(req, "tokens", MAX_TOKEN, "token ids (integers in 0..2^31-1)")


def get_names(req: dict) -> list[str]:
    values = get_field(req, "names", list, what="a list of page names")
    if not all(isinstance(v, str) and 0 < len(v) <= NAME_MAX for v in values):
        raise ProtocolError(f"{req['op']}: field \"names\" must be a list of strings of 1..{NAME_MAX} characters")
    return values


def get_keys(req: dict) -> list[bytes]:
    values = get_field(req, "keys", list, what="a list of hex page keys")
    try:
        keys = [bytes.fromhex(v) for v in values]
    except (TypeError, ValueError):
        keys = []
    if len(keys) != len(values) or any(len(k) != KEY_BYTES for k in keys):
        raise ProtocolError(f"{req['op']}: field \"keys\" must be a list of {2 * KEY_BYTES}-digit hex page keys")
    return keys
