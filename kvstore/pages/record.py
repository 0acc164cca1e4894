"""The cold page record: what one LMDB value holds.

    magic "KVP1" | checksum (16 bytes, xxh3-128 of everything after it) | header length (u32 LE)
    | header (msgpack map) | page bytes (page-first layout)

Header: key, parent key, namespace digest, token ids (int32 LE bytes), spec fingerprint,
page byte count, and zero bytes of padding ("z") that put the page bytes 48 bytes past a
64-byte boundary of the record: LMDB stores a large value 16 bytes into its first page, so
in the cold tier's map the page starts on a cache line and its copy out reads aligned lines
(a page copied from 52 bytes past a line took 30% longer). A record without the padding
(written before it) reads the same: the page is the last `page byte count` bytes. A record
whose magic, checksum, key derivation or geometry does not hold is damaged: it is a miss,
never served.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import msgpack
import numpy as np
import xxhash

from kvstore.pages import native_copy
from kvstore.pages.keys import KEY_BYTES, chain_key_of_bytes

MAGIC = b"KVP1"
_PREFIX = struct.Struct("<4s16sI")  # magic, checksum, header length
PREFIX_BYTES = _PREFIX.size
_COPY_CHUNK = 256 * 1024   # copies hash what they copied in chunks that stay in L2 cache
_KEY_MISMATCH = "key is not the chain hash of its namespace, parent and tokens"
_CHECKSUM_MISMATCH = "checksum mismatch"
_PAGE_ALIGN, _PAGE_PHASE = 64, 48   # where the page starts in a record: 48 bytes past a cache line


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
        """The header as stored: a msgpack map, padded ("z") so that the page after it starts
        _PAGE_PHASE bytes past an _PAGE_ALIGN boundary of the record (the module's docstring)."""
        fields = {"k": self.key, "p": self.parent, "n": self.namespace, "t": self.tokens,
                  "s": self.spec, "b": self.nbytes}
        bare = len(msgpack.packb(fields)) + 4   # + the pad's key and bin8 prefix (2 bytes each)
        fields["z"] = bytes((_PAGE_PHASE - PREFIX_BYTES - bare) % _PAGE_ALIGN)
        return msgpack.packb(fields)

    @classmethod
    def unpack(cls, data) -> "RecordHeader":
        try:
            m = msgpack.unpackb(data)
            return cls(m["k"], m["p"], m["n"], m["t"], m["s"], int(m["b"]))
        except Exception as exc:  # any decoding failure means a damaged header
            raise RecordError(f"header does not decode ({type(exc).__name__})") from None

    def key_matches(self) -> bool:
        """The key must be the chain hash of (namespace, parent, tokens)."""
        return len(self.tokens) % 4 == 0 and chain_key_of_bytes(self.namespace, self.parent, self.tokens) == self.key


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


def _copy_checked(record, header: RecordHeader, out: np.ndarray) -> bool:
    """The page of a record whose header `read_header` parsed, copied into `out` (a flat uint8 array of
    header.nbytes) in Python: one pass over memory, each chunk hashed right after it is copied,
    while it is still in cache, so the checksum covers exactly the bytes delivered. False (out
    zeroed: no byte of a damaged record is left in it) when the checksum does not hold."""
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
        return False
    return True


class PayloadCopies:
    """The pages of records copied out, each one's key derivation and the checksum of the bytes copied
    verified, added by one thread while others copy those added before (LmdbReader.read_many).

    `add` each record (its header parsed by read_header) with its target (a flat uint8 array or a
    contiguous CPU tensor of `nbytes`); `publish` hands those added so far to the threads copying in
    `drain`; `close` once no more will come, then `drain` on the adding thread too; `finish` once
    every drain has returned. Where native_copy has a copy, the pages are copied natively
    (NativeCopy.batch: the GIL released from a thread's first page to its last), each record in one
    pass where it can be (NativeCopy.copy_hash; not with `one_pass` False). Any other page: with
    `lmdb_file` (fd, page size: the records are values in an LMDB map of that file), read from the
    file; a page whose checksum fails from the file is copied again from the map before it is
    refused. Without a native copy, `add` copies the page in Python there and then; the same bytes
    are checked either way. The records must stay valid (an LMDB read transaction open) until
    `finish` returns."""

    def __init__(self, capacity: int, nbytes: int, lmdb_file: tuple[int, int] | None = None,
                 one_pass: bool = True):
        self.nbytes = nbytes
        self.native = native_copy.copier()
        self.batch = None if self.native is None else self.native.batch(capacity, nbytes, _COPY_CHUNK, lmdb_file,
                                                                        None if one_pass else 0)
        self.errors: list[str | None] = []   # why each page added was refused (None: copied)
        self.copying: list[tuple[int, object, object]] = []   # (index, record, out) of each page in the batch

    @property
    def parallel(self) -> bool:
        """Whether other threads can help: the pages are copied in `drain`."""
        return self.batch is not None

    def add(self, record, header: RecordHeader, out) -> None:
        """The page of `record` queued for `out` (copied now, without a native copy); finish() lists
        the pages in the order they were added."""
        if header.nbytes != self.nbytes:
            raise ValueError("PayloadCopies takes pages of one size")
        if not header.key_matches():
            self.errors.append(_KEY_MISMATCH)
        elif self.batch is None:
            self.errors.append(None if _copy_checked(record, header, _byte_array(out)) else _CHECKSUM_MISMATCH)
        else:
            value = np.frombuffer(record, np.uint8).ctypes.data
            self.batch.add(value, value + PREFIX_BYTES - 4, value + len(record) - self.nbytes, _address(out))
            self.copying.append((len(self.errors), record, out))
            self.errors.append(None)

    def publish(self) -> None:
        if self.batch is not None:
            self.batch.publish()

    def close(self) -> None:
        if self.batch is not None:
            self.batch.close()

    def drain(self) -> None:
        if self.batch is not None:
            self.batch.drain()

    def finish(self) -> tuple[list[str | None], int]:
        """(for each page added: None where it was copied, else why it was refused, its out zeroed when
        the checksum failed, untouched when the key derivation did; how many pages the file gave
        wrong and the map right)."""
        if self.batch is None:
            return self.errors, 0
        digests, how = self.batch.results()
        disagreed = 0
        for j, (k, record, out) in enumerate(self.copying):
            checksum = bytes(memoryview(record)[4:20])
            if digests[16 * j:16 * j + 16] == checksum:
                continue
            if how[j] == native_copy.READ_FILE:   # once more from the map: a page the file gives wrong is not yet damaged
                at = self.batch.addresses[:, j:j + 1]
                if self.native.copy_hash(at[0], at[1], at[3], at[4], self.nbytes, _COPY_CHUNK,
                                         one_pass=0)[0] == checksum:
                    disagreed += 1
                    continue
            _byte_array(out).fill(0)
            self.errors[k] = _CHECKSUM_MISMATCH
        return self.errors, disagreed


def _address(out) -> int:
    return out.data_ptr() if hasattr(out, "data_ptr") else out.ctypes.data   # a tensor, or a numpy array


def _byte_array(out) -> np.ndarray:
    return (out.numpy() if hasattr(out, "numpy") else out).reshape(-1).view(np.uint8)


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
        raise RecordError(_CHECKSUM_MISMATCH)
    if not header.key_matches():
        raise RecordError(_KEY_MISMATCH)
    return header, mv[PREFIX_BYTES + hlen:]
