"""Pipelined GETs whose values land in the caller's memory: just enough RESP over one plain TCP
socket to one Redis node (the remote tier's read path; every other command goes through redis-py).

redis-py hands a value over as bytes, copied out of its parser's buffer; here each reply is
received straight into its destination (a record's head into a small buffer, its page into a
warm slot), so the bytes are copied once, by the kernel, and can be checked while in cache. A reply that is not a value of exactly
the expected size is read past (WRONG_SIZE); a missing key is MISSING; an error reply (MOVED,
ASK, OOM, ...) is ERROR, with its first line kept for the caller. Every socket operation waits at
most timeout_s; a failure closes the connection (its state is unknown) and raises OSError.
"""

from __future__ import annotations

import socket
from typing import Sequence

import numpy as np

from kvstore.remote.backend import LANDED, MISSING, WRONG_SIZE, Check, checked

ERROR = -3                 # an error reply (the message is in `errors`)
_BUFFER = 64 * 1024        # reply lines and small values are read through this buffer


class HandshakeRefused(OSError):
    """AUTH or SELECT was refused (the message is the server's)."""


def _command(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


class LandingConnection:
    def __init__(self, host: str, port: int, timeout_s: float, username: str | None = None,
                 password: str | None = None, db: int = 0):
        self.address = (host, port)
        self.sock = socket.create_connection(self.address, timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray(_BUFFER)
        self.view = memoryview(self.buf)
        self.start = self.end = 0
        self.errors: list[str] = []
        try:
            if password:
                self._handshake(_command(b"AUTH", *([username.encode()] if username else []), password.encode()))
            if db:
                self._handshake(_command(b"SELECT", str(db).encode()))
        except BaseException:
            self.close()
            raise

    def _handshake(self, command: bytes) -> None:
        self.sock.sendall(command)
        line = self._line()
        if not line.startswith(b"+"):
            raise HandshakeRefused(line.decode(errors="replace")[:200])

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    # receiving
    def _fill(self) -> None:
        """More bytes into the buffer (what is unread moves to its start first)."""
        if self.start:
            self.buf[:self.end - self.start] = self.buf[self.start:self.end]
            self.end -= self.start
            self.start = 0
        if self.end == len(self.buf):
            raise ConnectionError("a reply line longer than the buffer")
        n = self.sock.recv_into(self.view[self.end:])
        if n == 0:
            raise ConnectionError("the server closed the connection")
        self.end += n

    def _line(self) -> bytes:
        while (i := self.buf.find(b"\r\n", self.start, self.end)) < 0:
            self._fill()
        line = bytes(self.buf[self.start:i])
        self.start = i + 2
        return line

    def _into(self, dst: memoryview | None, n: int) -> None:
        """The next n bytes of the stream into dst (discarded when dst is None)."""
        take = min(n, self.end - self.start)
        if dst is not None and take:
            dst[:take] = self.view[self.start:self.start + take]
        self.start += take
        done = take
        while done < n:
            if dst is None:
                self.start = self.end = 0
                got = self.sock.recv_into(self.view, min(len(self.buf), n - done))
            else:
                got = self.sock.recv_into(dst[done:], n - done)
            if got == 0:
                raise ConnectionError("the server closed the connection")
            done += got

    def _reply_into(self, head: memoryview, target: memoryview, check: Check | None, i: int) -> int:
        line = self._line()
        kind = line[:1]
        if kind == b"-":
            self.errors.append(line[1:].decode(errors="replace"))
            return ERROR
        if kind == b"_" or line == b"$-1":
            return MISSING
        if kind != b"$":
            raise ConnectionError(f"unexpected reply {line[:40]!r}")
        n = int(line[1:])
        if n != len(head) + len(target):
            self._into(None, n + 2)
            return WRONG_SIZE
        self._into(head, len(head))
        self._into(target, len(target))
        if self._line():
            raise ConnectionError("a value did not end where its length said")
        return checked(check, i)

    # the pipeline
    def send_gets(self, keys: Sequence[str]) -> None:
        self.sock.sendall(b"".join(_command(b"GET", k.encode()) for k in keys))

    def read_into(self, heads: Sequence[np.ndarray], targets: Sequence[np.ndarray],
                  check: Check | None = None) -> list[int]:
        """The replies to the GETs sent, landed in heads[i] and targets[i] and checked (check(i)) as
        each arrives: a code per reply."""
        self.errors = []
        return [self._reply_into(memoryview(h), memoryview(t), check, i) for i, (h, t) in enumerate(zip(heads, targets))]
