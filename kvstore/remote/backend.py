"""RemoteBackend: one distributed key-value store the remote tier keeps page records in.

A backend moves opaque values (page records in kvstore.pages.record's format) under string keys; it
knows nothing of pages, chains or checksums (the remote tier verifies every value it reads).
Backends are registered by URL scheme in REMOTE_BACKENDS (entry point group `kvstore.remote`)
and built as `factory(url, timeout_s, password)` (password: from the environment variable
remote.password_env names, for a URL that has none; empty when unset); built in: `redis`, `rediss` (one Redis or Valkey),
`redis+cluster` (Redis Cluster or a Valkey cluster), `mooncake` (Mooncake Store).

Rules every backend keeps:
- Calls block (the remote tier calls them on its own threads, never on an event loop or the
  engine thread) and are bounded: no call waits much longer than `timeout_s` for a server.
- `get_many` answers a value (bytes or a buffer the caller may read until its next call on this
  backend) or None for every key, in order: None is a key the store does not hold (never
  written, evicted by the server, deleted). A server that cannot be reached or answers too late
  raises RemoteDown, naming what failed in one line (never a secret of the URL); a backend
  whose key space is split over several servers may instead answer None for the keys of the
  one that failed, and raise only when it cannot answer any key.
- `put_many` stores every value or raises RemoteDown (a value may then be stored or not);
  `delete_many` forgets keys (missing ones are fine); `exists_many` says which keys are held.
- `get_into` lands each value in the caller's memory instead, in two parts (its first bytes into
  a head, the rest into a target: a page record's header, and its page in a warm slot), and says
  per key LANDED, MISSING (None above), WRONG_SIZE (a value that is not head + target bytes:
  not landed, a foreign or damaged value) or FAILED_CHECK (landed, and the caller's check(i),
  called as soon as value i has landed, while its bytes are still in cache, said no). A get_into
  that gives up on a read still running raises StillLanding: its targets are not the caller's
  to reuse until the read ends. The default
  reads get_many and copies; a backend that can receive into the caller's memory overrides it.
  `lend(area, room)` announces the memory targets will lie in (Mooncake registers it with its
  transfer engine) and, with room, that each target has that many bytes before it in area which
  are its own: a value whose head fits lands there whole, in one piece, its head then copied out.
  A factory with `lands_records = True` asks for that room (kvstore.remote.head_room).
- `reads_in_flight`: how many get_into calls the remote tier has in flight for one fetch, on as
  many threads (at most its IN_FLIGHT, 2): one for a backend whose reads all go to one
  single-threaded server, where a second connection only makes the server interleave them.
- `describe()` is the URL without its password, for logs and stats.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Sequence

import numpy as np

from kvstore.config import redact_secret
from kvstore.errors import KVStoreError
from kvstore.placement.registry import Registry


LANDED, MISSING, WRONG_SIZE, FAILED_CHECK = 1, 0, -1, -2   # get_into's answers per key


Check = Callable[[int], bool]   # get_into's check(i): whether value i, landed, is what the caller expects


class RemoteDown(KVStoreError):
    """The remote store cannot be reached or did not answer in time (one line, no secrets)."""


class StillLanding(RemoteDown):
    """get_into gave up waiting for a read that may still write into its targets: they must stay
    the read's until `when_done(fn)` calls fn (at once if it has ended; maybe never)."""

    def __init__(self, message: str, when_done: Callable[[Callable[[], None]], None]):
        super().__init__(message)
        self.when_done = when_done


class RemoteBackend(ABC):
    scheme: str = ""
    reads_in_flight = 2

    def __init__(self, url: str, timeout_s: float):
        self.url, self.timeout_s = url, timeout_s

    @abstractmethod
    def get_many(self, keys: Sequence[str]) -> list:
        """A value (bytes-like) or None per key, in order; RemoteDown when the store cannot answer."""

    @abstractmethod
    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Store every (key, value); RemoteDown when the store cannot take them."""

    @abstractmethod
    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether the store holds each key."""

    @abstractmethod
    def delete_many(self, keys: Sequence[str]) -> None:
        """Forget these keys (missing ones are ignored)."""

    def get_into(self, keys: Sequence[str], heads: Sequence[np.ndarray], targets: Sequence[np.ndarray],
                 check: Check | None = None) -> list[int]:
        """Land each key's value in heads[i] and then targets[i] (flat uint8 arrays), checked by
        check(i) once landed: LANDED, MISSING, WRONG_SIZE or FAILED_CHECK per key, in order;
        RemoteDown as get_many."""
        return land_values(self.get_many(keys), heads, targets, check)

    def lend(self, area: np.ndarray, room: int = 0) -> None:
        """Targets of get_into will lie in `area` (flat uint8, for as long as the backend lives), each
        with `room` bytes of its own before it."""

    def ping(self) -> None:
        """Raise RemoteDown unless the store answers now."""
        self.exists_many(["kvstore:ping"])

    def close(self) -> None:
        """Release connections; the backend is not used afterwards."""

    def describe(self) -> str:
        return redact_secret(self.url)


def land_values(values: Sequence, heads: Sequence[np.ndarray], targets: Sequence[np.ndarray],
                check: Check | None = None) -> list[int]:
    """get_into's answers for values already read (None: missing): each one of the right size is
    copied into its head and target, then checked."""
    codes = []
    for i, (value, head, target) in enumerate(zip(values, heads, targets)):
        if value is None:
            codes.append(MISSING)
            continue
        src = np.frombuffer(value, np.uint8)
        if len(src) != len(head) + len(target):
            codes.append(WRONG_SIZE)
            continue
        head[:] = src[:len(head)]
        target[:] = src[len(head):]
        codes.append(checked(check, i))
    return codes


def checked(check: Check | None, i: int) -> int:
    """LANDED, or FAILED_CHECK when check(i) says no."""
    return LANDED if check is None or check(i) else FAILED_CHECK


REMOTE_BACKENDS: Registry[Callable[[str, float, str], RemoteBackend]] = Registry("remote backend", "kvstore.remote")

