"""DiskTier's room: the byte limit, LMDB map growth and its cap (also under concurrent readers), and
the totals kept in `meta`. Pages and helpers are test_disk's."""

from __future__ import annotations

import threading

import lmdb
import pytest
import torch

from kvstore.errors import KVStoreError
from kvstore.pages import record
from kvstore.pages.keys import Namespace
from kvstore.pages.spec import KVSpec
from kvstore.tiers.disk import META_DB, DiskTier, read_totals
from test_disk import BIG, BIG_NS, MiB, SPEC, Pages, open_tier, raw_update


def test_byte_limit_refuses_before_writing(tmp_path):
    pages = Pages(6)
    size = pages.record_len(0)
    path = tmp_path / "cold"
    with open_tier(path, max_bytes=4 * size + size // 2) as tier:
        tier.put_many(pages.items(slice(0, 2))).result(timeout=10)
        pending = tier.put_many(pages.items(slice(2, 4)))         # queued bytes count too
        with pytest.raises(KVStoreError, match="max_bytes"):
            tier.put_many(pages.items(slice(4, 5)))
        pending.result(timeout=10)
        with pytest.raises(KVStoreError, match="max_bytes"):
            tier.put_many(pages.items(slice(4, 6)))
        tier.put_many(pages.items(slice(0, 1))).result(timeout=10)  # rewriting a stored page adds nothing
        assert tier.num_pages == 4 and tier.used_bytes == 4 * size and tier.pending_bytes == 0
        tier.delete_many(pages.keys[:1]).result(timeout=10)         # making room is the caller's job
        tier.put_many(pages.items(slice(4, 5))).result(timeout=10)
        assert tier.used_bytes == 4 * size
    with open_tier(path) as tier:
        assert set(tier.sizes()) == set(pages.keys[1:5])


def test_map_grows_from_a_tiny_start(tmp_path):
    pages = Pages(600, seed=1)           # ~5 MiB of records into a 1 MiB map
    with open_tier(tmp_path / "cold", map_size_initial=MiB) as tier:
        assert tier.map_size == MiB
        futures = [tier.put_many(pages.items(slice(i, i + 50))) for i in range(0, 600, 50)]
        for f in futures:
            f.result(timeout=30)
        one = tier.put_many(pages.items(slice(0, 600)))   # one transaction larger than the whole map was
        one.result(timeout=30)
        assert tier.map_size > MiB and tier.map_grows >= 2
        assert tier.num_pages == 600
        for i in (0, 299, 599):
            ok, out = pages.read(tier, i)
            assert ok and torch.equal(out, pages.payloads[i])


def test_small_records_grow_the_map_after_map_full(tmp_path):
    # 2 KiB pages land in one 4 KiB overflow page each: the ahead-of-time estimate is short,
    # so the write meets MapFullError, grows the map and retries the transaction.
    spec = KVSpec(1, 1, 16, "float32", 16)
    pages = Pages(1000, spec=spec, ns=Namespace.for_spec("m", spec))
    with DiskTier(str(tmp_path / "c"), spec, 64 * MiB, 64 * MiB, map_size_initial=MiB) as tier:
        tier.put_many(pages.items()).result(timeout=30)
        assert tier.num_pages == 1000 and tier.map_size >= 4 * MiB


def test_map_cap_gives_a_clear_error(tmp_path):
    pages = Pages(400, seed=2)           # ~3.3 MiB of records, cap 2 MiB
    with open_tier(tmp_path / "cold", max_bytes=64 * MiB, map_size_max=2 * MiB, map_size_initial=MiB) as tier:
        tier.put_many(pages.items(slice(0, 10))).result(timeout=10)
        fut = tier.put_many(pages.items(slice(10, 400)))
        with pytest.raises(KVStoreError, match=r"cold tier map is full at 2097152 bytes \(cold.map_size_max\)"):
            fut.result(timeout=30)
        assert tier.num_pages == 10 and tier.pending_bytes == 0     # nothing of the failed batch
        tier.put_many(pages.items(slice(10, 12))).result(timeout=10)  # the tier still works
        ok, out = pages.read(tier, 11)
        assert ok and torch.equal(out, pages.payloads[11])


def test_one_failing_request_does_not_sink_its_batch(tmp_path):
    pages = Pages(400, seed=4)
    with open_tier(tmp_path / "cold", max_bytes=64 * MiB, map_size_max=2 * MiB, map_size_initial=2 * MiB,
                   write_batch=64) as tier:
        big = tier.put_many(pages.items(slice(0, 390)))       # cannot fit the 2 MiB cap
        small = [tier.put_many(pages.items(slice(i, i + 1))) for i in range(390, 400)]
        with pytest.raises(KVStoreError):
            big.result(timeout=30)
        for f in small:
            assert f.result(timeout=30) is None
        assert set(tier.sizes()) == set(pages.keys[390:400])


def test_concurrent_reads_while_writes_grow_the_map(tmp_path):
    first, more = Pages(64, seed=6), Pages(800, seed=7)
    with open_tier(tmp_path / "cold", map_size_initial=MiB) as tier:
        tier.put_many(first.items()).result(timeout=10)
        errors: list[BaseException] = []
        stop = threading.Event()
        counts = [0] * 4

        def reader(n: int) -> None:
            out = torch.empty(SPEC.page_bytes, dtype=torch.uint8)
            try:
                while not stop.is_set():
                    i = counts[n] % 64
                    ok, _ = first.read(tier, i, out)
                    assert ok, tier.last_error
                    assert torch.equal(out, first.payloads[i])
                    counts[n] += 1
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=reader, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        try:
            futures = [tier.put_many(more.items(slice(i, i + 20))) for i in range(0, 800, 20)]
            for f in futures:
                f.result(timeout=60)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)
        assert not errors, errors[0]
        assert all(c > 0 for c in counts)
        assert tier.map_grows >= 2 and tier.num_pages == 864
        for i in (0, 400, 799):
            ok, out = more.read(tier, i)
            assert ok and torch.equal(out, more.payloads[i])


def raw_totals(path) -> tuple[int, int] | None:
    """The totals in `meta`, read with plain LMDB; None when the store has no `meta`."""
    env = lmdb.open(str(path), max_dbs=3, readonly=True)
    try:
        with env.begin() as txn:
            try:
                meta = env.open_db(META_DB, txn=txn, create=False)
            except lmdb.NotFoundError:
                return None
            return read_totals(txn, meta)
    finally:
        env.close()


def test_totals_are_kept_in_meta_and_read_at_open(tmp_path):
    pages = Pages(10)
    path = tmp_path / "cold"
    with open_tier(path) as tier:
        tier.put_many(pages.items()).result(timeout=10)
        tier.put_many(pages.items(slice(2, 4))).result(timeout=10)         # overwrites add nothing
        tier.delete_many([pages.keys[0], pages.keys[0], b"\1" * 32]).result(timeout=10)
        expected = (sum(pages.record_len(i) for i in range(1, 10)), 9)
        assert (tier.used_bytes, tier.num_pages) == expected
    assert raw_totals(path) == expected
    with open_tier(path) as tier:
        assert tier.counted                                  # read from meta, nothing counted
        assert (tier.used_bytes, tier.num_pages, len(tier)) == (*expected, 9)
        assert tier.sizes() == {pages.keys[i]: pages.record_len(i) for i in range(1, 10)}
        assert pages.keys[1] in tier and pages.keys[0] not in tier


def test_store_without_meta_is_counted_once(tmp_path):
    pages = Pages(8)
    size = pages.record_len(0)
    path = tmp_path / "cold"
    with open_tier(path) as tier:
        tier.put_many(pages.items(slice(0, 6))).result(timeout=10)

    env = lmdb.open(str(path), max_dbs=3, map_size=256 * MiB)   # as a store written before `meta`
    try:
        with env.begin(write=True) as txn:
            txn.drop(env.open_db(META_DB, txn=txn), delete=True)
    finally:
        env.close()
    assert raw_totals(path) is None

    with open_tier(path, max_bytes=7 * size + size // 2) as tier:
        assert (tier.used_bytes, tier.num_pages) == (6 * size, 6)   # waits for the count
        tier.put_many(pages.items(slice(6, 7))).result(timeout=10)
        with pytest.raises(KVStoreError, match="max_bytes"):          # the limit holds after the count
            tier.put_many(pages.items(slice(7, 8)))
    assert raw_totals(path) == (7 * size, 7)
    with open_tier(path) as tier:
        assert tier.counted and tier.used_bytes == 7 * size


def test_records_added_behind_its_back_are_counted_again(tmp_path):
    pages = Pages(5)
    path = tmp_path / "cold"
    with open_tier(path) as tier:
        tier.put_many(pages.items(slice(0, 4))).result(timeout=10)
    raw_update(path, lambda txn, db: txn.put(pages.keys[4], record.encode_bytes(pages.headers[4],
                                                                              pages.payloads[4].numpy())))
    with open_tier(path) as tier:
        assert tier.num_pages == 5 and tier.used_bytes == sum(pages.record_len(i) for i in range(5))
        assert pages.read(tier, 4)[0]


def test_parallel_reads_while_writes_grow_the_map(tmp_path):
    first, more = Pages(32, seed=9, spec=BIG, ns=BIG_NS), Pages(96, seed=10, spec=BIG, ns=BIG_NS)
    with DiskTier(str(tmp_path / "cold"), BIG, 256 * MiB, 512 * MiB, map_size_initial=8 * MiB,
                  read_threads=4) as tier:
        tier.put_many(first.items()).result(timeout=30)
        outs = [torch.empty(BIG.page_bytes, dtype=torch.uint8) for _ in range(32)]
        reqs = [(h.key, BIG_NS.digest, h.tokens, BIG.fingerprint, out) for h, out in zip(first.headers, outs)]
        errors: list[BaseException] = []
        stop = threading.Event()
        rounds = [0]

        def reader() -> None:
            try:
                while not stop.is_set():
                    assert all(tier.read_many(reqs)), tier.last_error
                    rounds[0] += 1
            except BaseException as exc:  # reported below
                errors.append(exc)

        thread = threading.Thread(target=reader)
        thread.start()
        try:
            for i in range(0, 96, 8):
                tier.put_many(more.items(slice(i, i + 8))).result(timeout=60)
        finally:
            stop.set()
            thread.join(timeout=60)
        assert not errors, errors[0]
        assert rounds[0] > 0 and tier.map_grows >= 2 and tier.num_pages == 128
        assert all(torch.equal(o, p) for o, p in zip(outs, first.payloads))
