"""ClusterNode: this instance's part in the cluster: its Redis index entry, fetching prefixes
from peers, and the admin routes that go with them (/v1/peers, /v1/peer/pages, the peers of
/v1/lookup). Without cluster.redis_url the routes answer that the cluster is disabled.
"""

from __future__ import annotations

import logging
from typing import Sequence

from aiohttp import web

from kvstore.cluster.peer import NO_TOKEN, PeerFetcher, serve_pages
from kvstore.cluster.redis_index import REMOTE, RedisIndex
from kvstore.config import Config
from kvstore.pages.keys import Namespace, page_keys

log = logging.getLogger("kvstore.cluster")
CLUSTER: web.AppKey = web.AppKey("kvstore.cluster", object)


class ClusterNode:
    def __init__(self, config: Config, store, url: str,
                 prefill_tokens_per_s=lambda: 2000.0):
        self.config, self.store = config, store
        cfg = config.cluster
        self.index = RedisIndex(cfg, cfg.advertise_url or url, store.residency, self._snapshot)
        self.fetcher = PeerFetcher(store, self.index, cfg.token, cfg.fetch_policy, prefill_tokens_per_s)

    def _snapshot(self):
        return [(k, tier, ns) for k, (tier, ns) in self.store.residency().items()]

    async def start(self) -> None:
        if not self.config.cluster.token:
            log.warning("%s (POST /v1/peer/pages answers 403); set the same cluster.token on every instance",
                        NO_TOKEN)
        self.store.add_listener(self.index.on_residency)
        if self.store.remote is not None:
            self.store.remote.add_listener(self.index.on_remote)
        await self.index.start()

    async def stop(self) -> None:
        await self.fetcher.close()
        await self.index.stop()

    async def prefetch(self, tokens: Sequence[int], ns: Namespace) -> tuple[int, int]:
        return await self.fetcher.prefetch(tokens, ns)

    async def lookup_peers(self, tokens: Sequence[int], ns: Namespace) -> list[dict]:
        keys = page_keys(ns, tokens, self.store.spec.page_size)
        return [{"instance": p["instance"], "tokens": p["pages"] * self.store.spec.page_size, "tier": p["tier"]}
                for p in await self.index.lookup(ns.digest, keys) if p["instance"] != REMOTE]

    async def remote_pages(self, tokens: Sequence[int], ns: Namespace) -> int | None:
        """How many of the chain's leading pages the index says the remote tier holds (None: it says nothing)."""
        keys = page_keys(ns, tokens, self.store.spec.page_size)
        found = [p["pages"] for p in await self.index.lookup(ns.digest, keys) if p["instance"] == REMOTE]
        return found[0] if found else None

    def stats(self) -> dict:
        return {**self.index.stats(), "fetch": self.fetcher.stats()}


def make_prefetch(store, node: ClusterNode | None):
    """The engine's prefetch hook (AsyncLLM's `prefetch`): the pages of a prompt beyond its cached
    prefix from the remote tier, then from a peer (node). None when there is neither."""
    if store.remote is None and node is None:
        return None

    async def prefetch(tokens: Sequence[int], ns: Namespace) -> tuple[int, dict[str, int]]:
        head, fetched, local = tokens[:len(tokens) - 1], {}, None   # the last token is always computed
        if store.remote is not None:
            known = await node.remote_pages(head, ns) if node is not None else None
            local, fetched["remote"] = await store.daemon.run(store.fetch_remote, head, ns, known)
        if node is not None:
            before, fetched["peer"] = await node.prefetch(tokens, ns)
            local = before if local is None else local
        return local, fetched
    return prefetch


def peer_status(node: ClusterNode | None) -> dict:
    """Whether peers can fetch pages from this instance and it from them, and if not, why (/readyz)."""
    if node is None:
        return {"serving": False, "fetching": False, "reason": "no cluster: cluster.redis_url is not set"}
    if not node.config.cluster.token:
        return {"serving": False, "fetching": False, "reason": NO_TOKEN}
    if node.config.cluster.fetch_policy == "never":
        return {"serving": True, "fetching": False, "reason": "cluster.fetch_policy is never"}
    return {"serving": True, "fetching": True, "reason": None}


def add_cluster_routes(app: web.Application, store) -> None:
    """/v1/peers, /v1/peers/forget and /v1/peer/pages; app[CLUSTER] is the ClusterNode, if any.
    The admin app validates their inputs against its OpenAPI document (kvstore/server/validate.py),
    but for /v1/peer/pages, which authenticates the peer first and checks its own body."""

    async def peers(request: web.Request) -> web.Response:
        node = request.app.get(CLUSTER)
        if node is None:
            return web.json_response({"state": "disabled", "instance": None, "peers": []})
        live = await node.index.live() if node.index.state == "connected" else {}
        return web.json_response({"state": node.index.state, "instance": node.index.id,
                                  "peers": [{"instance": i, "url": v["url"], "expires": v["expires"]}
                                            for i, v in sorted(live.items())]})

    async def forget(request: web.Request) -> web.Response:
        node = request.app.get(CLUSTER)
        if node is None or node.index.state != "connected":
            return web.json_response({"error": "the cluster index is not connected"}, status=409)
        instance = (await request.json())["instance"]   # the admin app validated it (ForgetRequest)
        return web.json_response({"instance": instance, "removed": await node.index.forget(instance)})

    async def pages(request: web.Request) -> web.StreamResponse:
        node = request.app.get(CLUSTER)
        return await serve_pages(request, store, node.config.cluster.token if node else "")

    app.router.add_get("/v1/peers", peers)
    app.router.add_post("/v1/peers/forget", forget)
    app.router.add_post("/v1/peer/pages", pages)
