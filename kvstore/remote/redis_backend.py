"""Redis backends of the remote tier: one Redis or Valkey (`redis://`, `rediss://` for TLS) and a
Redis Cluster or Valkey cluster (`redis+cluster://HOST:PORT[,HOST:PORT...]`), through redis-py.

A batch is one pipeline (per node, in a cluster: redis-py sends to every node before it reads
any answer), read through a 1 MiB socket buffer (values are pages; redis-py's default 64 KiB
halves the throughput). Reads into the caller's memory (get_into, the tier's read path) go over
sockets of their own that speak just enough RESP to land each value where it belongs (resp.py),
a connection per node and thread; over TLS or a unix socket they go through redis-py and are
copied. A value in a cluster that moved (MOVED, ASK) is read again through redis-py, which
follows it and learns the new layout. Every socket operation is bounded by the timeout; a connection refused,
reset or timed out raises RemoteDown. In a cluster a batch that touches a node that is down
fails as a whole (redis-py's cluster pipeline), so the tier is down until the node is back or
failed over. The password comes from the URL, or else from the environment variable
remote.password_env names (`password` below); neither is ever logged.
"""

from __future__ import annotations

import threading
from typing import Sequence
from urllib.parse import parse_qs, urlsplit

import numpy as np

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import AuthenticationError, RedisClusterException, RedisError, ResponseError
from redis.retry import Retry

from kvstore.errors import ConfigError
from kvstore.remote.backend import MISSING, REMOTE_BACKENDS, Check, RemoteBackend, RemoteDown, land_values
from kvstore.remote.resp import ERROR, HandshakeRefused, LandingConnection

_CHUNK = 64                # commands a pipeline carries at most (values are pages: ~1 MiB each)
READ_BUFFER = 1 << 20      # bytes a socket read takes at most


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text[:200]}"


class RedisBackend(RemoteBackend):
    scheme = "redis"
    # one read at a time: a second connection to the one single-threaded server made it interleave
    # two pipelines (kvstore 0.76-0.95x redis-py's throughput, 0.96-1.11x with one; BENCHMARKS.md)
    reads_in_flight = 1

    def __init__(self, url: str, timeout_s: float, password: str = ""):
        super().__init__(url, timeout_s)
        opts = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s, "retry": Retry(NoBackoff(), 0),
                "socket_read_size": READ_BUFFER}   # no retries: one timeout is the bound
        if password and not urlsplit(url).password:
            opts["password"] = password
        self._landing = threading.local()   # per thread: (host, port) -> LandingConnection
        self._landing_all: set[LandingConnection] = set()
        self._landing_lock = threading.Lock()
        try:
            self.client = self._connect(url, opts)
        except (ValueError, RedisClusterException) as exc:
            raise ConfigError("remote.url", self.describe(), f"is not a valid {self.scheme} URL: {exc}") from None
        except RedisError as exc:
            self._refused(exc)
            raise RemoteDown(f"the remote store at {self.describe()} cannot be reached: {_one_line(exc)}") from None

    def _connect(self, url: str, opts: dict):
        client = redis.Redis.from_url(url, **opts)
        pool = client.connection_pool
        kw = pool.connection_kwargs
        self._auth = (kw.get("username"), kw.get("password"), kw.get("db") or 0)
        self._direct = pool.connection_class is redis.Connection   # not TLS, not a unix socket
        self._node = (kw.get("host"), kw.get("port"))
        return client

    def _refused(self, exc: BaseException) -> None:
        """A server that refuses our credentials is a configuration error, not an outage."""
        if isinstance(exc, AuthenticationError) or "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
            raise ConfigError("remote.url", self.describe(), "the remote store refused the credentials: put the "
                              "password in the URL or in the variable remote.password_env names") from None

    def _run(self, commands) -> list:
        """Results of one pipeline of (method, args) pairs, in order; RemoteDown when it fails."""
        pipe = self.client.pipeline(transaction=False)
        for method, *args in commands:
            getattr(pipe, method)(*args)
        try:
            return pipe.execute(raise_on_error=False)
        except RedisError as exc:
            self._refused(exc)
            raise RemoteDown(f"the remote store at {self.describe()} failed: {_one_line(exc)}") from None
        except OSError as exc:
            raise RemoteDown(f"the remote store at {self.describe()} failed: {_one_line(exc)}") from None

    def _batched(self, method: str, args: Sequence) -> list:
        out: list = []
        for i in range(0, len(args), _CHUNK):
            results = self._run([(method, *a) for a in args[i:i + _CHUNK]])
            out.extend(self._check(results))
        return out

    def _check(self, results: list) -> list:
        """Errors in place of results: a failed command is a miss for its key; all failed: RemoteDown."""
        errors = [r for r in results if isinstance(r, Exception)]
        if not errors:
            return results
        if len(errors) == len(results):
            self._refused(errors[0])
            if isinstance(errors[0], ResponseError) and "OOM" in str(errors[0]):
                raise RemoteDown(f"the remote store at {self.describe()} is full (maxmemory without an eviction "
                                 "policy: set maxmemory-policy allkeys-lru)")
            raise RemoteDown(f"the remote store at {self.describe()} failed: {_one_line(errors[0])}")
        return [None if isinstance(r, Exception) else r for r in results]

    def get_many(self, keys: Sequence[str]) -> list:
        return self._batched("get", [(k,) for k in keys])

    def _node_of(self, key: str) -> tuple[str, int]:
        return self._node

    def _relearn(self) -> None:
        """After a failed read: a cluster learns its layout again (a replica may have taken over)."""

    def _landing_connection(self, node: tuple[str, int]) -> LandingConnection:
        conns = self._landing.__dict__.setdefault("conns", {})
        conn = conns.get(node)
        if conn is None:
            conn = conns[node] = LandingConnection(*node, self.timeout_s, *self._auth)
            with self._landing_lock:
                self._landing_all.add(conn)
        return conn

    def _drop_landing(self, nodes) -> None:
        conns = self._landing.__dict__.get("conns", {})
        for node in nodes:
            conn = conns.pop(node, None)
            if conn is not None:
                conn.close()
                with self._landing_lock:
                    self._landing_all.discard(conn)

    def get_into(self, keys: Sequence[str], heads: Sequence[np.ndarray], targets: Sequence[np.ndarray],
                 check: Check | None = None) -> list[int]:
        """One pipeline per node (the values land in the caller's memory, so a batch needs no bound
        here: the remote tier asks READ_CHUNK keys a call)."""
        if not self._direct:
            return super().get_into(keys, heads, targets, check)
        by_node: dict[tuple[str, int], list[int]] = {}
        codes, errors = [MISSING] * len(keys), {}
        try:   # every node's requests go out before any answer is read
            for i, key in enumerate(keys):
                by_node.setdefault(self._node_of(key), []).append(i)
            conns = {node: self._landing_connection(node) for node in by_node}
            for node, idx in by_node.items():
                conns[node].send_gets([keys[j] for j in idx])
            for node, idx in by_node.items():
                got = conns[node].read_into([heads[j] for j in idx], [targets[j] for j in idx],
                                            None if check is None else lambda k, idx=idx: check(idx[k]))
                messages = iter(conns[node].errors)
                for j, code in zip(idx, got):
                    codes[j] = code
                    if code == ERROR:
                        errors[j] = next(messages, "")
        except HandshakeRefused as exc:
            self._drop_landing(by_node)
            self._refused(exc)
            raise RemoteDown(f"the remote store at {self.describe()} refused the connection: {exc}") from None
        except (OSError, ValueError, RedisError, RedisClusterException) as exc:
            self._drop_landing(by_node)
            self._relearn()
            raise RemoteDown(f"the remote store at {self.describe()} failed: {_one_line(exc)}") from None
        return self._errors_into(keys, heads, targets, check, codes, errors)

    def _errors_into(self, keys, heads, targets, check, codes: list[int], errors: dict[int, str]) -> list[int]:
        """codes with their error replies (errors: key index -> message) resolved: a value that moved
        is read through redis-py; any other error is a miss (every key such an error: RemoteDown)."""
        if not errors:
            return codes
        moved = [i for i, e in errors.items() if e.startswith(("MOVED", "ASK"))]
        if len(errors) == len(codes) and not moved:
            self._check([ResponseError(e) for e in errors.values()])
        again = land_values(self.get_many([keys[i] for i in moved]), [heads[i] for i in moved],
                            [targets[i] for i in moved],
                            None if check is None else lambda k: check(moved[k])) if moved else []
        out = list(codes)
        for i in errors:
            out[i] = MISSING
        for i, code in zip(moved, again):
            out[i] = code
        return out

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        results = self._batched("set", list(items))
        if any(r is None for r in results):
            raise RemoteDown(f"the remote store at {self.describe()} took only some of the pages: a node failed")

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [bool(n) for n in self._batched("exists", [(k,) for k in keys])]

    def delete_many(self, keys: Sequence[str]) -> None:
        self._batched("delete", [(k,) for k in keys])

    def close(self) -> None:
        with self._landing_lock:
            conns, self._landing_all = self._landing_all, set()
        for conn in conns:
            conn.close()
        self.client.close()


class RedisClusterBackend(RedisBackend):
    scheme = "redis+cluster"
    reads_in_flight = 2   # a read fans out over the masters: two keep them busy (1.12-1.20x redis-py; one 1.13)

    def _connect(self, url: str, opts: dict):
        parts = urlsplit(url)
        hosts = parts.netloc.rpartition("@")[2]
        nodes = []
        for hp in filter(None, hosts.split(",")):
            host, _, port = hp.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"each node must be HOST:PORT, not {hp!r}")
            nodes.append(ClusterNode(host.strip("[]"), int(port)))
        if not nodes:
            raise ValueError("no HOST:PORT given")
        query = parse_qs(parts.query)
        if parts.username:
            opts["username"] = parts.username
        if parts.password:
            opts["password"] = parts.password
        if query.get("ssl", ["false"])[0].lower() in ("1", "true", "yes"):
            opts["ssl"] = True
            if "ssl_ca_certs" in query:
                opts["ssl_ca_certs"] = query["ssl_ca_certs"][0]
        self._auth = (opts.get("username"), opts.get("password"), 0)
        self._direct = not opts.get("ssl")
        return RedisCluster(startup_nodes=nodes, **opts)

    def _node_of(self, key: str) -> tuple[str, int]:
        node = self.client.nodes_manager.get_node_from_slot(self.client.keyslot(key))
        return node.host, node.port

    def _relearn(self) -> None:
        """The reads go to the nodes redis-py knows; after a failure it asks the cluster again (the
        next retry then reaches a replica that took over), or keeps what it knew."""
        try:
            self.client.nodes_manager.initialize()
        except (RedisError, RedisClusterException, OSError):
            pass

    def _run(self, commands) -> list:
        try:
            return super()._run(commands)
        except RedisClusterException as exc:
            raise RemoteDown(f"the remote cluster at {self.describe()} failed: {_one_line(exc)}") from None


def _factory(cls):
    def build(url: str, timeout_s: float, password: str = "") -> RemoteBackend:
        return cls(url, timeout_s, password)
    return build


REMOTE_BACKENDS.register("redis")(_factory(RedisBackend))
REMOTE_BACKENDS.register("rediss")(_factory(RedisBackend))
REMOTE_BACKENDS.register("redis+cluster")(_factory(RedisClusterBackend))
