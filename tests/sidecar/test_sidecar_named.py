"""The sidecar's named pages (an engine's own page names, as SGLang's HiCache gives them), `clear`, and
`sidecar.tp_size` (one tensor-parallel rank's pages), against a real `kvstore sidecar` process."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import REPO, clean_env
from kvstore.pages.spec import KVSpec
from kvstore.sidecar.client import SidecarClient, SidecarError
from test_sidecar import (HELLO, MODEL, PS, SPEC, pages_for, raw_connect, recv, send, sock_dir, spawn,  # noqa: F401
                          tokens_for)


def test_named_pages(spawn):
    """Pages an engine names itself (SGLang's page hashes): put by name, looked up and leased by name,
    kept across a restart, never seen by another model or layout."""
    names = [f"{i:064x}" for i in range(1, 6)]
    pages = pages_for(70, 5)
    sc = spawn()
    with sc.client(layout="engine-pages-v1") as kv, sc.client(layout="engine-pages-v2") as other:
        assert kv.lookup_names(names).pages == 0
        slots = kv.alloc(3)
        for slot, page in zip(slots, pages[:3]):
            kv.view(slot).copy_(page)
        keys = kv.put_named(names[:3], slots)
        with pytest.raises(SidecarError, match="2 names for 1 pages"):
            kv.put_named(names[3:], kv.alloc(1))
        hit = kv.lookup_names(names)
        assert hit.pages == 3 and hit.keys == keys and hit.tiers == ["warm"] * 3
        assert kv.lookup_names(names[1:]).pages == 2   # each name stands alone: no parent needed
        lease = kv.get_slots(names=names)
        assert lease.keys == keys and all(torch.equal(kv.view(s), pages[i]) for i, s in enumerate(lease.slots))
        kv.release(lease.slots)
        assert other.lookup_names(names).pages == 0 and other.get_slots(names=names).slots == []
        assert kv.lookup(list(range(3 * PS))).pages == 0
    assert sc.stop() == 0
    sc = spawn()
    with sc.client(layout="engine-pages-v1") as kv:
        assert kv.lookup_names(names).tiers == ["cold"] * 3
        lease = kv.get_slots(names=names[:3])
        assert all(torch.equal(kv.view(s), pages[i]) for i, s in enumerate(lease.slots))
        kv.release(lease.slots)
    with sc.client(layout="engine-pages-v1", use_shm=False) as kv:   # the bytes fallback takes names too
        s = raw_connect(sc.socket)
        try:
            send(s, {**HELLO, "layout": "engine-pages-v1"})
            assert recv(s)["ok"]
            send(s, {"op": "put", "id": 4, "names": names[3:], "pages": [p.numpy().tobytes() for p in pages[3:]]})
            assert recv(s)["ok"]
            send(s, {"op": "put", "id": 5, "names": [""], "pages": [pages[0].numpy().tobytes()]})
            reply = recv(s)
            assert not reply["ok"] and "names" in reply["error"]
        finally:
            s.close()
        assert kv.lookup_names(names).pages == 5
    with sc.client(layout="engine-pages-v1") as kv, sc.client(layout="engine-pages-v2") as other:
        kept = other.alloc(1)
        other.view(kept[0]).copy_(pages[0])
        other.put_named(names[:1], kept)
        lease = kv.get_slots(names=names[:1])
        assert kv.clear() == {"pages": 4, "kept": 1}      # the leased page stays
        kv.release(lease.slots)
        assert kv.clear() == {"pages": 1, "kept": 0}
        assert kv.lookup_names(names).pages == 0 and other.lookup_names(names).pages == 1   # only its namespace
    assert sc.stop() == 0
    sc = spawn()
    with sc.client(layout="engine-pages-v1") as kv:
        assert kv.lookup_names(names).pages == 0          # gone from cold too
    assert sc.stop() == 0


def test_tp_size_makes_the_pages_one_ranks_shard(spawn, tmp_path):
    sc = spawn(**{"sidecar.tp_size": 2})
    rank = KVSpec(SPEC.num_layers, SPEC.num_kv_heads // 2, SPEC.head_dim, SPEC.dtype, SPEC.page_size)
    with SidecarClient(sc.socket, rank, MODEL) as kv:
        assert kv.info["page_bytes"] == rank.page_bytes
        kv.put(tokens_for(80, 2), torch.randn((2, *rank.page_shape)))
        assert kv.lookup(tokens_for(80, 2)).pages == 2
    with pytest.raises(SidecarError, match=r"num_kv_heads 2 \(sidecar: 1\)"):
        sc.client()
    assert sc.stop() == 0
    done = subprocess.run([sys.executable, "-m", "kvstore", "sidecar", "--data-dir", str(tmp_path / "bad"),
                           "--set", "model=tiny", "--set", "sidecar.tp_size=3"], capture_output=True, text=True,
                          env=clean_env(), cwd=REPO, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "sidecar.tp_size" in done.stderr and "must divide the model's 2 KV heads" in done.stderr
