"""DiskTier and the OS: its file written back early (early_writeback) and dropped from the page cache
(drop_page_cache), so that a benchmark's cold read comes from the disk. Pages and helpers are
test_disk's."""

from __future__ import annotations

import os
import threading

import torch

from kvstore.tiers.buffers import _sync_file_range, early_writeback
from conftest import requires
from test_disk import NS, SPEC, Pages, copier, open_tier  # noqa: F401 (copier: the fixture of the read ways)


def test_early_writeback_stops_with_its_block(tmp_path):
    requires(_sync_file_range() is not None, "needs sync_file_range (Linux)")
    path = tmp_path / "f"
    path.write_bytes(b"x")
    with early_writeback(str(path), interval=0.001):
        with open(path, "ab") as f:
            f.write(os.urandom(1 << 20))
        assert any(t.name == "kvstore-cold-writeback" for t in threading.enumerate())
    assert not any(t.name == "kvstore-cold-writeback" for t in threading.enumerate())
    with early_writeback(str(tmp_path / "missing")):   # nothing to write back: a no-op
        pass


def _resident_pages(path) -> int:
    """Pages of the file at `path` in the OS page cache (mincore over a private mapping of it)."""
    import ctypes
    import mmap
    size = os.path.getsize(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE,
                                          prot=mmap.PROT_READ | mmap.PROT_WRITE) as m:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        return sum(v & 1 for v in vec)


def test_drop_page_cache_leaves_the_file_to_the_disk(tmp_path, copier):
    """After drop_page_cache the tier's file has no more pages in the page cache than a plain file
    the OS was asked to drop (none, on a disk filesystem; a memory filesystem keeps both), though
    the tier had just read them through its map, and every page still reads exactly."""
    pages = Pages(64)
    plain = tmp_path / "plain"
    plain.write_bytes(os.urandom(64 * SPEC.page_bytes))
    with open(plain, "rb") as f:
        f.read()
        os.fdatasync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    floor = _resident_pages(plain) / -(-os.path.getsize(plain) // 4096)   # what the filesystem keeps
    with open_tier(tmp_path / "cold") as tier:
        tier.put_many(pages.items()).result(timeout=10)
        outs = [torch.zeros(SPEC.page_bytes, dtype=torch.uint8) for _ in range(64)]
        requests = [(h.key, NS.digest, h.tokens, SPEC.fingerprint, o) for h, o in zip(pages.headers, outs)]
        assert all(tier.read_many(requests))   # mapped in and cached
        data = tmp_path / "cold" / "data.mdb"
        used = tier.env.lmdb.info()["last_pgno"] + 1
        assert _resident_pages(data) >= used * 0.9
        assert tier.drop_page_cache() is True
        assert _resident_pages(data) <= max(floor * os.path.getsize(data) / 4096, 0) + 4
        for o in outs:
            o.zero_()
        assert all(tier.read_many(requests))
        assert all(torch.equal(o, p) for o, p in zip(outs, pages.payloads))


def _dropped_file(path, nbytes: int) -> float:
    """A file of nbytes written and dropped from the page cache; the share of its pages the
    filesystem keeps anyway (0 on a disk, 1 on a memory filesystem)."""
    path.write_bytes(os.urandom(nbytes))
    with open(path, "rb") as f:
        os.fdatasync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return _resident_pages(path) / (nbytes // 4096)


def test_file_stage_brings_in_what_the_page_cache_lacks(tmp_path):
    """FileStage.stage reads into the page cache exactly the pages of its spans that were not there
    (a page touched before is not counted again), and a second stage of the same spans reads nothing."""
    import mmap

    import numpy as np

    from kvstore.tiers.file_stage import FileStage
    stage = FileStage()
    requires(stage.available, "needs mincore and madvise(MADV_POPULATE_READ) (Linux 5.14+)")
    path, size = tmp_path / "records", 8 << 20
    requires(_dropped_file(path, size) < 0.01, "needs a filesystem on a disk (this one keeps files in memory)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        m.madvise(mmap.MADV_RANDOM)            # a touch reads its own page, nothing around it
        base = np.frombuffer(m, np.uint8).ctypes.data
        touched = bytes(m[(1 << 20) + 5:(1 << 20) + 6])   # page 256 only
        assert touched and _resident_pages(path) == 1
        spans = [(base + 4096 * 100 + 16, 300 * 4096), (base + 16, 50 * 4096 - 16)]   # pages 100-400, 0-49
        assert stage.stage(spans) == (301 + 50 - 1) * 4096
        assert _resident_pages(path) == 301 + 50
        assert stage.stage(spans) == 0
        assert stage.staged_bytes == (301 + 50 - 1) * 4096
    assert path.read_bytes()[(1 << 20) + 5:(1 << 20) + 6] == touched
