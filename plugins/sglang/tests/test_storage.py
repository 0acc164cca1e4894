"""KVStoreStorage under SGLang's own HiCacheController (sglang pinned by scripts/bootstrap_sglang), on
the CPU, against a real `kvstore sidecar`: backups that another engine prefetches byte-exactly, on
every host layout; namespaces; a restart; a sidecar hung or killed mid-prefetch; a damaged page."""

from __future__ import annotations

import os
import signal
import threading
import time

import lmdb
import pytest
import torch

from kvstore_sglang.storage import KVStoreStorage
from kvstore_sglang.testing import GEOMETRY, MLA_GEOMETRY, Controller, Sidecar, kvstore_extra_config

PS = GEOMETRY["page_size"]


def doc(n: int, pages: int) -> list[int]:
    return [(n * 7919 + i * 31) % 30000 for i in range(pages * PS)]


def rank_storage(sidecar, c: Controller, mla: bool, model: str) -> KVStoreStorage:
    """The backend as rank 1 of a TP-2 split would build it, over controller c's host pool."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    config = HiCacheStorageConfig(tp_rank=1, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=False,
                                  model_name=model, extra_config=kvstore_extra_config(sidecar.socket))
    storage = KVStoreStorage(config, {})
    storage.register_mem_pool_host(c.host)
    return storage


def make(controllers, sidecar, layout="layer_first", **kw) -> Controller:
    extra = kw.pop("extra", {})
    c = Controller("dynamic", kvstore_extra_config(sidecar.socket, **extra), layout=layout, **kw)
    controllers.append(c)
    return c


@pytest.mark.parametrize("writer,reader", [("layer_first", "page_first"), ("page_first", "page_first_direct"),
                                           ("page_first_direct", "layer_first")])
def test_backup_then_another_controller_prefetches_byte_exactly(sidecar, controllers, writer, reader):
    a = make(controllers, sidecar, writer)
    tokens = doc(1, 40)
    a.fill(tokens, seed=1)
    assert a.backup(tokens) == len(tokens)
    b = make(controllers, sidecar, reader)
    assert b.prefetch(tokens) == len(tokens)
    assert torch.equal(b.pages(tokens), a.pages(tokens))
    # a longer request: the stored prefix arrives, the rest is a miss
    longer = tokens + doc(2, 3)
    assert b.prefetch(longer) == len(tokens)
    assert a.threads_alive() and b.threads_alive()


def test_legacy_interface_and_v1_share_pages(sidecar, controllers):
    legacy = make(controllers, sidecar, "page_first", extra={"interface_v1": 0})
    assert legacy.ctl.page_set_func == legacy.ctl._generic_page_set
    tokens = doc(3, 12)
    legacy.fill(tokens, seed=3)
    assert legacy.backup(tokens) == len(tokens)
    v1 = make(controllers, sidecar, "layer_first")
    assert v1.prefetch(tokens) == len(tokens)
    assert torch.equal(v1.pages(tokens), legacy.pages(tokens))
    again = make(controllers, sidecar, "page_first", extra={"interface_v1": 0})
    assert again.prefetch(tokens) == len(tokens)
    assert torch.equal(again.pages(tokens), legacy.pages(tokens))


def test_other_models_and_ranks_find_nothing(sidecar, controllers):
    a = make(controllers, sidecar, model="model-a")
    tokens = doc(4, 8)
    a.fill(tokens, seed=4)
    assert a.backup(tokens) == len(tokens)
    assert make(controllers, sidecar, model="model-b").prefetch(tokens) == 0
    assert make(controllers, sidecar, model="model-a", extra={"tenant": "other"}).prefetch(tokens) == 0
    # the same model on rank 1 of a TP-2 split
    rank1 = rank_storage(sidecar, a, mla=False, model="model-a")
    try:
        assert rank1.batch_exists(a.hashes(tokens)) == 0
        assert a.storage.batch_exists(a.hashes(tokens)) == 8
    finally:
        rank1.close()


def test_storage_metrics(sidecar, controllers):
    a = make(controllers, sidecar)
    assert a.storage.get_stats() is None                 # metrics off: SGLang reports its own counts
    a = make(controllers, sidecar, metrics=True)
    tokens = doc(13, 6)
    a.fill(tokens, seed=13)
    assert a.backup(tokens) == len(tokens)
    assert make(controllers, sidecar).prefetch(tokens) == len(tokens)
    b = make(controllers, sidecar, "page_first", metrics=True)
    assert b.prefetch(tokens) == len(tokens)
    got, again = a.storage.get_stats(), b.storage.get_stats()
    assert got.backup_pgs == [6] and got.backup_bandwidth[0] > 0 and got.prefetch_pgs == []
    assert again.prefetch_pgs == [6] and again.prefetch_bandwidth[0] > 0
    assert b.storage.get_stats().prefetch_pgs == []      # since the last call


def test_clear_removes_this_ranks_pages_only(sidecar, controllers):
    a, b = make(controllers, sidecar, model="model-a"), make(controllers, sidecar, model="model-b")
    tokens = doc(12, 6)
    for c in (a, b):
        c.fill(tokens, seed=12)
        assert c.backup(tokens) == len(tokens)
    assert a.storage.clear() is True
    assert make(controllers, sidecar, model="model-a").prefetch(tokens) == 0
    assert make(controllers, sidecar, model="model-b").prefetch(tokens) == len(tokens)


def test_after_a_sidecar_restart_the_prefetch_hits_from_cold(sidecar, controllers):
    a = make(controllers, sidecar)
    tokens = doc(5, 24)
    a.fill(tokens, seed=5)
    assert a.backup(tokens) == len(tokens)
    assert sidecar.stop() == 0
    sidecar.start()
    b = make(controllers, sidecar, "page_first_direct")
    assert b.prefetch(tokens) == len(tokens)
    assert torch.equal(b.pages(tokens), a.pages(tokens))
    # the same controller, whose connections died with the old sidecar, reconnects
    time.sleep(1.2)
    assert a.prefetch(tokens) == len(tokens)


def test_sidecar_hung_or_killed_mid_prefetch_gives_misses_in_bounded_time(sidecar, controllers):
    extra = {"timeout_s": 2, "retry_s": 0.5}
    a = make(controllers, sidecar, extra=extra)
    tokens = doc(6, 32)
    a.fill(tokens, seed=6)
    assert a.backup(tokens) == len(tokens)
    b = make(controllers, sidecar, "page_first", extra=extra)

    # killed between the hit query and the read of the pages
    real = b.storage.batch_get_v1

    def killed_first(*args, **kw):
        sidecar.kill()
        return real(*args, **kw)
    b.storage.batch_get_v1 = killed_first
    started = time.monotonic()
    assert b.prefetch(tokens, timeout=30) == 0
    assert time.monotonic() - started < 10
    b.storage.batch_get_v1 = real
    started = time.monotonic()
    assert b.prefetch(tokens, timeout=30) == 0      # down: a miss at once
    assert time.monotonic() - started < 5
    assert b.threads_alive()

    # hung (SIGSTOP): every request ends at timeout_s
    sidecar.start()
    time.sleep(0.6)
    assert b.prefetch(tokens, timeout=30) == len(tokens)   # the backed-up pages survived the kill (cold)
    os.kill(sidecar.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        c = doc(7, 4)
        b.fill(c, seed=7)
        assert b.backup(c, timeout=30) == 0
        assert b.prefetch(tokens, timeout=30) == 0
        assert time.monotonic() - started < 15
        assert b.threads_alive()
    finally:
        os.kill(sidecar.proc.pid, signal.SIGCONT)
    time.sleep(0.6)
    assert b.prefetch(tokens, timeout=30) == len(tokens)
    assert torch.equal(b.pages(tokens), a.pages(tokens))


def test_a_damaged_cold_page_is_a_miss(sidecar, controllers):
    a = make(controllers, sidecar)
    tokens = doc(8, 10)
    a.fill(tokens, seed=8)
    assert a.backup(tokens) == len(tokens)
    key = a.storage.conns.client().lookup_names(a.hashes(tokens)).keys[4]
    assert sidecar.stop() == 0
    env = lmdb.open(str(sidecar.data_dir / "cold"), max_dbs=4, map_size=1 << 30)
    try:
        with env.begin(write=True, db=env.open_db(b"pages")) as txn:
            value = bytearray(txn.get(key))
            value[-100] ^= 0x40       # one payload byte
            txn.put(key, bytes(value))
    finally:
        env.close()
    sidecar.start()
    b = make(controllers, sidecar, "page_first")
    assert b.prefetch(tokens) == 4 * PS            # the pages before the damaged one, exact
    assert torch.equal(b.pages(tokens[:4 * PS]), a.pages(tokens, 4))
    assert b.storage.conns.client().stats()["corrupt_pages"] == 1
    assert b.prefetch(tokens) == 4 * PS            # and stays a miss (the damaged record is set aside)


def test_bad_settings_are_one_line_errors(sidecar, controllers, workdir):
    with pytest.raises(ValueError, match='needs "socket"'):
        Controller("dynamic", {k: v for k, v in kvstore_extra_config("").items() if k != "socket"})
    with pytest.raises(ValueError, match="unknown extra_config key.*sokcet"):
        Controller("dynamic", {**kvstore_extra_config(sidecar.socket), "sokcet": "x"})
    with pytest.raises(ValueError, match="timeout_s"):
        Controller("dynamic", kvstore_extra_config(sidecar.socket, timeout_s="5"))
    with pytest.raises(ValueError, match=r"spec differs.*this rank's pages are 4 layers, 2 KV heads of 32"):
        Controller("dynamic", kvstore_extra_config(sidecar.socket), head_dim=32)
    # no sidecar yet at launch: misses, and pages once it is there
    late = make(controllers, sidecar, extra={"retry_s": 0.2})
    late.storage.conns.close()
    sidecar.kill()
    tokens = doc(9, 4)
    late.fill(tokens)
    assert late.backup(tokens) == 0
    assert late.threads_alive()


def test_mla_pages_are_shared_by_the_tp_ranks_and_written_by_one(workdir, controllers):
    sc = Sidecar(workdir / "mla", workdir / "mla.sock", geometry=MLA_GEOMETRY)
    try:
        a = Controller("dynamic", kvstore_extra_config(sc.socket), layout="layer_first", mla=True)
        controllers.append(a)
        assert a.storage.pages.mla and a.storage.config.is_mla_model
        tokens = doc(10, 12)
        a.fill(tokens, seed=10)
        assert a.backup(tokens) == len(tokens)
        for layout, extra in (("page_first", {}), ("page_first_direct", {}), ("page_first", {"interface_v1": 0})):
            b = Controller("dynamic", kvstore_extra_config(sc.socket, **extra), layout=layout, mla=True)
            controllers.append(b)
            assert b.prefetch(tokens) == len(tokens), (layout, extra)
            assert torch.equal(b.pages(tokens), a.pages(tokens)), (layout, extra)
        # rank 1 of a TP-2 split reads rank 0's pages (MLA KV is the same on every rank) and writes none
        rank1 = rank_storage(sc, a, mla=True, model="tiny-sglang")
        try:
            assert rank1.batch_exists(a.hashes(tokens)) == 12
            other = doc(11, 2)
            idx = a.fill(other, seed=11)
            assert rank1.batch_set_v1(a.hashes(other), idx) == [True, True]
            assert rank1.batch_exists(a.hashes(other)) == 0
        finally:
            rank1.close()
    finally:
        sc.kill()
