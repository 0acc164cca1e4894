"""The cold tier's native checksummed copy (kvstore/pages/native_copy.py, copy_hash.cpp) on its own:
where its xxhash comes from, its one-pass reads against python-xxhash at every alignment, and a
damaged byte anywhere in a record. tests/tiers/test_disk.py reads through it from a DiskTier."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import xxhash

from kvstore.pages import native_copy
from conftest import one_pass_levels, requires


def test_the_copy_runs_every_one_pass_this_cpu_has():
    """The widest one pass the library detects is the widest this CPU's flags allow (AVX-512, then
    AVX2; none off x86-64): a CPU's pass is never left unused, nor one it lacks taken."""
    requires(native_copy.copier() is not None, f"the native checksummed copy: {native_copy.why_not}")
    assert native_copy.copier().one_pass == max(one_pass_levels(), default=0)


def test_native_copy_hashes_with_python_xxhash_or_else_the_systems_libxxhash(monkeypatch):
    """xxhash's C functions come from python-xxhash's own extension module (always installed, and
    faster than libxxhash 0.8.1); where that module does not export them, from the system's
    libxxhash. Either way the native copy is exact and its digest equals python-xxhash's (the self-test)."""
    requires(native_copy.copier() is not None, f"the native checksummed copy: {native_copy.why_not}")
    native = native_copy.copier()
    assert native.xxh._name == xxhash._xxhash.__file__
    monkeypatch.setattr(xxhash._xxhash, "__file__", "/nonexistent/_xxhash.so")
    system = native_copy._xxhash_library()
    assert "libxxhash" in system._name
    native_copy._self_test(native_copy.NativeCopy(native.lib, system))   # raises NotBuilt if they disagree


def test_native_copy_agrees_with_python_xxhash_at_every_alignment():
    """The one-pass read computes xxh3 itself and puts each target line together from two of the
    record's stripes: for heads of every length mod 64 and pages of whole stripes and not, its digest
    is python-xxhash's and its copy exact, with nothing written past the target; a record too small
    for it is read in chunks. Each one pass this CPU runs (AVX-512, AVX2) is checked, and the chunked
    copy; where the CPU runs neither, the chunked copy alone."""
    requires(native_copy.copier() is not None, f"the native checksummed copy: {native_copy.why_not}")
    native = native_copy.copier()
    sizes = [(head, page) for head in range(0, 130) for page in (128, 129, 191, 192, 255, 1024, 1088, 4100)]
    rng = np.random.default_rng(3)
    sizes += [(int(rng.integers(0, 400)), int(rng.integers(1, 300_000))) for _ in range(100)]
    wrong = [(level, head, page) for level in range(native.one_pass + 1) for head, page in sizes
             if not native_copy.check_copy(native, head, page, level)]
    assert wrong == []


def test_native_copy_digest_changes_with_any_byte_of_the_record():
    """A byte changed anywhere in a record (its head, the page's first and last stripes, the tail the
    one-pass read delivers from its last registers) gives another digest: the damage is seen, and the
    digest is python-xxhash's of the bytes as they are. Each one pass this CPU runs, and in chunks."""
    requires(native_copy.copier() is not None, f"the native checksummed copy: {native_copy.why_not}")
    native = native_copy.copier()
    head, page = 37, 737_280
    data = np.random.default_rng(5).integers(0, 256, head + page, dtype=np.uint8)
    out = torch.zeros(page, dtype=torch.uint8)
    at = np.array([data.ctypes.data])

    def digest(level: int) -> bytes:
        found, how = native.copy_hash(at, at, at + head, np.array([out.data_ptr()]), page, 4096, one_pass=level)
        assert torch.equal(out, torch.from_numpy(data[head:]))
        assert how[0] == (native_copy.READ_ONE_PASS if level else native_copy.READ_MAP)
        return found
    for level in range(native.one_pass + 1):
        clean = digest(level)
        assert clean == xxhash.xxh3_128(data.tobytes()).digest()
        for at_byte in (0, head - 1, head, head + 63, head + page // 2, head + page - 129, head + page - 65,
                        head + page - 1):
            data[at_byte] ^= 0x10
            changed = digest(level)
            assert changed != clean and changed == xxhash.xxh3_128(data.tobytes()).digest(), (level, at_byte)
            data[at_byte] ^= 0x10


def test_a_batch_shared_by_threads_copies_every_page_once_while_it_is_filled():
    """A CopyBatch filled a record at a time, published now and then, while three threads drain it: each
    page is copied exactly (its digest python-xxhash's) and the drains return only once the batch is
    closed and empty, whether the filler runs ahead of the copying threads or behind them."""
    requires(native_copy.copier() is not None, f"the native checksummed copy: {native_copy.why_not}")
    native = native_copy.copier()
    head, page, n = 52, 4096 * 3, 300
    data = np.random.default_rng(11).integers(0, 256, n * (head + page), dtype=np.uint8).reshape(n, head + page)
    out = np.full((n, page + 64), 0xA5, np.uint8)
    start = -out.ctypes.data % 64   # every target 64-byte aligned: the row stride is a multiple of 64
    for pause in (0.0, 0.0005):
        out[:] = 0xA5
        batch = native.batch(n, page, 4096)
        with ThreadPoolExecutor(3) as pool:
            drains = [pool.submit(batch.drain) for _ in range(3)]
            for i in range(n):
                at = data[i].ctypes.data
                batch.add(at, at, at + head, out[i].ctypes.data + start)
                if i % 7 == 6:
                    batch.publish()
                    time.sleep(pause)
            assert not any(d.done() for d in drains)   # not closed yet: they wait for more
            batch.close()
            for d in drains:
                d.result(timeout=30)
        digests, how = batch.results()
        assert len(how) == n
        for i in range(n):
            assert digests[16 * i:16 * i + 16] == xxhash.xxh3_128(data[i].tobytes()).digest(), (pause, i)
            assert np.array_equal(out[i, start:start + page], data[i, head:]), (pause, i)
        assert not (out[:, :start] != 0xA5).any() and not (out[:, start + page:] != 0xA5).any()
