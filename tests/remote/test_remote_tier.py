"""The remote tier on real Redis servers (one, and a 3-master cluster) on free loopback ports: what
one store writes another finds, byte-exact; a damaged, foreign or evicted value is a miss; a
server that goes away makes misses, never errors."""

from __future__ import annotations

import logging
import re
import time

import pytest
import redis

from kvstore.errors import ConfigError
from kvstore.pages import record
from kvstore.pages.keys import Namespace
from kvstore.pages.record import RecordHeader
from kvstore.remote import open_remote
from redisfixtures import cluster, single  # noqa: F401 (fixtures)
from redisutil import RedisServer
from storeutil import SPEC, expected_page, fill_and_commit, make_config, make_store, settle, tokens_for

PAGES = 6


def cluster_url(servers) -> str:
    return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in servers)


def client_of(url: str):
    if url.startswith("redis+cluster://"):
        host, port = url.removeprefix("redis+cluster://").split(",")[0].split(":")
        return redis.RedisCluster(host=host, port=int(port))
    return redis.Redis.from_url(url)


def written(tmp_path, url: str, doc: int, prefix: str, **kw):
    """Store A computes one document's pages and writes them through to the remote; closed."""
    a = make_store(tmp_path / "a", **{"remote.url": url, "remote.key_prefix": prefix, **kw})
    ns = a.namespace()
    tokens = tokens_for(doc, PAGES)
    slots, keys = fill_and_commit(a, ns, tokens)
    a.release(slots)
    settle(a)
    assert a.remote.wait_written(10)
    stats = a.stats()["tiers"]["remote"]
    a.close()
    return ns, tokens, keys, stats


def fetched(tmp_path, url: str, ns: Namespace, tokens, prefix: str, name: str = "b"):
    """A fresh store B (its own data directory) fetches the document from the remote."""
    b = make_store(tmp_path / name, **{"remote.url": url, "remote.key_prefix": prefix})
    return b, b.fetch_remote(tokens, ns)


@pytest.mark.parametrize("kind", ["single", "cluster"])
def test_a_fresh_store_finds_what_another_wrote_byte_exact(tmp_path, request, kind):
    url = request.getfixturevalue("single").url if kind == "single" else cluster_url(request.getfixturevalue("cluster"))
    ns, tokens, keys, stats = written(tmp_path, url, 1, f"t1{kind}:")
    assert stats["written_pages"] == PAGES and stats["state"] == "up"
    b, (local, added) = fetched(tmp_path, url, ns, tokens, f"t1{kind}:")
    try:
        assert (local, added) == (0, PAGES)
        m = b.match(tokens, ns)
        assert m.tiers == ["warm"] * PAGES
        for key in keys:
            e = b.index.get(key)
            page = b.warm.payloads([e.warm])[0]
            assert bytes(page) == expected_page(key).numpy().tobytes()
        st = b.stats()
        assert st["tiers"]["remote"]["hits"] == PAGES and st["bytes_moved"]["remote_to_warm"] == PAGES * SPEC.page_bytes
        # a page B now writes to its own cold tier is not sent again: the remote holds it
        settle(b)
        assert b.remote.wait_written(10)
        assert b.stats()["tiers"]["remote"]["written_pages"] == 0
        assert b.stats()["tiers"]["remote"]["already_present_pages"] == PAGES
    finally:
        b.close()


def test_one_server_is_read_over_one_connection_a_chunk_at_a_time(tmp_path, single, monkeypatch):
    """A single-threaded server given two pipelines at once interleaves them: a fetch from one
    redis-server keeps one read in flight (RedisBackend.reads_in_flight), on one connection."""
    monkeypatch.setattr("kvstore.remote.tier.READ_CHUNK", 2)   # the document's 6 pages in 3 reads
    ns, tokens, _, _ = written(tmp_path, single.url, 6, "t6:")
    b, (local, added) = fetched(tmp_path, single.url, ns, tokens, "t6:")
    try:
        assert (local, added) == (0, PAGES) and b.remote.reads == 3
        readers = [c for c in redis.Redis.from_url(single.url).client_list() if c["cmd"] == "get"]
        assert len(readers) == 1
    finally:
        b.close()


def test_another_namespace_finds_nothing(tmp_path, single):
    ns, tokens, _, _ = written(tmp_path, single.url, 2, "t2:")
    b, (local, added) = fetched(tmp_path, single.url, ns.with_tenant("other"), tokens, "t2:")
    b.close()
    assert (local, added) == (0, 0)


@pytest.mark.parametrize("damage", ["flipped", "truncated", "foreign"])
def test_a_damaged_value_is_a_counted_miss_never_served(tmp_path, single, damage):
    prefix = f"t3{damage}:"
    ns, tokens, keys, _ = written(tmp_path, single.url, 3, prefix)
    r = redis.Redis.from_url(single.url)
    name = f"{prefix}page:{ns.digest.hex()}:{keys[2].hex()}"
    value = bytearray(r.get(name))
    if damage == "flipped":
        value[-100] ^= 0xFF
    elif damage == "truncated":
        value = value[:len(value) // 2]
    else:   # a valid record of another page, under this page's key
        value = r.get(f"{prefix}page:{ns.digest.hex()}:{keys[3].hex()}")
    r.set(name, bytes(value))
    b, (local, added) = fetched(tmp_path, single.url, ns, tokens, prefix)
    try:
        assert (local, added) == (0, 2)           # the chain ends at the damaged page
        assert b.stats()["corrupt_pages"] == 1 and b.stats()["tiers"]["remote"]["corrupt_pages"] == 1
        assert b.match(tokens, ns).num_pages == 2
    finally:
        b.close()


def test_a_key_the_server_evicted_is_a_miss(tmp_path, single):
    ns, tokens, keys, _ = written(tmp_path, single.url, 4, "t4:")
    redis.Redis.from_url(single.url).delete(f"t4:page:{ns.digest.hex()}:{keys[4].hex()}")
    b, (local, added) = fetched(tmp_path, single.url, ns, tokens, "t4:")
    b.close()
    assert (local, added) == (0, 4)


def test_the_budget_deletes_the_oldest_records_this_instance_wrote(tmp_path, single):
    size = len(record.encode_bytes(RecordHeader(b"k" * 32, b"p" * 32, b"n" * 32, b"t" * 4 * SPEC.page_size,
                                                SPEC.fingerprint, SPEC.page_bytes), bytes(SPEC.page_bytes)))
    ns, tokens, keys, stats = written(tmp_path, single.url, 5, "t5:", **{"remote.max_bytes": str(5 * size // 2)})
    assert stats["written_pages"] == PAGES and stats["deleted_pages"] == PAGES - 2 and stats["pages"] == 2
    r = redis.Redis.from_url(single.url)
    held = [bool(r.exists(f"t5:page:{ns.digest.hex()}:{k.hex()}")) for k in keys]
    assert held == [False] * (PAGES - 2) + [True] * 2


def test_a_server_that_goes_away_gives_misses_and_one_log_line(tmp_path, caplog):
    server = RedisServer(tmp_path / "gone")
    ns, tokens, _, _ = written(tmp_path, server.url, 6, "t6:")
    b = make_store(tmp_path / "b", **{"remote.url": server.url, "remote.key_prefix": "t6:", "remote.timeout_ms": "200"})
    try:
        server.proc.kill()
        server.proc.wait()
        with caplog.at_level(logging.INFO, logger="kvstore.remote"):
            t0 = time.monotonic()
            for _ in range(5):
                assert b.fetch_remote(tokens, ns) == (0, 0)
            assert time.monotonic() - t0 < 3
            assert b.stats()["tiers"]["remote"]["state"] == "down"
            warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
            assert len(warnings) == 1 and "remote tier unavailable" in warnings[0].getMessage()
            server.start()
            b.remote.retry_at = 0.0   # the backoff would wait; the test does not
            assert b.fetch_remote(tokens, ns)[1] == 0   # the server came back empty (it keeps nothing)
            assert b.stats()["tiers"]["remote"]["state"] == "up"
            assert any("is back" in r.getMessage() for r in caplog.records)
    finally:
        b.close()
        server.stop()


def test_a_store_starts_while_the_remote_is_down(tmp_path):
    s = make_store(tmp_path / "s", **{"remote.url": "redis://127.0.0.1:1/0", "remote.timeout_ms": "100"})
    try:
        assert s.fetch_remote(tokens_for(7, 2), s.namespace()) == (0, 0)
        assert s.stats()["tiers"]["remote"]["state"] == "down"
    finally:
        s.close()


@pytest.mark.parametrize("url, what", [
    ("memcached://h:1", "must start with one of"),
    ("redis+cluster://nohost", "is not a valid redis+cluster URL"),
])
def test_a_bad_url_is_a_config_error_naming_remote_url(tmp_path, url, what):
    with pytest.raises(ConfigError, match=re.escape(what)) as exc:
        open_remote(make_config(tmp_path, **{"remote.url": url}), SPEC)
    assert exc.value.key == "remote.url"


def test_writing_needs_a_cold_tier(tmp_path):
    with pytest.raises(ConfigError, match="remote.write"):
        make_config(tmp_path, **{"remote.url": "redis://127.0.0.1:1/0", "cold.enabled": "false"})
    make_config(tmp_path, **{"remote.url": "redis://127.0.0.1:1/0", "cold.enabled": "false", "remote.write": "false"})
