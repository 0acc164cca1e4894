"""DiskTier (cold tier) against a real LMDB in a temp dir: reads and writes, durability, damage, scans,
parallel reads. Its room (byte limit, map growth, totals in `meta`) is in test_disk_space; its file and
the OS (early writeback, the page cache dropped) in test_disk_os."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch

from kvstore.errors import KVStoreError
from kvstore.pages import native_copy, record
from kvstore.pages.keys import Namespace, page_keys, tokens_bytes
from kvstore.pages.record import RecordHeader
from kvstore.pages.spec import KVSpec
from kvstore.tiers import lmdb_reader
from kvstore.tiers.disk import PAGES_DB, DiskTier
from conftest import one_pass_levels, requires

REPO = Path(__file__).resolve().parents[2]
SPEC = KVSpec(2, 2, 16, "float32", 16)  # 8 KiB pages
NS = Namespace.for_spec("test-model", SPEC)
MiB = 1 << 20


class Pages:
    """A chain of n pages of one sequence: headers and seeded payloads."""

    def __init__(self, n: int, seed: int = 0, spec: KVSpec = SPEC, ns: Namespace = NS):
        rng = np.random.default_rng(seed)
        tokens = rng.integers(0, 32000, n * spec.page_size).tolist()
        self.keys = page_keys(ns, tokens, spec.page_size)
        self.headers, parent = [], ns.digest
        for i, key in enumerate(self.keys):
            toks = tokens_bytes(tokens[i * spec.page_size:(i + 1) * spec.page_size])
            self.headers.append(RecordHeader(key, parent, ns.digest, toks, spec.fingerprint, spec.page_bytes))
            parent = key
        self.payloads = [torch.from_numpy(rng.integers(0, 256, spec.page_bytes, dtype=np.uint8))
                         for _ in range(n)]
        self.spec, self.ns = spec, ns

    def items(self, sl: slice = slice(None)):
        return list(zip(self.headers[sl], self.payloads[sl]))

    def record_len(self, i: int) -> int:
        return len(record.encode_bytes(self.headers[i], self.payloads[i].numpy()))

    def read(self, tier: DiskTier, i: int, out: torch.Tensor | None = None) -> tuple[bool, torch.Tensor]:
        out = torch.zeros(self.spec.page_bytes, dtype=torch.uint8) if out is None else out
        h = self.headers[i]
        return tier.read(h.key, self.ns.digest, h.tokens, self.spec.fingerprint, out), out


@pytest.fixture(params=[*(native_copy.ONE_PASS[level] for level in one_pass_levels()), "native", "python"])
def copier(request, monkeypatch):
    """Each read test in every way this machine reads a record: in one pass by the native copy
    (copy_hash.cpp) with each instruction set the CPU has of AVX-512 and AVX2, pages copied in chunks
    by the native batch copy (with pread from data.mdb), and by Python one page at a time, as where
    the native copy cannot be had."""
    if request.param == "python":
        monkeypatch.setattr(native_copy, "_copier", None)
        return request.param
    requires(native_copy.copier() is not None, f"the native checksummed copy: {native_copy.why_not}")
    level = {name: level for level, name in native_copy.ONE_PASS.items()}.get(request.param, 0)
    assert native_copy.copier().one_pass >= level, f"the native copy does not run {request.param}, which this CPU has"
    monkeypatch.setattr(native_copy.copier(), "one_pass", level)
    return request.param


def open_tier(path, max_bytes=64 * MiB, map_size_max=256 * MiB, **kw) -> DiskTier:
    return DiskTier(str(path), SPEC, max_bytes=max_bytes, map_size_max=map_size_max, **kw)


def raw_update(path, fn) -> None:
    """Run fn(txn, pages_db) in a raw LMDB write transaction (the tier must be closed)."""
    env = lmdb.open(str(path), max_dbs=2, map_size=256 * MiB)
    try:
        db = env.open_db(PAGES_DB)
        with env.begin(write=True, db=db) as txn:
            fn(txn, db)
    finally:
        env.close()


def flip(txn, key: bytes, offset: int) -> None:
    value = bytearray(txn.get(key))
    value[offset] ^= 0x40
    txn.put(key, bytes(value))


def test_put_read_round_trip_is_byte_identical(tmp_path, copier):
    pages = Pages(8)
    with open_tier(tmp_path / "cold") as tier:
        items = pages.items()
        items[1] = (items[1][0], items[1][1].numpy())              # numpy payload
        items[2] = (items[2][0], items[2][1].numpy().tobytes())    # bytes payload
        assert tier.put_many(items).result(timeout=10) is None
        assert tier.num_pages == 8 and all(k in tier for k in pages.keys)
        assert tier.used_bytes == sum(pages.record_len(i) for i in range(8)) == sum(tier.sizes().values())
        for i in range(8):
            ok, out = pages.read(tier, i)
            assert ok and torch.equal(out, pages.payloads[i])
        outs = [np.zeros(SPEC.page_bytes, np.uint8) for _ in range(3)]
        reqs = [(pages.keys[i], NS.digest, pages.headers[i].tokens, SPEC.fingerprint, outs[j])
                for j, i in enumerate([5, 0, 7])]
        assert tier.read_many(reqs) == [True, True, True]
        assert np.array_equal(outs[0], pages.payloads[5].numpy())
        assert tier.corrupt == 0 and tier.missing == 0


def test_bfloat16_tensor_payload(tmp_path):
    spec = KVSpec(2, 2, 16, "bfloat16", 16)
    pages = Pages(2, spec=spec, ns=Namespace.for_spec("m", spec))
    page = torch.randn(spec.page_shape).to(torch.bfloat16)      # [layers, 2, page_size, kv_heads, head_dim]
    with DiskTier(str(tmp_path / "c"), spec, 16 * MiB, 32 * MiB) as tier:
        tier.put_many([(pages.headers[0], page)]).result(timeout=10)
        out = torch.empty(spec.page_shape, dtype=torch.bfloat16)
        h = pages.headers[0]
        assert tier.read(h.key, pages.ns.digest, h.tokens, spec.fingerprint, out)
        assert torch.equal(out, page)


READER_SCRIPT = """
import hashlib, json, sys
import numpy as np
from kvstore.pages.spec import KVSpec
from kvstore.tiers.disk import DiskTier
spec = KVSpec(2, 2, 16, "float32", 16)
out = np.empty(spec.page_bytes, np.uint8)
found = {}
with DiskTier(sys.argv[1], spec, max_bytes=64 << 20, map_size_max=256 << 20) as tier:
    sizes = tier.sizes()
    for key, header, length in tier.scan():
        assert header is not None and header.key == key and sizes[key] == length
        ok = tier.read(key, header.namespace, header.tokens, spec.fingerprint, out)
        found[key.hex()] = hashlib.sha256(out).hexdigest() if ok else None
print(json.dumps(found))
"""


def test_reopen_in_new_process_finds_every_page(tmp_path):
    pages = Pages(40, seed=3)
    path = tmp_path / "cold"
    with open_tier(path, write_batch=4) as tier:
        futures = [tier.put_many(pages.items(slice(i, i + 5))) for i in range(0, 40, 5)]
        # close() must commit what is still queued
    assert all(f.done() and f.exception() is None for f in futures)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", READER_SCRIPT, str(path)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    expected = {k.hex(): hashlib.sha256(p.numpy()).hexdigest() for k, p in zip(pages.keys, pages.payloads)}
    assert found == expected


def test_damaged_records_read_as_misses(tmp_path, copier):
    pages = Pages(6)
    path = tmp_path / "cold"
    with open_tier(path) as tier:
        tier.put_many(pages.items()).result(timeout=10)

    def damage(txn, db):
        flip(txn, pages.keys[0], -100)                     # payload byte
        flip(txn, pages.keys[1], 10)                       # checksum byte
        flip(txn, pages.keys[2], record.PREFIX_BYTES + 5)  # header byte
        txn.put(pages.keys[3], txn.get(pages.keys[4]))     # a sound record under another key
    raw_update(path, damage)

    with open_tier(path) as tier:
        for i in range(4):
            sentinel = torch.full((SPEC.page_bytes,), 7, dtype=torch.uint8)
            ok, out = pages.read(tier, i, sentinel)
            assert not ok
            # nothing of a damaged record is left in the target: damage found while copying
            # (the checksum) zeroes it, damage found before (header, key) leaves it untouched
            assert torch.all(out == (0 if i < 2 else 7))
            assert tier.corrupt == i + 1
            assert pages.keys[i].hex() in tier.last_error
        assert "checksum" in tier.last_error or "another key" in tier.last_error
        for i in (4, 5):
            ok, out = pages.read(tier, i)
            assert ok and torch.equal(out, pages.payloads[i])
        assert tier.corrupt == 4 and tier.missing == 0
        headers = {k: h for k, h, _ in tier.scan()}
        assert len(headers) == 6


def test_header_mismatch_reads_as_miss(tmp_path, copier):
    pages = Pages(2)
    with open_tier(tmp_path / "cold") as tier:
        tier.put_many(pages.items()).result(timeout=10)
        h = pages.headers[1]
        out = torch.zeros(SPEC.page_bytes, dtype=torch.uint8)
        other_ns = Namespace.for_spec("test-model", SPEC, tenant="someone-else").digest
        other_tokens = tokens_bytes([1] * SPEC.page_size)
        other_spec = KVSpec(2, 2, 16, "float16", 32).fingerprint
        assert not tier.read(h.key, other_ns, h.tokens, SPEC.fingerprint, out)
        assert "namespace" in tier.last_error
        assert not tier.read(h.key, NS.digest, other_tokens, SPEC.fingerprint, out)
        assert "tokens" in tier.last_error
        assert not tier.read(h.key, NS.digest, h.tokens, other_spec, out)
        assert "geometry" in tier.last_error
        assert tier.corrupt == 3 and not out.any()
        assert tier.read(h.key, NS.digest, h.tokens, SPEC.fingerprint, out)

        # the same bytes stored under a header that claims another geometry
        spec2 = KVSpec(2, 2, 16, "float16", 32)          # same page bytes, other fingerprint
        assert spec2.page_bytes == SPEC.page_bytes
        foreign = RecordHeader(h.key, h.parent, h.namespace, h.tokens, spec2.fingerprint, SPEC.page_bytes)
        tier.put_many([(foreign, pages.payloads[1])]).result(timeout=10)
        assert not tier.read(h.key, NS.digest, h.tokens, SPEC.fingerprint, out)
        assert tier.corrupt == 4


def test_missing_key_is_a_miss_not_corruption(tmp_path):
    pages = Pages(1)
    with open_tier(tmp_path / "cold") as tier:
        ok, _ = pages.read(tier, 0)
        assert not ok and tier.missing == 1 and tier.corrupt == 0
        with pytest.raises(ValueError):
            tier.read(pages.keys[0], NS.digest, pages.headers[0].tokens, SPEC.fingerprint,
                      torch.zeros(10, dtype=torch.uint8))


def test_delete(tmp_path):
    pages = Pages(5)
    path = tmp_path / "cold"
    with open_tier(path) as tier:
        tier.put_many(pages.items()).result(timeout=10)
        before = tier.used_bytes
        tier.delete_many([pages.keys[1], pages.keys[3], b"\0" * 32]).result(timeout=10)  # unknown key ignored
        assert pages.keys[1] not in tier and tier.num_pages == 3
        assert tier.used_bytes == before - pages.record_len(1) - pages.record_len(3)
        assert not pages.read(tier, 1)[0] and pages.read(tier, 2)[0]
    with open_tier(path) as tier:
        assert {k for k, _, _ in tier.scan()} == {pages.keys[i] for i in (0, 2, 4)}


def test_scan_reports_unparsable_records(tmp_path):
    pages = Pages(3)
    path = tmp_path / "cold"
    with open_tier(path) as tier:
        tier.put_many(pages.items()).result(timeout=10)
    raw_update(path, lambda txn, db: txn.put(pages.keys[2], b"garbage"))
    with open_tier(path) as tier:
        scanned = {k: (h, n) for k, h, n in tier.scan()}
        assert scanned[pages.keys[2]] == (None, 7)
        assert scanned[pages.keys[0]][0] == pages.headers[0]


def test_scan_spans_many_chunks(tmp_path):
    pages = Pages(2500, seed=5)
    with open_tier(tmp_path / "cold") as tier:
        tier.put_many(pages.items()).result(timeout=30)
        keys = [k for k, _, _ in tier.scan()]
        assert len(keys) == 2500 and set(keys) == set(pages.keys)


def test_close_commits_queued_writes_and_is_idempotent(tmp_path):
    pages = Pages(50)
    path = tmp_path / "cold"
    tier = open_tier(path, write_batch=3)
    futures = [tier.put_many(pages.items(slice(i, i + 1))) for i in range(50)]
    tier.close()
    tier.close()
    assert all(f.done() and f.exception() is None for f in futures)
    with pytest.raises(KVStoreError, match="closed"):
        tier.put_many(pages.items(slice(0, 1)))
    with pytest.raises(KVStoreError, match="closed"):
        pages.read(tier, 0)
    with open_tier(path) as tier:
        assert tier.num_pages == 50


BIG = KVSpec(4, 8, 64, "float32", 16)   # 256 KiB pages: read_many hands them to the copy 8 at a time
BIG_NS = Namespace.for_spec("big", BIG)


@pytest.mark.parametrize("lookups", ["default", "windows", "at_once"])
def test_parallel_read_many_matches_and_refuses_damage(tmp_path, copier, lookups, monkeypatch):
    """Also with records looked up 5 at a time (fewer than the 8 the copy takes at a time), window by
    window or all at once after the first window (as when it came from the disk)."""
    if lookups != "default":
        monkeypatch.setattr(lmdb_reader, "_LOOKUP_BYTES", 5 * BIG.page_bytes)
        monkeypatch.setattr(lmdb_reader, "_MEMORY_RATE", 1e-30 if lookups == "windows" else float("inf"))
    pages = Pages(64, seed=8, spec=BIG, ns=BIG_NS)
    path = tmp_path / "cold"
    with DiskTier(str(path), BIG, 64 * MiB, 256 * MiB, read_threads=4) as tier:
        tier.put_many(pages.items()).result(timeout=30)
    damaged = {3, 17, 40, 63}                            # one in each group
    raw_update(path, lambda txn, db: [flip(txn, pages.keys[i], -5) for i in damaged])
    with DiskTier(str(path), BIG, 64 * MiB, 256 * MiB, read_threads=4) as tier:
        outs = [torch.full((BIG.page_bytes,), 7, dtype=torch.uint8) for _ in range(64)]
        reqs = [(h.key, BIG_NS.digest, h.tokens, BIG.fingerprint, out) for h, out in zip(pages.headers, outs)]
        for threads in (None, 1, 3):
            ok = tier.read_many(reqs, threads=threads)
            assert ok == [i not in damaged for i in range(64)]
            for i in range(64):   # a payload byte flipped: found while copying, the target zeroed
                assert torch.equal(outs[i], pages.payloads[i]) if ok[i] else not outs[i].any()
                outs[i].fill_(7)
        assert tier.corrupt == 3 * len(damaged)
        # the pool's threads copied beside the caller's where pages are copied natively; in Python
        # the caller's thread copies each page as it checks it
        assert (tier.reader._pool is not None) == (copier != "python")


def test_pages_start_on_a_cache_line_of_the_map(tmp_path):
    """A record's head is padded so that its page lands 64-byte aligned in LMDB's map (a copy from an
    unaligned source ran 30% slower), whatever the header's length."""
    for tokens in (4, 16, 64, 100):
        head = RecordHeader(bytes(32), bytes(32), bytes(32), bytes(tokens), bytes(16), 8192)
        assert (record.head_size(head)) % 64 == 48 and RecordHeader.unpack(head.pack()) == head
    pages = Pages(6, seed=4)
    with open_tier(tmp_path / "cold") as tier:
        tier.put_many(pages.items()).result(timeout=10)
        with tier.env.reading() as txn:
            for h in pages.headers:
                value = txn.get(h.key)
                assert (np.frombuffer(value, np.uint8)[-SPEC.page_bytes:].ctypes.data) % 64 == 0


def test_a_record_written_before_the_padding_still_reads(tmp_path, copier):
    """Records of the earlier format (no padding in the head) stay readable, verified as before."""
    import msgpack
    import xxhash
    pages = Pages(3, seed=6)
    path = tmp_path / "cold"
    with open_tier(path) as tier:
        tier.put_many(pages.items()).result(timeout=10)

    def old_format(txn, db):
        for h, payload in pages.items():
            head = msgpack.packb({"k": h.key, "p": h.parent, "n": h.namespace, "t": h.tokens, "s": h.spec,
                                  "b": h.nbytes})
            body = len(head).to_bytes(4, "little") + head + payload.numpy().tobytes()
            txn.put(h.key, record.MAGIC + xxhash.xxh3_128(body).digest() + body)
    raw_update(path, old_format)
    with open_tier(path) as tier:
        for i in range(3):
            ok, out = pages.read(tier, i)
            assert ok and torch.equal(out, pages.payloads[i])
        assert tier.corrupt == 0


def test_reads_from_the_file_that_disagree_with_the_map_fall_back_to_it(tmp_path, caplog):
    """Where the native copy does not read a record in one pass, it reads large pages from data.mdb with
    pread; should the file ever give a page that fails its checksum where the map's copy passes, the
    page is served from the map, one error is logged, and every later read copies from the map."""
    requires(native_copy.copier() is not None, f"the native checksummed copy: {native_copy.why_not}")
    pages = Pages(8, seed=9)
    with open_tier(tmp_path / "cold") as tier:
        tier.reader.one_pass = False
        tier.put_many(pages.items()).result(timeout=10)
        assert tier.reader._from_file
        other = tmp_path / "other"
        other.write_bytes(bytes(os.path.getsize(tmp_path / "cold" / "data.mdb")))
        fd, tier.env.data_fd = tier.env.data_fd, os.open(other, os.O_RDONLY)   # a file of zeros
        try:
            for _ in range(2):
                outs = [torch.zeros(SPEC.page_bytes, dtype=torch.uint8) for _ in range(8)]
                reqs = [(h.key, NS.digest, h.tokens, SPEC.fingerprint, o) for h, o in zip(pages.headers, outs)]
                assert tier.read_many(reqs) == [True] * 8
                assert all(torch.equal(o, p) for o, p in zip(outs, pages.payloads))
        finally:
            os.close(tier.env.data_fd)
            tier.env.data_fd = fd
        assert not tier.reader._from_file and tier.corrupt == 0
        assert [r.levelname for r in caplog.records if "data.mdb" in r.getMessage()] == ["ERROR"]


def test_a_target_off_a_cache_line_reads_exactly(tmp_path, copier):
    """A target that does not start on a 64-byte line (a view into a larger buffer) cannot take the
    one-pass read's aligned stores: its pages are copied in chunks, verified the same way."""
    pages = Pages(4, seed=8)
    with open_tier(tmp_path / "cold") as tier:
        tier.put_many(pages.items()).result(timeout=10)
        room = torch.zeros(4 * SPEC.page_bytes + 64, dtype=torch.uint8)
        start = (16 - room.data_ptr()) % 64
        outs = [room[start + i * SPEC.page_bytes:start + (i + 1) * SPEC.page_bytes] for i in range(4)]
        assert all(o.data_ptr() % 64 == 16 for o in outs)
        reqs = [(h.key, NS.digest, h.tokens, SPEC.fingerprint, o) for h, o in zip(pages.headers, outs)]
        assert tier.read_many(reqs) == [True] * 4
        assert all(torch.equal(o, p) for o, p in zip(outs, pages.payloads))
        assert tier.corrupt == 0


def test_small_pages_inline_in_lmdb_pages_read_exactly(tmp_path, copier):
    """Pages small enough for LMDB to keep beside others in one of its pages (not in overflow pages)
    are copied from the map, with the same checks."""
    tiny = KVSpec(1, 1, 4, "float32", 4)     # 128-byte pages
    ns = Namespace.for_spec("tiny", tiny)
    pages = Pages(40, seed=2, spec=tiny, ns=ns)
    with DiskTier(str(tmp_path / "cold"), tiny, 64 * MiB, 256 * MiB) as tier:
        tier.put_many(pages.items()).result(timeout=10)
        outs = [torch.zeros(tiny.page_bytes, dtype=torch.uint8) for _ in range(40)]
        reqs = [(h.key, ns.digest, h.tokens, tiny.fingerprint, o) for h, o in zip(pages.headers, outs)]
        assert tier.read_many(reqs) == [True] * 40
        assert all(torch.equal(o, p) for o, p in zip(outs, pages.payloads))
        assert tier.corrupt == 0
        assert tier.reader._from_file   # no page came wrong from the file
