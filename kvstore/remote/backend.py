"""RemoteBackend: one distributed key-value store the remote tier keeps page records in.

A backend moves opaque values (page records in kvstore.record's format) under string keys; it
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
- `describe()` is the URL without its password, for logs and stats.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Sequence

from kvstore.config import redact_secret
from kvstore.errors import KVStoreError
from kvstore.registry import Registry


class RemoteDown(KVStoreError):
    """The remote store cannot be reached or did not answer in time (one line, no secrets)."""


class RemoteBackend(ABC):
    scheme: str = ""

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

    def ping(self) -> None:
        """Raise RemoteDown unless the store answers now."""
        self.exists_many(["kvstore:ping"])

    def close(self) -> None:
        """Release connections; the backend is not used afterwards."""

    def describe(self) -> str:
        return redact_secret(self.url)


REMOTE_BACKENDS: Registry[Callable[[str, float, str], RemoteBackend]] = Registry("remote backend", "kvstore.remote")

