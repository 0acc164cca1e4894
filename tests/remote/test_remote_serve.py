"""Two `kvstore serve` instances sharing a cache through a real 3-master Redis Cluster on loopback
ports, no peers: what A computed, a fresh B (its own data directory) reads from the remote tier,
exactly; a damaged value is a counted miss; a master SIGKILLed leaves answers 200 and exact."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from pathlib import Path

import aiohttp
import pytest
import redis

from redisutil import make_cluster

REPO = str(Path(__file__).resolve().parents[2])
READY = re.compile(r"kvstore serve: \S+ ready on (http://[\d.:]+) .*admin API on (http://[\d.:]+)\n")
PAGE = 16
PREFIX = "kvs-e2e:"


def document(i: int, n: int = 20 * PAGE + 3) -> list[int]:
    return [(i * 37 + j * 11) % 250 for j in range(n)]


class Instance:
    def __init__(self, proc, api, admin, log: Path):
        self.proc, self.api, self.admin, self.log = proc, api, admin, log


async def start(tmp_path: Path, name: str, url: str) -> Instance:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    log = tmp_path / f"{name}.log"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "app", "serve", "--model", "tiny", "--port", "0", "--admin-port", "0",
        "--data-dir", str(tmp_path / name), "--set", f"remote.url={url}", "--set", f"remote.key_prefix={PREFIX}",
        "--set", "remote.timeout_ms=300", "--set", "kv_dtype=float32", "--set", "engine.dtype=float32",
        cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE, stderr=open(log, "wb"))
    line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
    m = READY.fullmatch(line)
    if not m:
        proc.kill()
        raise AssertionError((line, log.read_text()[-3000:]))
    return Instance(proc, m.group(1), m.group(2), log)


async def stop(inst: Instance) -> int:
    if inst.proc.returncode is None:
        inst.proc.send_signal(signal.SIGTERM)
    return await asyncio.wait_for(inst.proc.wait(), 60)


async def complete(session, inst, tokens, max_tokens=6):
    body = {"model": "tiny", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    async with session.post(inst.api + "/v1/completions", json=body) as r:
        data = await r.json()
        assert r.status == 200, data
        return data["choices"][0]["token_ids"], data["usage"]["kvstore"]["cached_tokens"]


async def remote_stats(session, inst) -> dict:
    async with session.get(inst.admin + "/v1/stats") as r:
        return (await r.json())["tiers"]["remote"]


async def written(session, inst, pages: int, timeout: float = 30.0) -> dict:
    """Wait until the instance has written at least `pages` pages to the remote tier, none queued."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        r = await remote_stats(session, inst)
        if r["written_pages"] + r["already_present_pages"] >= pages and r["queued_pages"] == 0:
            return r
        assert asyncio.get_running_loop().time() < deadline, r
        await asyncio.sleep(0.1)


async def answered_from_remote(session, inst, docs, answers) -> int:
    """The instance answers each document exactly as `answers`, with >= 95% of the documents'
    reusable tokens (full pages; the last token is always computed) read from the remote tier;
    returns those tokens."""
    remote = 0
    for d, expected in zip(docs, answers):
        tokens, cached = await complete(session, inst, d)
        assert tokens == expected
        remote += cached["remote"]
    assert remote >= 0.95 * sum((len(d) - 1) // PAGE * PAGE for d in docs)
    return remote


def remote_keys(client) -> set[bytes]:
    return set(client.scan_iter(match=f"{PREFIX}page:*", target_nodes=redis.RedisCluster.PRIMARIES))


@pytest.fixture
def cluster(tmp_path):
    servers = make_cluster(tmp_path / "cluster")
    yield servers
    for s in servers:
        s.stop()


async def test_a_fresh_instance_answers_from_the_cluster_exactly_damage_and_a_dead_master_are_misses(tmp_path, cluster):
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in cluster)
    client = redis.RedisCluster(host="127.0.0.1", port=cluster[0].port)
    docs = [document(i) for i in range(4)]
    full = sum(len(d) // PAGE for d in docs)
    a = await start(tmp_path, "A", url)
    b = None
    try:
        async with aiohttp.ClientSession() as s:
            answers = [(await complete(s, a, d))[0] for d in docs]
            await written(s, a, full)
            b = await start(tmp_path, "B", url)
            await answered_from_remote(s, b, docs, answers)

            # a damaged value: the answer is still exact, and the page is counted, not served
            before = remote_keys(client)
            fifth = document(4)
            expected5 = (await complete(s, a, fifth))[0]
            await written(s, a, full + len(fifth) // PAGE)
            victim = sorted(remote_keys(client) - before)[len(fifth) // PAGE // 2]
            value = bytearray(client.get(victim))
            value[-64] ^= 0xFF
            client.set(victim, bytes(value))
            tokens, cached = await complete(s, b, fifth)
            assert tokens == expected5 and 0 < cached["remote"] < (len(fifth) - 1) // PAGE * PAGE
            r = await remote_stats(s, b)
            assert r["corrupt_pages"] == 1
            async with s.get(b.admin + "/v1/stats") as resp:
                assert (await resp.json())["corrupt_pages"] == 1

            # a master SIGKILLed: answers stay 200 and exact, /healthz 200, one log line
            cluster[1].proc.kill()
            cluster[1].proc.wait()
            more = [document(i, 9 * PAGE + 5) for i in range(10, 14)]
            for d in more:
                expected = (await complete(s, a, d))[0]
                assert (await complete(s, b, d))[0] == expected
            async with s.get(b.admin + "/healthz") as resp:
                assert resp.status == 200
            async with s.get(b.admin + "/readyz") as resp:
                ready = await resp.json()
                assert resp.status == 200 and ready["remote"]["state"] == "down"
    finally:
        assert await stop(a) == 0
        if b is not None:
            assert await stop(b) == 0
    lines = [line for line in b.log.read_text().splitlines() if "remote tier unavailable" in line]
    assert len(lines) == 1, lines
