"""Two `kvstore serve` processes sharing prefixes through a real redis-server on loopback."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from redisutil import RedisServer

REPO = str(Path(__file__).resolve().parents[2])
READY = re.compile(r"kvstore serve: \S+ ready on (http://[\d.:]+) .*admin API on (http://[\d.:]+)\n")
DOC = list(range(300, 300 + 150))    # token ids of a shared document (tiny preset: byte tokenizer ids)


class Instance:
    def __init__(self, proc, api, admin):
        self.proc, self.api, self.admin = proc, api, admin


async def start_instance(tmp_path: Path, name: str, redis_url: str, *extra: str) -> Instance:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "app", "serve", "--model", "tiny", "--port", "0", "--admin-port", "0",
        "--data-dir", str(tmp_path / name), "--redis-url", redis_url,
        "--set", f"cluster.instance_id={name}", "--set", "cluster.token=shared-secret",
        "--set", "cluster.fetch_policy=always", "--set", "cluster.heartbeat_s=0.3", "--set", "cluster.ttl_s=1.5",
        "--set", "kv_dtype=float32", "--set", "engine.dtype=float32",
        "--set", "server.trust_tenant_header=true", *extra,       # the requests name their tenants
        cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
    m = READY.fullmatch(line)
    if not m:
        proc.kill()
        raise AssertionError((line, (await proc.stderr.read()).decode()[-3000:]))
    return Instance(proc, m.group(1), m.group(2))


async def stop(inst: Instance, sig=signal.SIGTERM) -> int:
    if inst.proc.returncode is None:
        inst.proc.send_signal(sig)
    return await asyncio.wait_for(inst.proc.wait(), 30)


async def complete(session, inst, tokens, tenant="", max_tokens=8):
    body = {"model": "tiny", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}
    async with session.post(inst.api + "/v1/completions", json=body, headers={"X-Tenant": tenant}) as r:
        data = await r.json()
        assert r.status == 200, data
        return data["choices"][0]["token_ids"], data["usage"]["kvstore"]


async def lookup(session, inst, tokens, tenant=""):
    async with session.post(inst.admin + "/v1/lookup", json={"tokens": tokens, "tenant": tenant}) as r:
        assert r.status == 200
        return (await r.json())["peers"]


async def eventually(check, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        if await check():
            return True
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.1)


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis")
    yield server
    server.stop()


async def test_peer_hit_is_exact_and_prefills_only_the_suffix(tmp_path, redis_server):
    a = await start_instance(tmp_path, "A", redis_server.url)
    b = await start_instance(tmp_path, "B", redis_server.url)
    try:
        async with aiohttp.ClientSession() as s:
            question = DOC + [10, 11, 12, 13, 14]
            tokens_a, _ = await complete(s, a, question)
            assert await eventually(lambda: _names(s, b, question, "A"))
            tokens_b, usage = await complete(s, b, question)
            assert tokens_b == tokens_a
            cached = (len(question) - 1) // 16 * 16
            assert usage["cached_tokens"]["peer"] == cached
            assert usage["prefill_tokens"] == len(question) - cached
            async with s.get(b.admin + "/v1/peers") as r:
                peers = await r.json()
            assert peers["state"] == "connected" and {p["instance"] for p in peers["peers"]} >= {"A"}
            # another tenant finds nothing anywhere
            assert await lookup(s, b, question, tenant="other") == []
            _, usage = await complete(s, b, question, tenant="other")
            assert usage["cached_tokens"]["peer"] == 0
            # operators: list the peers, and remove one instance's entries
            out = await inspect(b, "peers")
            assert "cluster index: connected, this instance B" in out and "A" in out
            out = await inspect(b, "forget", "A")
            assert re.match(r"removed [1-9]\d* index entries of A", out)
            assert not await _names(s, b, question, "A")
    finally:
        assert await stop(a) == 0
        assert await stop(b) == 0


async def inspect(inst: Instance, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PYTHONPATH"] = REPO
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "app", "inspect", "--url", inst.admin,
                                                *args, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def _names(session, inst, tokens, name, tenant=""):
    return any(p["instance"] == name for p in await lookup(session, inst, tokens, tenant))


async def test_killed_instance_leaves_lookups_within_its_ttl(tmp_path, redis_server):
    a = await start_instance(tmp_path, "A", redis_server.url)
    b = await start_instance(tmp_path, "B", redis_server.url)
    try:
        async with aiohttp.ClientSession() as s:
            await complete(s, a, DOC)
            assert await eventually(lambda: _names(s, b, DOC, "A"))
            a.proc.kill()
            await a.proc.wait()
            t0 = asyncio.get_running_loop().time()
            assert await eventually(lambda: _gone(s, b, DOC, "A"), timeout=5)
            assert asyncio.get_running_loop().time() - t0 <= 1.5 + 0.5   # ttl_s, plus polling
            tokens, usage = await complete(s, b, DOC)                      # no request fails
            assert usage["cached_tokens"]["peer"] == 0 and tokens
    finally:
        await stop(b)


async def _gone(session, inst, tokens, name):
    return not await _names(session, inst, tokens, name)


async def test_redis_outage_fails_no_request_and_recovers(tmp_path, redis_server):
    a = await start_instance(tmp_path, "A", redis_server.url)
    b = await start_instance(tmp_path, "B", redis_server.url)
    try:
        async with aiohttp.ClientSession() as s:
            await complete(s, a, DOC)
            assert await eventually(lambda: _names(s, b, DOC, "A"))
            load = [complete(s, b, DOC[:40 + i] + [i]) for i in range(10)]
            redis_server.stop()
            results = await asyncio.gather(*load, *[complete(s, a, DOC[:60 + i]) for i in range(10)])
            assert len(results) == 20                                    # every request succeeded
            async with s.get(b.admin + "/v1/peers") as r:
                assert (await r.json())["state"] == "disconnected"
            async with s.get(b.admin + "/readyz") as r:
                assert r.status == 200 and (await r.json())["cluster"] == "disconnected"
            async with s.get(b.admin + "/metrics") as r:
                assert "kvstore_cluster_connected 0.0" in await r.text()
            redis_server.start()
            assert await eventually(lambda: _names(s, b, DOC, "A"), timeout=20)
    finally:
        await stop(a)
        await stop(b)


async def test_wrong_redis_password_is_a_clear_error(tmp_path):
    server = RedisServer(tmp_path / "pw", password="s3cret")
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        env["PYTHONPATH"] = REPO
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "app", "serve", "--port", "0", "--admin-port", "0",
            "--data-dir", str(tmp_path / "d"), "--redis-url", f"redis://127.0.0.1:{server.port}/0",
            cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 2
        assert "requires a password" in err.decode().strip().splitlines()[-1]
        assert "Traceback" not in err.decode()
    finally:
        server.stop()
