"""A request whose client disconnects is aborted and its pages released, streamed or not, on a
server run as `kvstore serve` runs it (app.api.server.api_runner and a TCPSite; aiohttp's default AppRunner
does not cancel a handler whose client left, aiohttp's test server does)."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from engine import AsyncLLM
from app.api.server import api_runner, create_app
from test_api import make_llm

MAX_TOKENS = 3900           # minutes of generation on the tiny preset if nobody stops it
GONE_WITHIN_S = 3.0


async def eventually(check, timeout: float) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


@pytest.fixture
async def served(tmp_path):
    llm = make_llm(tmp_path)
    finished = []
    engine = AsyncLLM(llm, on_finish=finished.append)
    await engine.start()
    runner = api_runner(create_app(engine))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield llm, runner.addresses[0][1], finished
    finally:
        await runner.cleanup()
        await engine.stop()
        llm.close()


def held_pages(llm) -> int:
    """Hot pages held by requests: allocated and not yet committed, or committed and referenced."""
    hot = llm.store.stats()["tiers"]["hot"]
    return hot["allocated_pages"] + hot["referenced_pages"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_request_is_aborted_when_its_client_disconnects(served, stream):
    llm, port, finished = served
    body = json.dumps({"prompt": "a long answer, please " * 4, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                       "temperature": 0, "stream": stream}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    # it runs and holds pages, more as it generates
    assert await eventually(lambda: llm.stats()["running"] == 1 and held_pages(llm) > 8, 60), \
        (llm.stats(), held_pages(llm))
    writer.close()
    await writer.wait_closed()
    assert await eventually(lambda: llm.stats()["running"] == 0 and held_pages(llm) == 0, GONE_WITHIN_S), \
        f"{GONE_WITHIN_S} s after the client left: {llm.stats()}, {held_pages(llm)} hot pages held"
    [out] = finished
    assert out.finish_reason == "abort" and len(out.token_ids) < MAX_TOKENS, (out.finish_reason, len(out.token_ids))
    assert llm.stats()["waiting"] == 0 and llm.store.audit(cold=False)["problems"] == []
