"""RedisIndex: which live instance holds which page, in Redis, so instances share prefixes.

Layout (all keys under cluster.key_prefix P; `{ns}` is a hash tag, so in Redis Cluster the pages
of one namespace live on one node and a prompt's lookup is one round trip per node):
    P{ns}:page:<key hex>   hash   instance id -> its best tier for the page; "@remote" -> "remote"
                                  while the remote tier holds the page (an instance that wrote it says so)
    P:inst:<id>:pages      set    "<ns>:<key hex>" of every page the instance published
    P:live                 hash   instance id -> JSON {url, expires (unix seconds)}

Rules:
- Residency changes arrive from the store's listener (any thread) and are published in
  batches, pipelined, every flush_interval_s. An instance republishes its whole residency
  when it starts and after every reconnect, so the index is never stale after a restart.
- A lookup is one pipelined round trip and ignores instances whose heartbeat expired, at
  once; their entries are garbage-collected by whichever instance notices.
- Remote tier entries are published by the instance that wrote (or deleted) the records, as the
  pseudo-instance REMOTE, always live: a lookup then knows how much of a prompt the remote
  tier holds before asking it. They are not republished after a reconnect (the records are
  not this instance's residency); a lookup that finds none asks the remote tier itself.
- Redis unreachable: local-only mode. Lookups answer nothing, nothing raises, the error is
  logged once per outage (with backoff between reconnects) and `state` says so. A Redis that
  refuses our credentials or TLS settings is a configuration error: start() raises.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import secrets
import socket
import time
from typing import Callable, Iterable

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError, TimeoutError as RedisTimeoutError

from kvstore.config import ClusterConfig
from kvstore.errors import KVStoreError

log = logging.getLogger("kvstore.cluster")
TIER_RANK = {"hot": 0, "warm": 1, "cold": 2, "remote": 3}
REMOTE = "@remote"   # the pseudo-instance whose entries say the remote tier holds a page
Resolver = Callable[[list[bytes]], dict[bytes, tuple[str, bytes] | None]]   # key -> (tier, ns digest) | None
_DOWN = (RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError)


def default_instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def _auth_message(url: str, exc: Exception) -> str:
    text = str(exc).lower()
    if "noauth" in text or "authentication required" in text or "already authenticated" in text:
        return "Redis requires a password: put it in cluster.redis_url (redis://:PASSWORD@host:port)"
    if "wrongpass" in text or "invalid password" in text or "invalid username" in text:
        return "Redis refused the credentials in cluster.redis_url (wrong user or password)"
    return f"Redis refused the connection settings in cluster.redis_url: {exc}"


def _tls_hint(text: str) -> str:
    if "certificate" in text:
        return "its TLS certificate is not trusted (add ?ssl_ca_certs=FILE to the rediss:// URL)"
    if "wrong version" in text or "ssl" in text:
        return "it does not speak TLS (use redis://, not rediss://)"
    return "it closed the connection (if it requires TLS, use rediss://)"


class RedisIndex:
    def __init__(self, cfg: ClusterConfig, url: str, resolve: Resolver,
                 snapshot: Callable[[], Iterable[tuple[bytes, str, bytes]]]):
        """resolve(keys) gives each key's current (best tier, namespace digest) or None;
        snapshot() every resident page as (key, tier, namespace digest)."""
        self.cfg = cfg
        self.url = url                    # the address peers fetch pages from
        self.id = cfg.instance_id or default_instance_id()
        self.prefix = cfg.key_prefix
        self.resolve, self.snapshot = resolve, snapshot
        self.redis = self._client()
        self.state = "disconnected"
        self.last_error = ""
        self.errors = 0
        self.published = 0
        self._pending: collections.deque[bytes] = collections.deque()
        self._remote: collections.deque[tuple[str, bytes, list[bytes]]] = collections.deque()
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    def _client(self):
        if self.cfg.redis_mode == "cluster":
            return aioredis.RedisCluster.from_url(self.cfg.redis_url, socket_timeout=2, socket_connect_timeout=2)
        return aioredis.from_url(self.cfg.redis_url, socket_timeout=2, socket_connect_timeout=2)

    # keys
    def page_key(self, ns: bytes, key: bytes) -> str:
        return f"{self.prefix}{{{ns.hex()[:16]}}}:page:{key.hex()}"

    @property
    def live_key(self) -> str:
        return f"{self.prefix}live"

    def pages_key(self, instance: str) -> str:
        return f"{self.prefix}inst:{instance}:pages"

    # lifecycle
    async def start(self) -> None:
        """Connect, register, publish everything; then heartbeat and publish in the background.
        Raises KVStoreError if Redis refuses our credentials or TLS settings."""
        try:
            await self._sync()
        except (AuthenticationError, ResponseError) as exc:
            raise KVStoreError(_auth_message(self.cfg.redis_url, exc)) from None
        except _DOWN as exc:
            text = str(exc).lower()
            if any(s in text for s in ("closed by server", "reset by peer", "ssl", "certificate", "wrong version")):
                raise KVStoreError(f"Redis at cluster.redis_url answered, but not as configured: {_tls_hint(text)}"
                                   ) from None
            self._down(exc)   # not reachable now: local-only mode, retried in the background
        self._stopping = False
        self._tasks = [asyncio.create_task(self._heartbeat(), name="kvstore-index-heartbeat"),
                       asyncio.create_task(self._publisher(), name="kvstore-index-publish")]

    async def stop(self, deregister: bool = True) -> None:
        self._stopping = True   # the loops end at their next turn, should a cancel be lost
        pending = set(self._tasks)
        while pending:   # a Redis call's own timeout racing the cancel can swallow it: cancel again
            for t in pending:
                t.cancel()
            _, pending = await asyncio.wait(pending, timeout=1.0)
        self._tasks = []
        if deregister and self.state == "connected":
            with contextlib.suppress(RedisError, *_DOWN):
                await self.forget(self.id)
        with contextlib.suppress(RedisError, *_DOWN):
            await self.redis.aclose()

    def _down(self, exc: BaseException) -> None:
        if self.state != "disconnected" or not self.last_error:
            log.warning("Redis index unreachable (%s): local-only mode until it comes back", type(exc).__name__)
        self.state, self.last_error = "disconnected", f"{type(exc).__name__}: {exc}"
        self.errors += 1

    async def _sync(self) -> None:
        """Register and republish the whole residency (at start and after a reconnect)."""
        await self._beat()
        self._pending.clear()
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.pages_key(self.id))
        n = 0
        for key, tier, ns in self.snapshot():
            pipe.hset(self.page_key(ns, key), self.id, tier)
            pipe.sadd(self.pages_key(self.id), f"{ns.hex()}:{key.hex()}")
            n += 1
        await pipe.execute()
        self.published += n
        if self.state != "connected":
            log.info("Redis index connected: %d pages published as %s", n, self.id)
        self.state, self.last_error = "connected", ""

    async def _beat(self) -> None:
        await self.redis.hset(self.live_key, self.id,
                              json.dumps({"url": self.url, "expires": time.time() + self.cfg.ttl_s}))

    async def _heartbeat(self) -> None:
        backoff = self.cfg.heartbeat_s
        while not self._stopping:
            try:
                if self.state == "connected":
                    await self._beat()
                    await self.gc()
                else:
                    await self._sync()
                backoff = self.cfg.heartbeat_s
            except (RedisError, *_DOWN) as exc:
                self._down(exc)
                backoff = min(backoff * 2, 10.0)
            await asyncio.sleep(backoff if self.state != "connected" else self.cfg.heartbeat_s)

    # publishing
    def on_residency(self, event: str, key: bytes, tier: str) -> None:
        """Store listener: called under the store lock from any thread; only queues the key."""
        self._pending.append(key)

    def on_remote(self, event: str, ns: bytes, keys: list[bytes]) -> None:
        """Remote tier listener (its writer thread): pages it stored ("add") or deleted ("remove")."""
        self._remote.append((event, ns, keys))

    async def _publish_remote(self) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for _ in range(len(self._remote)):
            event, ns, keys = self._remote.popleft()
            for key in keys:
                if event == "add":
                    pipe.hset(self.page_key(ns, key), REMOTE, "remote")
                else:
                    pipe.hdel(self.page_key(ns, key), REMOTE)
        await pipe.execute()

    async def _publisher(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            await asyncio.sleep(self.cfg.flush_interval_s)
            if self.state == "connected" and self._remote:
                try:
                    await self._publish_remote()
                except (RedisError, *_DOWN) as exc:
                    self._down(exc)
            if self.state != "connected" or not self._pending:
                continue
            keys = list(dict.fromkeys(self._pending.popleft() for _ in range(len(self._pending))))
            current = await loop.run_in_executor(None, self.resolve, keys)
            try:
                await self.publish(current)
            except (RedisError, *_DOWN) as exc:
                self._down(exc)   # everything is republished on reconnect

    async def publish(self, current: dict[bytes, tuple[str, bytes] | None]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for key, where in current.items():
            if where is None:
                continue
            tier, ns = where
            pipe.hset(self.page_key(ns, key), self.id, tier)
            pipe.sadd(self.pages_key(self.id), f"{ns.hex()}:{key.hex()}")
        gone = [k for k, where in current.items() if where is None]
        if gone:
            # the namespace of a page that left the store is only in our own set: find it there
            members = await self.redis.smembers(self.pages_key(self.id))
            by_key = {m.decode().split(":")[1]: m.decode() for m in members}
            for key in gone:
                member = by_key.get(key.hex())
                if member:
                    ns_hex = member.split(":")[0]
                    pipe.hdel(self.page_key(bytes.fromhex(ns_hex), key), self.id)
                    pipe.srem(self.pages_key(self.id), member)
        await pipe.execute()
        self.published += len(current)

    # queries
    async def live(self) -> dict[str, dict]:
        raw = await self.redis.hgetall(self.live_key)
        now = time.time()
        out = {}
        for inst, data in raw.items():
            info = json.loads(data)
            if info["expires"] > now:
                out[inst.decode()] = info
        return out

    async def lookup(self, ns: bytes, keys: list[bytes], include_self: bool = False) -> list[dict]:
        """Longest cached prefix of `keys` per live peer: [{"instance", "url", "pages", "tiers"}],
        longest first. One pipelined round trip; [] in local-only mode."""
        if self.state != "connected" or not keys:
            return []
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.live_key)
        for key in keys:
            pipe.hgetall(self.page_key(ns, key))
        try:
            live_raw, *pages = await pipe.execute()
        except (RedisError, *_DOWN) as exc:
            self._down(exc)
            return []
        now = time.time()
        live = {i.decode(): json.loads(v) for i, v in live_raw.items()}
        live = {i: v for i, v in live.items() if v["expires"] > now and (include_self or i != self.id)}
        live[REMOTE] = {"url": ""}   # always live: the records are the remote store's
        result = []
        for inst, info in live.items():
            tiers = []
            for holders in pages:
                tier = holders.get(inst.encode())
                if tier is None:
                    break
                tiers.append(tier.decode())
            if tiers:
                result.append({"instance": inst, "url": info["url"], "pages": len(tiers), "tiers": tiers,
                               "tier": min(tiers, key=TIER_RANK.get)})
        return sorted(result, key=lambda r: -r["pages"])

    async def forget(self, instance: str) -> int:
        """Remove every entry of one instance (a dead one, or this one at shutdown)."""
        members = await self.redis.smembers(self.pages_key(instance))
        pipe = self.redis.pipeline(transaction=False)
        for m in members:
            ns_hex, key_hex = m.decode().split(":")
            pipe.hdel(self.page_key(bytes.fromhex(ns_hex), bytes.fromhex(key_hex)), instance)
        pipe.delete(self.pages_key(instance))
        pipe.hdel(self.live_key, instance)
        await pipe.execute()
        return len(members)

    async def gc(self) -> list[str]:
        """Forget instances whose heartbeat expired more than one ttl ago."""
        raw = await self.redis.hgetall(self.live_key)
        now = time.time()
        dead = [i.decode() for i, v in raw.items() if json.loads(v)["expires"] + self.cfg.ttl_s < now]
        for inst in dead:
            n = await self.forget(inst)
            log.info("Redis index: forgot dead instance %s (%d pages)", inst, n)
        return dead

    def stats(self) -> dict:
        return {"state": self.state, "instance": self.id, "errors": self.errors, "last_error": self.last_error,
                "published": self.published, "pending": len(self._pending)}
