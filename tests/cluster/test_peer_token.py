"""cluster.token, with two `kvstore serve` processes and a real redis-server: an instance without
it says so once at start-up and in /readyz, serves no pages to peers (403) and fetches none; a
peer's refusal is logged with its reason; a non-UTF-8 Authorization header is refused, not a 500."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import aiohttp

from kvstore.cluster.peer import NO_TOKEN
from test_cluster_e2e import DOC, _names, complete, eventually, redis_server, start_instance, stop  # noqa: F401


async def get_json(session, url: str) -> tuple[int, dict]:
    async with session.get(url) as r:
        return r.status, await r.json()


async def raw_status(url: str, authorization: bytes) -> int:
    """POST /v1/peer/pages with these exact header bytes; the answer's status."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    reader, writer = await asyncio.open_connection(host, port)
    body = b'{"namespace": "' + b"00" * 32 + b'", "keys": ["' + b"00" * 32 + b'"]}'
    writer.write(b"POST /v1/peer/pages HTTP/1.1\r\nHost: %s\r\nAuthorization: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (host.encode(), authorization, len(body)) + body)
    await writer.drain()
    status_line = await reader.readline()
    writer.close()
    await writer.wait_closed()
    return int(status_line.split()[1])


async def test_instance_without_cluster_token(tmp_path, redis_server):
    a = await start_instance(tmp_path, "A", redis_server.url, "--set", "cluster.token=")     # no token
    b = await start_instance(tmp_path, "B", redis_server.url)                               # the shared token
    try:
        async with aiohttp.ClientSession() as s:
            status, ready = await get_json(s, a.admin + "/readyz")
            assert status == 200 and ready["cluster"] == "connected", ready
            assert ready["peers"] == {"serving": False, "fetching": False, "reason": NO_TOKEN}
            _, ready = await get_json(s, b.admin + "/readyz")
            assert ready["peers"] == {"serving": True, "fetching": True, "reason": None}

            # B asks for a prefix only A holds: A refuses (403), B computes it and logs why
            tokens_a, _ = await complete(s, a, DOC)
            assert await eventually(lambda: _names(s, b, DOC, "A"))
            failed = (await get_json(s, b.admin + "/v1/stats"))[1]["cluster"]["fetch"]["failed"]
            tokens_b, usage = await complete(s, b, DOC)
            assert tokens_b == tokens_a and usage["cached_tokens"]["peer"] == 0
            _, stats = await get_json(s, b.admin + "/v1/stats")
            assert stats["cluster"]["fetch"]["failed"] == failed + 1, stats["cluster"]
            # A, with no token that any peer would take, does not try
            other = list(range(100, 180))
            await complete(s, b, other)
            assert await eventually(lambda: _names(s, a, other, "B"))
            _, usage = await complete(s, a, other)
            assert usage["cached_tokens"]["peer"] == 0
            _, stats = await get_json(s, a.admin + "/v1/stats")
            assert stats["cluster"]["fetch"]["failed"] == 0, stats["cluster"]

            # a non-UTF-8 Authorization header: refused, as any wrong token
            assert await raw_status(b.admin, b"Bearer shared-secret\xff") == 401
            assert await raw_status(b.admin, b"\xc3\x28") == 401
            assert await raw_status(a.admin, b"Bearer \xff") == 403
    finally:
        assert await stop(a) == 0
        assert await stop(b) == 0
    err_a, err_b = (await a.proc.stderr.read()).decode(), (await b.proc.stderr.read()).decode()
    assert err_a.count(NO_TOKEN) == 1 and NO_TOKEN not in err_b, err_a[-2000:]
    assert "peer fetch from A failed: peer answered 403: peer fetch is disabled: set cluster.token" in err_b, \
        err_b[-2000:]
    assert "Traceback" not in err_a + err_b
