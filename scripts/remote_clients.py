"""The backend's own client alone, reading the records kvstore reads: the baseline of
scripts/bench_remote.py. redis-py (redis.Redis or redis.RedisCluster) and Mooncake's
MooncakeDistributedStore, set up as kvstore's backends are."""

from __future__ import annotations

import gc
import time

import numpy as np
import redis

from kvstore.remote.mooncake import parse_url as parse_mooncake_url
from kvstore.remote.redis_backend import READ_BUFFER
from kvstore.remote.tier import READ_CHUNK
from remote_harness import BenchError


class RedisClient:
    """redis-py: redis.Redis or redis.RedisCluster, with kvstore's backend's socket_read_size."""

    name = "redis-py"

    def __init__(self, kind: str, url: str):
        opts = {"socket_read_size": READ_BUFFER, "socket_timeout": 10}
        if kind == "cluster":
            host, port = url.removeprefix("redis+cluster://").split(",")[0].split(":")
            self.client = redis.RedisCluster(host=host, port=int(port), **opts)
        else:
            self.client = redis.Redis.from_url(url, **opts)

    def read(self, names: list[str]) -> list:
        """The values of names, READ_CHUNK GETs a pipeline, kept as bytes (None: missing)."""
        out: list = []
        for i in range(0, len(names), READ_CHUNK):
            pipe = self.client.pipeline(transaction=False)
            for name in names[i:i + READ_CHUNK]:
                pipe.get(name)
            out.extend(pipe.execute())
        return out

    def timed_read(self, names: list[str]) -> tuple[float, list]:
        """(seconds, each value's length or None); only the read is timed."""
        gc.collect()
        t0 = time.perf_counter()
        values = self.read(names)
        seconds = time.perf_counter() - t0
        return seconds, [None if v is None else len(v) for v in values]

    def close(self) -> None:
        self.client.close()


class MooncakeClient:
    """The library's MooncakeDistributedStore alone, a pure client (set up as kvstore's backend
    is, from the same URL: segment 0, no staging buffer), reading READ_CHUNK keys a
    batch_get_into into one registered buffer of READ_CHUNK slots, each as large as the largest
    record (get_size)."""

    name = "MooncakeDistributedStore"

    def __init__(self, url: str):
        from mooncake.store import MooncakeDistributedStore
        cfg = parse_mooncake_url(url)
        self.store, self.buffer, self.registered, self.slot = MooncakeDistributedStore(), None, False, 0
        self.kept = None   # the "kept" reads' buffer: a slot for every record of the document
        rc = self.store.setup(cfg["local"], cfg["metadata"], cfg["segment"], cfg["buffer"], cfg["protocol"],
                              cfg["device"], cfg["master"])
        if rc != 0:
            raise BenchError(f"the Mooncake client could not join the store at {cfg['master']} (setup returned {rc})")
        self.open = True

    def sizes(self, names: list[str]) -> list[int | None]:
        """Each record's size (None: not in the store); sizes the receive buffer for the largest."""
        sizes = [self.store.get_size(n) for n in names]
        sizes = [n if n > 0 else None for n in sizes]
        slot = max((n for n in sizes if n), default=0)
        if slot > self.slot:
            self._unregister()
            self.slot = slot
            self.buffer = np.zeros(READ_CHUNK * slot, np.uint8)   # touched: no page faults in a timed read
            if self.store.register_buffer(self.buffer.ctypes.data, self.buffer.nbytes) != 0:
                raise BenchError(f"the Mooncake client could not register a buffer of {self.buffer.nbytes} bytes")
            self.kept = np.zeros(len(names) * slot, np.uint8)     # touched too
            if self.store.register_buffer(self.kept.ctypes.data, self.kept.nbytes) != 0:
                raise BenchError(f"the Mooncake client could not register a buffer of {self.kept.nbytes} bytes")
            self.registered = True
        return sizes

    def read(self, names: list[str], kept: bool = False) -> list:
        """Each key's byte count as batch_get_into returns it (negative: an error, -704 missing).
        Into the READ_CHUNK slots reused by every call; with `kept`, each record into a slot of
        its own, as a reader that keeps the pages must."""
        slot, out = self.slot, []
        for i in range(0, len(names), READ_CHUNK):
            chunk = names[i:i + READ_CHUNK]
            base = self.kept.ctypes.data + i * slot if kept else self.buffer.ctypes.data
            out.extend(self.store.batch_get_into(chunk, [base + j * slot for j in range(len(chunk))],
                                                 [slot] * len(chunk)))
        return out

    def timed_read(self, names: list[str], kept: bool = False) -> tuple[float, list]:
        gc.collect()
        t0 = time.perf_counter()
        codes = self.read(names, kept)
        seconds = time.perf_counter() - t0
        return seconds, [c if c > 0 else None for c in codes]

    def _unregister(self) -> None:
        if self.registered:   # before close: unregistering with a closed store crashes the process
            self.store.unregister_buffer(self.buffer.ctypes.data)
            self.store.unregister_buffer(self.kept.ctypes.data)
            self.registered = False

    def close(self) -> None:
        if self.open:
            self._unregister()
            self.store.close()
            self.open = False
        self.buffer = self.kept = None   # freed only now, once no store can write into it


def client_fetch(client, names: list[str], sizes: list[int], kept: bool = False) -> float:
    seconds, got = client.timed_read(names, kept) if kept else client.timed_read(names)
    if got != sizes:
        raise BenchError(f"the client ({client.name}) read other values than the record bytes")
    return seconds
