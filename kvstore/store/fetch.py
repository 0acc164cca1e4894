"""RemoteFetch: pages the remote tier holds beyond the cached prefix, brought into warm; a part of
TieredStore (given the core and the daemon).

The remote tier (kvstore.remote) receives its pages straight into warm slots lent to it
(kvstore.remote.landing.WarmLanding, which verifies and caches them); the pages written to cold
go on to it from PageIO. Every fetch blocks for the network: for worker threads; failures are
misses. Without a remote tier a fetch brings nothing.
"""

from __future__ import annotations

from typing import Sequence

from kvstore.movement.daemon import Daemon
from kvstore.pages.keys import Namespace, name_tokens, named_key, page_keys, page_tokens
from kvstore.remote.landing import WarmLanding
from kvstore.store.core import StoreCore


class RemoteFetch:
    def __init__(self, core: StoreCore, daemon: Daemon):
        self.core, self.remote = core, core.remote
        self.landing: WarmLanding | None = None
        if self.remote is not None:
            self.landing = WarmLanding(core.lock, core.mover, daemon, core.warm,
                                       core.config.daemon.backpressure_timeout_s)
            self.remote.lend(*self.landing.area)
            if core.cold is not None:
                self.remote.start(core.cold.records)

    def fetch_remote(self, tokens: Sequence[int], namespace: Namespace, known: int | None = None) -> tuple[int, int]:
        """Bring the pages of `tokens` that the remote tier holds beyond the cached prefix into warm.
        `known`: how many of the chain's pages the prefix index says the remote holds (None: ask it).
        Returns (pages cached before, pages added)."""
        ps = self.core.spec.page_size
        cached = self.core.match(tokens, namespace).keys
        local = len(cached)
        if self.remote is None or (known is not None and known <= local) or len(tokens) // ps <= local:
            return local, 0
        parent = cached[-1] if local else namespace.digest
        keys = page_keys(namespace, tokens, ps, start=local, parent=parent)
        added = self.remote.fetch(namespace.digest, keys, page_tokens(tokens, ps, local), parent, self.landing,
                                  None if known is None else known - local)
        return local, added

    def fetch_remote_named(self, names: Sequence[str], namespace: Namespace) -> int:
        """fetch_remote for named pages (kvstore.pages.keys): the leading pages of `names` not cached here that
        the remote tier holds, into warm. Returns the pages added."""
        keys = [named_key(namespace, n) for n in names]
        with self.core.lock:
            local = next((i for i, k in enumerate(keys) if k not in self.core.index), len(keys))
        if self.remote is None or local == len(keys):
            return 0
        return self.remote.fetch(namespace.digest, keys[local:], [name_tokens(n) for n in names[local:]],
                                 namespace.digest, self.landing, roots=True)
