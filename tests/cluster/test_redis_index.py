"""RedisIndex against real redis-server processes: publishing, lookups, liveness, outages,
tenants, passwords, TLS and Redis Cluster."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from kvstore.cluster.redis_index import REMOTE, RedisIndex
from kvstore.config import ClusterConfig
from kvstore.errors import KVStoreError
from kvstore.pages.keys import Namespace, page_keys
from redisutil import RedisServer, make_cluster

NS_A = Namespace("m", "float32", tenant="a")
NS_B = Namespace("m", "float32", tenant="b")
TOKENS = list(range(16 * 6))


class Residency:
    """What one instance holds: key -> (tier, namespace digest)."""

    def __init__(self):
        self.pages: dict[bytes, tuple[str, bytes]] = {}
        self.index: RedisIndex | None = None

    def put(self, ns, tokens, tier):
        for k in page_keys(ns, tokens, 16):
            self.pages[k] = (tier, ns.digest)
            if self.index:
                self.index.on_residency("add", k, tier)

    def drop(self, keys):
        for k in keys:
            self.pages.pop(k, None)
            if self.index:
                self.index.on_residency("remove", k, "cold")

    def resolve(self, keys):
        return {k: self.pages.get(k) for k in keys}

    def snapshot(self):
        return [(k, t, ns) for k, (t, ns) in self.pages.items()]


def cfg(url, **kw):
    base = dict(redis_url=url, heartbeat_s=0.2, ttl_s=0.8, flush_interval_s=0.02, key_prefix="t:")
    base.update(kw)
    return ClusterConfig(**base)


async def make_index(c, name, residency=None):
    res = residency or Residency()
    idx = RedisIndex(dataclasses.replace(c, instance_id=name), f"http://{name}", res.resolve, res.snapshot)
    res.index = idx
    await idx.start()
    return idx, res


async def wait_for(pred, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if await pred():
            return True
        await asyncio.sleep(0.05)
    return False


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis")
    yield server
    server.stop()


async def test_publish_and_lookup_longest_prefix_per_instance(redis_server):
    c = cfg(redis_server.url)
    a, ra = await make_index(c, "A")
    b, rb = await make_index(c, "B")
    try:
        ra.put(NS_A, TOKENS[:16 * 4], "warm")
        rb.put(NS_A, TOKENS[:16 * 2], "hot")
        keys = page_keys(NS_A, TOKENS, 16)
        assert await wait_for(lambda: _pages(b, keys, "A", 4))
        found = await b.lookup(NS_A.digest, keys)
        assert [(r["instance"], r["pages"], r["tier"]) for r in found] == [("A", 4, "warm")]
        mine = await b.lookup(NS_A.digest, keys, include_self=True)
        assert {r["instance"]: r["pages"] for r in mine} == {"A": 4, "B": 2}
        ra.drop(keys[2:4])
        assert await wait_for(lambda: _pages(b, keys, "A", 2))
    finally:
        await a.stop()
        await b.stop()


async def _pages(idx, keys, inst, n):
    found = {r["instance"]: r["pages"] for r in await idx.lookup(NS_A.digest, keys)}
    return found.get(inst, 0) == n


async def test_other_tenant_finds_nothing(redis_server):
    c = cfg(redis_server.url)
    a, ra = await make_index(c, "A")
    b, _ = await make_index(c, "B")
    try:
        ra.put(NS_A, TOKENS, "hot")
        keys_a = page_keys(NS_A, TOKENS, 16)
        assert await wait_for(lambda: _pages(b, keys_a, "A", 6))
        assert await b.lookup(NS_B.digest, page_keys(NS_B, TOKENS, 16)) == []
        assert await b.lookup(NS_B.digest, keys_a) == []   # right keys, wrong namespace
    finally:
        await a.stop()
        await b.stop()


async def test_dead_instance_disappears_within_ttl_and_is_collected(redis_server):
    c = cfg(redis_server.url)
    a, ra = await make_index(c, "A")
    b, _ = await make_index(c, "B")
    keys = page_keys(NS_A, TOKENS, 16)
    try:
        ra.put(NS_A, TOKENS, "cold")
        assert await wait_for(lambda: _pages(b, keys, "A", 6))
        await a.stop(deregister=False)      # as if killed: no goodbye
        t0 = asyncio.get_running_loop().time()
        assert await wait_for(lambda: _none(b, keys), timeout=c.ttl_s + 1)
        assert asyncio.get_running_loop().time() - t0 <= c.ttl_s + 0.5
        assert await wait_for(lambda: _collected(b, "A"), timeout=3 * c.ttl_s + 2)
    finally:
        await b.stop()


async def _none(idx, keys):
    return await idx.lookup(NS_A.digest, keys) == []


async def _collected(idx, inst):
    return not await idx.redis.exists(idx.pages_key(inst)) and not await idx.redis.hexists(idx.live_key, inst)


async def test_outage_is_local_only_and_recovery_resyncs(redis_server):
    c = cfg(redis_server.url)
    a, ra = await make_index(c, "A")
    b, _ = await make_index(c, "B")
    keys = page_keys(NS_A, TOKENS, 16)
    try:
        ra.put(NS_A, TOKENS, "warm")
        assert await wait_for(lambda: _pages(b, keys, "A", 6))
        redis_server.stop()
        assert await b.lookup(NS_A.digest, keys) == []      # no exception: local-only
        assert await wait_for(_state(a, "disconnected"))
        ra.put(NS_A, TOKENS[:16], "hot")                     # changes while Redis is away
        redis_server.start()                                 # empty: it kept nothing
        assert await wait_for(lambda: _pages(b, keys, "A", 6), timeout=15)
        assert a.state == b.state == "connected"
    finally:
        await a.stop()
        await b.stop()


def _state(idx, state):
    async def check():
        return idx.state == state
    return check


async def test_unreachable_redis_at_start_is_local_only_not_fatal(tmp_path):
    from redisutil import free_port
    idx, _ = await make_index(cfg(f"redis://127.0.0.1:{free_port()}/0"), "A")
    try:
        assert idx.state == "disconnected"
        assert await idx.lookup(NS_A.digest, page_keys(NS_A, TOKENS, 16)) == []
    finally:
        await idx.stop()


async def test_password_required(tmp_path):
    server = RedisServer(tmp_path / "pw", password="s3cret")
    try:
        idx, res = await make_index(cfg(server.url), "A")
        res.put(NS_A, TOKENS, "hot")
        await idx.stop(deregister=False)
        with pytest.raises(KVStoreError, match="requires a password"):
            await make_index(cfg(f"redis://127.0.0.1:{server.port}/0"), "B")
        with pytest.raises(KVStoreError, match="wrong user or password"):
            await make_index(cfg(f"redis://:nope@127.0.0.1:{server.port}/0"), "C")
    finally:
        server.stop()


async def test_tls_required(tmp_path):
    server = RedisServer(tmp_path / "tls", tls=True)
    try:
        idx, res = await make_index(cfg(server.url), "A")
        assert idx.state == "connected"
        await idx.stop()
        with pytest.raises(KVStoreError, match="rediss://"):
            await make_index(cfg(f"redis://127.0.0.1:{server.port}/0"), "B")
        with pytest.raises(KVStoreError, match="not trusted"):
            await make_index(cfg(f"rediss://127.0.0.1:{server.port}/0"), "C")
    finally:
        server.stop()


async def test_redis_cluster(tmp_path):
    servers = make_cluster(tmp_path / "cluster")
    try:
        c = cfg(f"redis://127.0.0.1:{servers[0].port}/0", redis_mode="cluster")
        a, ra = await make_index(c, "A")
        b, _ = await make_index(c, "B")
        ra.put(NS_A, TOKENS, "warm")
        keys = page_keys(NS_A, TOKENS, 16)
        assert await wait_for(lambda: _pages(b, keys, "A", 6))
        await a.stop()
        assert await b.lookup(NS_A.digest, keys) == []
        await b.stop()
    finally:
        for s in servers:
            s.stop()


async def test_remote_tier_entries_are_found_by_a_lookup_before_asking_it(tmp_path):
    server = RedisServer(tmp_path / "r")
    try:
        writer, _ = await make_index(cfg(server.url), "W")
        reader, _ = await make_index(cfg(server.url), "R")
        keys = page_keys(NS_A, TOKENS, 16)
        writer.on_remote("add", NS_A.digest, keys[:4])   # the remote tier stored these (its writer thread)
        await asyncio.sleep(0.2)
        found = await reader.lookup(NS_A.digest, keys)
        assert [(p["instance"], p["pages"], p["tier"], p["url"]) for p in found] == [(REMOTE, 4, "remote", "")]
        assert await reader.lookup(NS_B.digest, page_keys(NS_B, TOKENS, 16)) == []
        writer.on_remote("remove", NS_A.digest, keys[2:4])   # deleted within remote.max_bytes
        await asyncio.sleep(0.2)
        assert [p["pages"] for p in await reader.lookup(NS_A.digest, keys)] == [2]
        await writer.stop()   # the records are the remote store's: they outlive the instance that wrote them
        await asyncio.sleep(0.1)
        assert [p["pages"] for p in await reader.lookup(NS_A.digest, keys)] == [2]
        await reader.stop()
    finally:
        server.stop()
