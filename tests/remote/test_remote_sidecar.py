"""The remote tier behind `kvstore sidecar` (and so the vLLM connector): pages one sidecar's client
put, a fresh sidecar (its own data directory, a single redis-server between them) serves byte-exact."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sidecar"))
from kvstore.sidecar.client import SidecarClient  # noqa: E402
from redisutil import RedisServer  # noqa: E402
from test_sidecar import MODEL, SPEC, SidecarProcess, _stats_until, pages_for, tokens_for  # noqa: E402

PAGES = 5


def test_a_fresh_sidecar_serves_what_another_put_from_the_remote_tier(tmp_path):
    server = RedisServer(tmp_path / "redis")
    remote = {"remote.url": server.url, "remote.key_prefix": "sc:"}
    a = b = None
    try:
        a = SidecarProcess(tmp_path / "a", Path(tempfile.mkdtemp(prefix="kvs-a")), **remote)
        with a.client() as kv:
            assert len(kv.put(tokens_for(1, PAGES), pages_for(1, PAGES))) == PAGES
            st = _stats_until(kv, lambda s: s["tiers"]["remote"]["written_pages"] >= PAGES, timeout=15.0)
            assert st["tiers"]["remote"]["written_pages"] == PAGES
        b = SidecarProcess(tmp_path / "b", Path(tempfile.mkdtemp(prefix="kvs-b")), **remote)
        with b.client() as kv:
            found = kv.lookup(tokens_for(1, PAGES))
            assert found.pages == PAGES
            got = kv.get(tokens_for(1, PAGES))
            assert torch.equal(got, pages_for(1, PAGES))
            st = kv.stats()
            assert st["tiers"]["remote"]["hits"] == PAGES and st["bytes_moved"]["remote_to_warm"] == PAGES * SPEC.page_bytes
        with SidecarClient(b.socket, SPEC, MODEL + "-other") as other:   # another model finds nothing
            assert other.lookup(tokens_for(1, PAGES)).pages == 0
    finally:
        for sc in (a, b):
            if sc is not None:
                assert sc.stop() == 0
        server.stop()


def test_named_pages_come_from_the_remote_tier_too(tmp_path):
    """Pages an engine names itself (SGLang's HiCache page hashes): a fresh sidecar finds them by name."""
    server = RedisServer(tmp_path / "redis")
    remote = {"remote.url": server.url, "remote.key_prefix": "sc:"}
    names = [f"{i:064x}" for i in range(100, 100 + PAGES)]
    pages = pages_for(2, PAGES)
    a = b = None
    try:
        a = SidecarProcess(tmp_path / "a", Path(tempfile.mkdtemp(prefix="kvs-a")), **remote)
        with a.client(layout="engine-pages-v1") as kv:
            slots = kv.alloc(PAGES)
            for slot, page in zip(slots, pages):
                kv.view(slot).copy_(page)
            kv.put_named(names, slots)
            _stats_until(kv, lambda s: s["tiers"]["remote"]["written_pages"] >= PAGES, timeout=15.0)
        b = SidecarProcess(tmp_path / "b", Path(tempfile.mkdtemp(prefix="kvs-b")), **remote)
        with b.client(layout="engine-pages-v1") as kv, b.client(layout="engine-pages-v2") as other:
            assert other.lookup_names(names).pages == 0
            assert kv.lookup_names(names).pages == PAGES
            lease = kv.get_slots(names=names)
            assert all(torch.equal(kv.view(s), pages[i]) for i, s in enumerate(lease.slots))
            kv.release(lease.slots)
            assert kv.stats()["tiers"]["remote"]["hits"] == PAGES
    finally:
        for sc in (a, b):
            if sc is not None:
                assert sc.stop() == 0
        server.stop()
