"""The engine's seam with the store, through the real server: a failing step fails only its own
requests (500, a clear message) and the engine goes on; no cold-tier (LMDB) call ever runs on the
engine thread, while pages move through every tier (cold loads in LOADING, write-behind)."""

from __future__ import annotations

import threading

import aiohttp
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer

from engine import LLM
from app.api.server import create_app, warm_up
from engine.async_llm import AsyncLLM
from engine.config import load_config
from kvstore.pages.keys import page_keys
from kvstore.tiers.disk import DiskTier

pytestmark = pytest.mark.asyncio(loop_scope="module")

DISK_CALLS = ("read", "read_many", "put_many", "delete_many", "flush", "scan", "sizes", "__contains__")


def make_llm(tmp_path, **overrides) -> LLM:
    config = load_config(None, {}, {"data_dir": str(tmp_path), "hot.device": "cpu", "hot.pool": "96KiB",
                                    "warm.bytes": "64KiB", "prefetch.policy": "wait",
                                    "engine.check_invariants": "true", **overrides})
    return LLM("tiny", config=config)


@pytest_asyncio.fixture(loop_scope="module")
async def served(tmp_path):
    llm = make_llm(tmp_path)
    engine = AsyncLLM(llm)
    await engine.start()
    app = create_app(engine)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    await warm_up(engine, app)
    async with aiohttp.ClientSession(base_url=str(server.make_url(""))) as session:
        yield llm, session
    await server.close()
    await engine.stop()
    llm.close()


async def complete(session, prompt, max_tokens=8):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    async with session.post("/v1/completions", json=body) as r:
        return r.status, await r.json()


async def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(served):
    llm, session = served
    status, want = await complete(session, [256, 7, 8, 9, 10])
    assert status == 200
    armed = threading.Event()
    armed.set()

    def fault(batch):
        if armed.is_set():
            armed.clear()
            raise RuntimeError("forced failure (test hook)")

    llm.fault = fault
    try:
        status, body = await complete(session, [256, 7, 8, 9, 10])
    finally:
        llm.fault = None
    assert status == 500
    assert "forced failure (test hook)" in body["error"]["message"] and body["error"]["code"] == "engine_step_failed"
    assert llm.failed_steps == 1
    status, again = await complete(session, [256, 7, 8, 9, 10])
    assert status == 200 and again["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    async with session.get("/health") as r:
        assert r.status == 200
    assert llm.scheduler.check() == []
    assert llm.store.audit()["total_refcount"] == 0


async def test_no_cold_tier_call_runs_on_the_engine_thread(served, monkeypatch):
    llm, session = served
    calls: list[tuple[str, str]] = []
    for name in DISK_CALLS:
        original = getattr(DiskTier, name)

        def recorded(self, *args, _name=name, _original=original, **kwargs):
            calls.append((_name, threading.current_thread().name))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(DiskTier, name, recorded)
    store = llm.store
    docs = [[256] + [(d * 37 + i * 11) % 250 for i in range(95)] for d in range(4)]   # 6 pages each
    first = []
    for doc in docs:
        status, body = await complete(session, doc)
        assert status == 200
        first.append(body["choices"][0]["token_ids"])
    keys = page_keys(store.namespace(), docs[0], 16)
    store.evict(keys, to="cold")       # from this thread: the write runs here, not on the engine's
    assert set(store.match(docs[0], store.namespace()).tiers) == {"cold"}
    for doc, want in zip(docs, first):   # doc 0 loads from cold; the others push pages down as hot fills
        status, body = await complete(session, doc)
        assert status == 200 and body["choices"][0]["token_ids"] == want
        if doc is docs[0]:
            assert body["usage"]["kvstore"]["cached_tokens"]["cold"] == 80, (store.stats()["corrupt_pages"], store.stats()["tiers"]["cold"], store.cold.last_error, store.cold.missing)
    store.daemon.drain()
    threads = {t for _, t in calls}
    assert not [c for c in calls if c[1] == "kvstore-engine"], calls
    assert any(t.startswith("kvstore-read") for t in threads), threads         # the load
    assert {n for n, _ in calls} >= {"read_many", "put_many"}, calls
