"""SidecarLink: the connector's connections to a kvstore sidecar, one per namespace, that
survive the sidecar going away.

A vLLM process must keep serving when the sidecar is down: every call here returns None (or
raises SidecarUnavailable to the caller's own handler) instead of failing the engine, the
outage is logged once, and a reconnect is tried again after `retry_s` seconds, so hits resume
on their own when the sidecar comes back (with a new shared-memory segment: a new hello maps it).
Not thread-safe: each thread that talks to the sidecar owns its own link.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from kvstore.pages.spec import KVSpec
from kvstore.sidecar.client import SidecarClient, SidecarError, SidecarUnavailable

T = TypeVar("T")
log = logging.getLogger("vllm.kvstore_vllm")   # under vLLM's logger: its handlers and level


@dataclass(frozen=True)
class Scope:
    """What a page's bytes depend on beyond its tokens, and who may see it (vLLM's cache_salt, LoRA)."""

    model: str
    salt: str = ""


class SidecarLink:
    def __init__(self, socket_path: str, spec: KVSpec, layout: str, tenant: str = "", retry_s: float = 2.0,
                 name: str = "vllm"):
        self.socket_path, self.spec, self.layout, self.tenant = socket_path, spec, layout, tenant
        self.retry_s = retry_s
        self.name = name
        self._clients: dict[Scope, SidecarClient] = {}
        self._down_until = 0.0
        self._down_logged = False
        self.refused: str | None = None   # the sidecar refused our hello (a configuration error)

    def client(self, scope: Scope) -> SidecarClient | None:
        """The connection for `scope`, connecting when needed; None while the sidecar is unreachable."""
        c = self._clients.get(scope)
        if c is not None:
            return c
        if time.monotonic() < self._down_until:
            return None
        try:
            c = SidecarClient(self.socket_path, self.spec, scope.model, tenant=self.tenant, salt=scope.salt,
                              client=self.name, layout=self.layout, timeout=30.0)
        except SidecarUnavailable as exc:
            self.lost(exc)
            return None
        except SidecarError as exc:   # refused: the geometry or the namespace is wrong; retrying is pointless soon
            if self.refused != str(exc):
                log.error("kvstore sidecar refused the connector: %s; serving without it", exc)
            self.refused = str(exc)
            self._down_until = time.monotonic() + max(self.retry_s, 30.0)
            return None
        if self._down_logged or self.refused:
            log.warning("kvstore sidecar at %s is reachable again", self.socket_path)
        self._down_logged, self.refused = False, None
        self._clients[scope] = c
        return c

    def run(self, scope: Scope, what: str, fn: Callable[[SidecarClient], T]) -> T | None:
        """fn(client) for `scope`; None when the sidecar is unreachable or refuses (logged). A connection
        that broke since its last use (the sidecar restarted) is replaced once, at once."""
        for attempt in (0, 1):
            fresh = scope not in self._clients
            client = self.client(scope)
            if client is None:
                return None
            try:
                return fn(client)
            except SidecarUnavailable as exc:
                self._clients.pop(scope, None)
                client.close()
                if fresh or attempt:
                    self.lost(exc)
                    return None
            except SidecarError as exc:
                log.info("kvstore %s refused: %s", what, exc)
                return None
        return None

    def lost(self, exc: BaseException) -> None:
        """The sidecar went away (or never answered): drop every connection, retry after retry_s."""
        if not self._down_logged:
            log.warning("kvstore sidecar unavailable (%s); serving without it, retrying every %gs", exc, self.retry_s)
            self._down_logged = True
        self.close()
        self._down_until = time.monotonic() + self.retry_s

    def close(self) -> None:
        for c in self._clients.values():
            try:
                c.close()
            except Exception:  # noqa: BLE001 - closing a dead connection must not fail the caller
                pass
        self._clients.clear()
