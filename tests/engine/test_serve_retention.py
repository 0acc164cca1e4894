"""What `kvstore serve` computes under pressure, it keeps: 1 MiB hot and warm tiers (two of the 24
prompts at a time), four concurrent clients send 24 different 1,024-token prompts, then each
again. Round 2 must find at least 98% of the prompts' full pages cached (the disk had room for
all of them), every answer must equal the prompt's answer with nothing cached, and no page may
have been dropped."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from engine import LLM, SamplingParams
from engine.config import load_config
from test_serve_pressure import THREADS, start_serve, stop_serve

PROMPTS, TOKENS, CLIENTS, MAX_TOKENS = 24, 1024, 4, 8
SETTINGS = {"hot.pool": "1MiB", "warm.bytes": "1MiB", "hot.device": "cpu"}
FULL_PAGES = (TOKENS - 1) // 16   # the last token is always computed: 63 full pages a prompt

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def prompts() -> list[list[int]]:
    rng = random.Random(19)
    return [[rng.randrange(512) for _ in range(TOKENS)] for _ in range(PROMPTS)]


async def round_of(session: aiohttp.ClientSession, url: str, ids: list[list[int]]) -> dict[int, tuple[list, int]]:
    """Every prompt once, CLIENTS at a time: prompt -> (answer token ids, cached prompt tokens)."""
    todo, out = list(range(len(ids))), {}

    async def client():
        while todo:
            i = todo.pop(0)
            body = {"model": "tiny", "prompt": ids[i], "max_tokens": MAX_TOKENS, "temperature": 0,
                    "return_token_ids": True}
            async with session.post(url + "/v1/completions", json=body) as r:
                got = await r.json()
                assert r.status == 200, got
                out[i] = (got["choices"][0]["token_ids"], got["usage"]["prompt_tokens_details"]["cached_tokens"])
    await asyncio.gather(*(client() for _ in range(CLIENTS)))
    return out


async def two_rounds(server, ids) -> tuple[dict, dict, dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        first = await round_of(session, server.url, ids)
        second = await round_of(session, server.url, ids)
        async with session.get(server.admin + "/v1/stats") as r:
            return first, second, await r.json()


def reference(tmp, ids) -> list[list[int]]:
    """Each prompt's greedy answer with nothing cached: one at a time, each in a tenant of its own."""
    import torch
    config = load_config(None, {}, {"data_dir": str(tmp / "ref"), "hot.device": "cpu", "hot.pool": "16MiB",
                                    "warm.bytes": "0", "cold.enabled": "false"})
    llm = LLM("tiny", config=config)
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        return [llm.generate([p], params, tenant=f"ref-{i}")[0].token_ids for i, p in enumerate(ids)]
    finally:
        torch.set_num_threads(threads)
        llm.close()


def test_round_two_finds_what_round_one_computed(tmp_path):
    ids = prompts()
    server = start_serve(tmp_path, SETTINGS)
    try:
        first, second, stats = asyncio.run(two_rounds(server, ids))
    finally:
        stop_serve(server)
    want = reference(tmp_path, ids)
    wrong = [i for i in range(PROMPTS) if first[i][0] != want[i] or second[i][0] != want[i]]
    assert not wrong, f"answers differ from the uncached ones for prompts {wrong}"
    found = sum(cached for _, cached in second.values()) / (PROMPTS * FULL_PAGES * 16)
    summary = (f"round 2 found {found:.1%} of the full pages; per prompt {sorted(c for _, c in second.values())}; "
               f"dropped {stats['dropped_by_reason']}; write-behind {stats['write_behind']}; log:\n{server.log_tail()}")
    assert found >= 0.98, summary
    assert stats["dropped_pages"] == 0, summary
    assert stats["engine"]["preemptions"] + stats["tiers"]["hot"]["evictions"] > 0, "no pressure: " + summary
