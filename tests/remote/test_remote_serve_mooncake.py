"""Two `kvstore serve` instances sharing a cache through a real Mooncake Store (mooncake_master,
TCP), no peers: what A computed, a fresh B (its own data directory) reads from the remote tier,
exactly. A lends the store its memory (Mooncake keeps values in its clients' memory), B none."""

from __future__ import annotations

import aiohttp
import pytest

import mooncakeutil
from test_remote_serve import PAGE, answered_from_remote, complete, document, start, stop, written

needs = (not mooncakeutil.missing(), mooncakeutil.missing())
pytestmark = pytest.mark.usefixtures("requires_part")


async def test_a_fresh_instance_answers_from_a_mooncake_store_exactly(tmp_path):
    master = mooncakeutil.MooncakeMaster(tmp_path / "master")
    docs = [document(i) for i in range(3)]
    a = b = None
    try:
        a = await start(tmp_path, "A", master.url_with("512MiB"))
        async with aiohttp.ClientSession() as s:
            answers = [(await complete(s, a, d))[0] for d in docs]
            await written(s, a, sum(len(d) // PAGE for d in docs))
            b = await start(tmp_path, "B", master.url_with("0"))
            remote = await answered_from_remote(s, b, docs, answers)
            async with s.get(b.admin + "/metrics") as resp:
                text = await resp.text()
            assert "kvstore_remote_up 1.0" in text
            hits = next(line for line in text.splitlines() if line.startswith("kvstore_remote_hits_total"))
            assert float(hits.split()[-1]) * PAGE >= remote
    finally:
        for inst in (b, a):
            if inst is not None:
                assert await stop(inst) == 0
        master.stop()
