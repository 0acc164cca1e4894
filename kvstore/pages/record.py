"""The cold page record: what one LMDB value holds.

    magic "KVP1" | checksum (16 bytes, xxh3-128 of everything after it) | header length (u32 LE)
    | header (msgpack map) | page bytes (page-first layout)

Header: key, parent key, namespace digest, token ids (int32 LE bytes), spec fingerprint,
page byte count. A record whose magic, checksum, key derivation or geometry does not hold
is damaged: it is a miss, never served.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import msgpack
import numpy as np
import xxhash

from kvstore.pages.keys import KEY_BYTES, chain_key

MAGIC = b"KVP1"
_PREFIX = struct.Struct("<4s16sI")  # magic, checksum, header length
PREFIX_BYTES = _PREFIX.size
_COPY_CHUNK = 256 * 1024   # copy_payload hashes what it copied in chunks that stay in L2 cache


class RecordError(ValueError):
    """A record that cannot be trusted; the message says which check failed."""


class RecordHeader(NamedTuple):
    """What a record says about its page. A named tuple: immutable, and cheap to build
    (a scan of the store builds one for every record)."""

    key: bytes
    parent: bytes
    namespace: bytes
    tokens: bytes          # int32 little-endian token ids of this page
    spec: bytes            # KVSpec.fingerprint
    nbytes: int            # page payload length

    def pack(self) -> bytes:
        return msgpack.packb({"k": self.key, "p": self.parent, "n": self.namespace, "t": self.tokens,
                              "s": self.spec, "b": self.nbytes})

    @classmethod
    def unpack(cls, data) -> "RecordHeader":
        try:
            m = msgpack.unpackb(data)
            return cls(m["k"], m["p"], m["n"], m["t"], m["s"], int(m["b"]))
        except Exception as exc:  # any decoding failure means a damaged header
            raise RecordError(f"header does not decode ({type(exc).__name__})") from None

    def key_matches(self) -> bool:
        """The key must be the chain hash of (namespace, parent, tokens)."""
        return chain_key(self.namespace, self.parent, np.frombuffer(self.tokens, dtype="<i4")) == self.key


def encode(header: RecordHeader, payload) -> list:
    """The record as a list of buffers (avoids one copy of the payload); join for LMDB."""
    head = header.pack()
    body_len = struct.pack("<I", len(head))
    h = xxhash.xxh3_128()
    h.update(body_len)
    h.update(head)
    h.update(payload)
    return [_PREFIX.pack(MAGIC, h.digest(), len(head)), head, payload]


def encode_bytes(header: RecordHeader, payload) -> bytes:
    return b"".join(encode(header, payload))


def read_header(record) -> RecordHeader:
    """Parse the header only (no checksum): cheap, for scanning a store at open."""
    mv = memoryview(record)
    if len(mv) < PREFIX_BYTES:
        raise RecordError("record shorter than its prefix")
    magic, _, hlen = _PREFIX.unpack_from(mv)
    if magic != MAGIC:
        raise RecordError("bad magic")
    if PREFIX_BYTES + hlen > len(mv):
        raise RecordError("header length past the end")
    header = RecordHeader.unpack(mv[PREFIX_BYTES:PREFIX_BYTES + hlen])
    if PREFIX_BYTES + hlen + header.nbytes != len(mv):
        raise RecordError("payload length does not match the header")
    return header


def copy_payload(record, header: RecordHeader, out: np.ndarray) -> None:
    """Copy the payload of a record whose header `read_header` parsed into `out` (a flat
    uint8 array of header.nbytes), verifying key derivation and checksum on the way.

    One pass over memory: each chunk is hashed right after it is copied, while it is still
    in cache, so the checksum covers exactly the bytes delivered. On a mismatch `out` is
    zeroed before RecordError is raised: no byte of a damaged record is left in it.
    """
    if not header.key_matches():
        raise RecordError("key is not the chain hash of its namespace, parent and tokens")
    mv = memoryview(record)
    _, checksum, _ = _PREFIX.unpack_from(mv)
    start = len(mv) - header.nbytes
    h = xxhash.xxh3_128(mv[PREFIX_BYTES - 4:start])
    src = np.frombuffer(mv, dtype=np.uint8)[start:]
    for a in range(0, header.nbytes, _COPY_CHUNK):
        chunk = out[a:a + _COPY_CHUNK]
        np.copyto(chunk, src[a:a + _COPY_CHUNK])
        h.update(chunk)
    if h.digest() != checksum:
        out.fill(0)
        raise RecordError("checksum mismatch")


def head_size(header: RecordHeader) -> int:
    """How many bytes of its record come before the page: the prefix and the packed header."""
    return PREFIX_BYTES + len(header.pack())


def head_bound(spec) -> int:
    """The most bytes a record of this KVSpec has before its page: a chain page's head (its tokens
    are 4 bytes each) or a named page's (a KEY_BYTES digest), whichever is longer."""
    key = bytes(KEY_BYTES)
    return head_size(RecordHeader(key, key, key, bytes(max(4 * spec.page_size, KEY_BYTES)), spec.fingerprint,
                                  spec.page_bytes))


def check_landed(head, header: RecordHeader, payload) -> bool:
    """Whether a record read in two parts, its first head_size(header) bytes into `head` and its page
    into `payload`, is exactly the record of `header` (the one the reader expects: its key, parent,
    namespace, tokens and geometry) and its checksum holds. The page is hashed where it landed."""
    mv = memoryview(head).cast("B")
    magic, checksum, hlen = _PREFIX.unpack_from(mv)
    packed = header.pack()
    if magic != MAGIC or hlen != len(packed) or mv[PREFIX_BYTES:] != packed or len(mv) != PREFIX_BYTES + hlen:
        return False
    h = xxhash.xxh3_128(mv[PREFIX_BYTES - 4:])
    h.update(payload)
    return h.digest() == checksum


def decode(record) -> tuple[RecordHeader, memoryview]:
    """Verify magic, checksum and key derivation; return the header and a view of the payload."""
    mv = memoryview(record)
    header = read_header(mv)
    _, checksum, hlen = _PREFIX.unpack_from(mv)
    if xxhash.xxh3_128(mv[PREFIX_BYTES - 4:]).digest() != checksum:
        raise RecordError("checksum mismatch")
    if not header.key_matches():
        raise RecordError("key is not the chain hash of its namespace, parent and tokens")
    return header, mv[PREFIX_BYTES + hlen:]
