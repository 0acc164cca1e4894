"""Reads that land in the caller's memory (get_into), on real servers: each backend lands a value of
exactly head + target bytes in its two parts, says MISSING for a key it does not hold and
WRONG_SIZE for a longer or shorter value (and the replies after one are still right); the Redis
read path's own RESP connection reads past an error reply, authenticates, and a cluster value
whose slot moved is read where it went, and after a failover reads reach the replica that took
over. At store level a fetch adopts only what warm has room
for, and neither a short warm nor a damaged value leaves a reserved slot behind."""

from __future__ import annotations

import os
import subprocess
import time

import numpy as np
import pytest
import redis

import mooncakeutil
from conftest import requires
from kvstore.remote import mooncake, redis_backend  # noqa: F401 (they register the built-in backends)
from kvstore.remote.backend import FAILED_CHECK, LANDED, MISSING, REMOTE_BACKENDS, WRONG_SIZE, RemoteDown
from kvstore.remote.resp import ERROR, HandshakeRefused, LandingConnection
from redisfixtures import cluster, single  # noqa: F401 (fixtures)
from redisutil import RedisServer, make_cluster
from storeutil import fill_and_commit, make_store, reserved_warm_slots, settle, tokens_for

HEAD = 40


def values(size: int) -> dict[str, bytes]:
    """Keys of every kind get_into tells apart; None: not stored."""
    exact = os.urandom(HEAD + size)
    return {"v:exact": exact, "v:missing": None, "v:long": exact + b"x", "v:short": exact[:-1],
            "v:exact2": os.urandom(HEAD + size)}


def land(backend, keys: list[str], size: int):
    heads = [np.zeros(HEAD, np.uint8) for _ in keys]
    targets = [np.zeros(size, np.uint8) for _ in keys]
    return backend.get_into(keys, heads, targets), heads, targets


def check_landed(codes, heads, targets, keys, stored) -> None:
    def kind(value) -> int:
        if value is None:
            return MISSING
        return LANDED if len(value) == HEAD + len(targets[0]) else WRONG_SIZE
    expect = [kind(stored[k]) for k in keys]
    assert codes == expect
    for code, head, target, key in zip(codes, heads, targets, keys):
        if code == LANDED:
            assert head.tobytes() + target.tobytes() == stored[key]


def assert_checked(backend, keys: list[str], size: int) -> None:
    """check(i) is asked of every landed value, and a no is FAILED_CHECK."""
    asked = []

    def check(i: int) -> bool:
        asked.append(keys[i])
        return keys[i] != "v:exact2"
    heads, targets = [np.zeros(HEAD, np.uint8) for _ in keys], [np.zeros(size, np.uint8) for _ in keys]
    codes = backend.get_into(keys, heads, targets, check)
    assert sorted(asked) == ["v:exact", "v:exact2"]
    assert codes[keys.index("v:exact")] == LANDED and codes[keys.index("v:exact2")] == FAILED_CHECK


def put(client, stored: dict[str, bytes]) -> None:
    for k, v in stored.items():
        if v is not None:
            client.set(k, v)


@pytest.mark.parametrize("size", [100, 3 << 20])   # inside one receive buffer, and far past it
def test_one_redis_lands_values_and_tells_the_rest_apart(single, size):
    stored = values(size)
    put(redis.Redis.from_url(single.url), stored)
    backend = REMOTE_BACKENDS.get("redis")(single.url, 2.0, "")
    try:
        keys = list(stored) * 2   # every kind, then again on the same connection
        check_landed(*land(backend, keys, size), keys, stored)
        assert_checked(backend, list(stored), size)
    finally:
        backend.close()


def test_a_cluster_lands_values_from_every_master(cluster):
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in cluster)
    stored = {f"c:{i}": os.urandom(HEAD + 5000) for i in range(40)} | {"c:missing": None, "c:short": b"xy"}
    client = redis.RedisCluster(host="127.0.0.1", port=cluster[0].port)
    put(client, stored)
    backend = REMOTE_BACKENDS.get("redis+cluster")(url, 2.0, "")
    try:
        keys = list(stored)
        assert len({backend._node_of(k) for k in keys}) == 3
        check_landed(*land(backend, keys, 5000), keys, stored)
    finally:
        backend.close()
        client.close()


def _cli(port: int, *args: str) -> str:
    return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True, check=True,
                          timeout=10).stdout.strip()


def test_a_cluster_value_whose_slot_moved_is_read_where_it_went(cluster):
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in cluster)
    backend = REMOTE_BACKENDS.get("redis+cluster")(url, 2.0, "")
    key, value = "moving:{m1}", os.urandom(HEAD + 3000)
    client = redis.RedisCluster(host="127.0.0.1", port=cluster[0].port)
    try:
        client.set(key, value)
        slot = backend.client.keyslot(key)
        src_host, src_port = backend._node_of(key)   # the backend learned the layout before the move
        dst = next(s for s in cluster if s.port != src_port)
        ids = {s.port: _cli(s.port, "cluster", "myid") for s in cluster}
        _cli(dst.port, "cluster", "setslot", str(slot), "importing", ids[src_port])
        _cli(src_port, "cluster", "setslot", str(slot), "migrating", ids[dst.port])
        _cli(src_port, "migrate", "127.0.0.1", str(dst.port), key, "0", "5000")
        for s in cluster:
            _cli(s.port, "cluster", "setslot", str(slot), "node", ids[dst.port])
        assert backend._node_of(key) == (src_host, src_port)   # still the old layout: the read is MOVED
        codes, heads, targets = land(backend, [key], 3000)
        assert codes == [LANDED] and heads[0].tobytes() + targets[0].tobytes() == value
        assert backend._node_of(key)[1] == dst.port            # redis-py learned where it went
        assert land(backend, [key], 3000)[0] == [LANDED]
    finally:
        backend.close()
        client.close()


def test_the_resp_connection_reads_past_an_error_reply(single):
    r = redis.Redis.from_url(single.url)
    r.delete("e:list")
    r.rpush("e:list", "a")
    r.set("e:after", b"h" * HEAD + b"p" * 10)
    conn = LandingConnection("127.0.0.1", single.port, 2.0)
    try:
        conn.send_gets(["e:list", "e:after"])
        heads, targets = [np.zeros(HEAD, np.uint8)] * 2, [np.zeros(10, np.uint8) for _ in range(2)]
        assert conn.read_into(heads, targets) == [ERROR, LANDED]
        assert conn.errors[0].startswith("WRONGTYPE") and targets[1].tobytes() == b"p" * 10
    finally:
        conn.close()


def test_the_resp_connection_authenticates_and_a_wrong_password_is_refused(tmp_path):
    server = RedisServer(tmp_path / "auth", password="s3cret")
    try:
        redis.Redis(port=server.port, password="s3cret").set("a:k", b"h" * HEAD + b"page")
        backend = REMOTE_BACKENDS.get("redis")(server.url, 2.0, "")
        try:
            assert land(backend, ["a:k"], 4)[0] == [LANDED]
        finally:
            backend.close()
        with pytest.raises(HandshakeRefused, match="WRONGPASS|invalid"):
            LandingConnection("127.0.0.1", server.port, 2.0, password="wrong")
    finally:
        server.stop()


def test_over_tls_values_land_through_redis_py(tmp_path):
    server = RedisServer(tmp_path / "tls", tls=True)
    try:
        backend = REMOTE_BACKENDS.get("rediss")(server.url, 2.0, "")
        try:
            assert not backend._direct
            stored = values(64)
            put(backend.client, stored)
            keys = list(stored)
            check_landed(*land(backend, keys, 64), keys, stored)
            assert_checked(backend, keys, 64)
        finally:
            backend.close()
    finally:
        server.stop()


def test_mooncake_lands_values_and_tells_the_rest_apart(tmp_path):
    requires(not mooncakeutil.missing(), mooncakeutil.missing())
    master = mooncakeutil.MooncakeMaster(tmp_path / "master")
    backend = REMOTE_BACKENDS.get("mooncake")(master.url, 2.0)
    try:
        stored = values(700 * 1024)
        backend.put_many([(k, v) for k, v in stored.items() if v is not None])
        keys = list(stored)
        check_landed(*land(backend, keys, 700 * 1024), keys, stored)
        assert_checked(backend, keys, 700 * 1024)
        area = np.zeros(4 * (700 << 10), np.uint8)    # memory the tier lends: registered, and landed in
        backend.lend(area)
        codes = backend.get_into(["v:exact"], [np.zeros(HEAD, np.uint8)], [area[:700 << 10]])
        assert codes == [LANDED] and area[:700 << 10].tobytes() == stored["v:exact"][HEAD:]
    finally:
        backend.close()
        master.stop()


def test_mooncake_lands_whole_values_in_the_room_before_each_target(tmp_path):
    """With room lent before each target, a value lands in one piece, its head in the room: every
    kind is told apart as before, and nothing outside a slot's room and target is written (a long
    value is refused, not spilled into the next slot)."""
    requires(not mooncakeutil.missing(), mooncakeutil.missing())
    master = mooncakeutil.MooncakeMaster(tmp_path / "master")
    backend = REMOTE_BACKENDS.get("mooncake")(master.url, 2.0)
    size, room = 700 * 1024, 64
    stride = room + size + 64        # room, target, then a guard that no value may touch
    try:
        stored = values(size)
        backend.put_many([(k, v) for k, v in stored.items() if v is not None])
        keys = list(stored)
        area = np.full(len(keys) * stride, 0xAB, np.uint8)
        backend.lend(area, room)
        targets = [area[i * stride + room:i * stride + room + size] for i in range(len(keys))]
        heads = [np.zeros(HEAD, np.uint8) for _ in keys]
        codes = backend.get_into(keys, heads, targets)
        check_landed(codes, heads, targets, keys, stored)
        for i in range(len(keys)):
            guard = area[i * stride + room + size:(i + 1) * stride]
            assert (guard == 0xAB).all(), f"{keys[i]} wrote past its target"
            assert (area[i * stride:i * stride + room - HEAD] == 0xAB).all(), f"{keys[i]} wrote before its head"
            if codes[i] == LANDED:   # in one piece: the head is in the room, just before the target
                assert area[i * stride + room - HEAD:i * stride + room].tobytes() == stored[keys[i]][:HEAD]
        assert_checked(backend, keys, size)
        # a head longer than the room lands in two parts, still exactly
        head = np.zeros(room + 8, np.uint8)
        target = area[room + size - (HEAD + size - len(head)):room + size]
        assert backend.get_into(["v:exact"], [head], [target]) == [LANDED]
        assert head.tobytes() + target.tobytes() == stored["v:exact"]
    finally:
        backend.close()
        master.stop()


def test_a_fetch_adopts_what_warm_has_room_for_and_leaves_no_slot_reserved(tmp_path, single):
    a = make_store(tmp_path / "a", **{"remote.url": single.url, "remote.key_prefix": "w1:"})
    ns, tokens = a.namespace(), tokens_for(11, 6)
    slots, keys = fill_and_commit(a, ns, tokens)
    a.release(slots)
    settle(a)
    assert a.remote.wait_written(10)
    a.close()
    b = make_store(tmp_path / "b", warm=4, **{"remote.url": single.url, "remote.key_prefix": "w1:",
                                               "cold.enabled": "false", "remote.write": "false"})
    try:
        local, added = b.fetch_remote(tokens, ns)
        assert (local, added) == (0, 4) and b.match(tokens, ns).num_pages == 4
        assert reserved_warm_slots(b) == 0   # every used slot is indexed or a caller's
        redis.Redis.from_url(single.url).set(f"w1:page:{ns.digest.hex()}:{keys[2].hex()}", b"damaged")
        b.evict(keys[:4])
        assert b.fetch_remote(tokens, ns) == (0, 2)     # the damaged third page ends the chain
        assert b.stats()["tiers"]["remote"]["corrupt_pages"] == 1
        assert reserved_warm_slots(b) == 0   # every used slot is indexed or a caller's
    finally:
        b.close()


def test_after_a_failover_reads_reach_the_replica_that_took_over(tmp_path):
    servers = make_cluster(tmp_path / "replicated", 3, 1, ("--cluster-node-timeout", "500"))
    backend = None
    try:
        url = "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in servers)
        stored = {f"f:{i}": os.urandom(HEAD + 2000) for i in range(30)}
        client = redis.RedisCluster(host="127.0.0.1", port=servers[0].port)
        put(client, stored)
        client.close()
        masters = [s for s in servers if _cli(s.port, "role").splitlines()[0] == "master"]
        for s in masters:   # every write has reached the replica before its master goes
            assert int(_cli(s.port, "wait", "1", "5000")) == 1
        backend = REMOTE_BACKENDS.get("redis+cluster")(url, 1.0, "")
        keys = list(stored)
        check_landed(*land(backend, keys, 2000), keys, stored)
        victim = next(s for s in masters if s.port == backend._node_of(keys[0])[1])
        victim.proc.kill()
        victim.proc.wait()
        with pytest.raises(RemoteDown):
            land(backend, keys, 2000)
        deadline, codes = time.monotonic() + 30, None
        while time.monotonic() < deadline:
            try:
                codes, heads, targets = land(backend, keys, 2000)
                break
            except RemoteDown:
                time.sleep(0.2)
        assert codes is not None, "the reads never reached the replica that took over"
        check_landed(codes, heads, targets, keys, stored)
        assert backend._node_of(keys[0])[1] != victim.port
    finally:
        if backend is not None:
            backend.close()
        for s in servers:
            s.stop()
