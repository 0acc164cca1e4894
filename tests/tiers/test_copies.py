"""The memory tiers' CPU copies: exact in every direction and element size, and started from any
thread without giving it an OpenMP thread team (which would slow every engine step after it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from kvstore.pages.spec import KVSpec
from kvstore.tiers.buffers import copy_bytes_serial, copy_serial
from kvstore.tiers.device import DeviceTier
from kvstore.tiers.host import HostTier
from conftest import requires


@pytest.mark.parametrize("dtype,head_room", [("float32", 0), ("bfloat16", 0), ("float16", 0), ("float32", 192),
                                            ("bfloat16", 64)])
def test_hot_copies_are_exact_both_ways(dtype, head_room):
    spec = KVSpec(3, 2, 16, dtype, 8)
    hot, warm = DeviceTier(spec, 12), HostTier(spec, 12, pin=False, head_room=head_room)
    if head_room:   # each slot's room, before its page, is never written by a page copy
        warm.buffer.view(12, warm.stride)[:, :head_room] = 0xAB
    g = torch.Generator().manual_seed(1)
    hot.kv.copy_(torch.randn(hot.kv.shape, generator=g).to(hot.kv.dtype))
    slots = [5, 6, 7, 2, 9]   # a run and two single slots
    pages = hot.gather(slots)
    for i, s in enumerate(slots):
        assert torch.equal(pages[i], hot.read_page(s))
    hot.save_to(slots, warm, [0, 1, 2, 7, 8])
    assert torch.equal(warm.pages[[0, 1, 2, 7, 8]], pages)
    hot.kv.zero_()
    hot.load_from([3, 4, 10, 11, 0], warm, [0, 1, 2, 7, 8])
    assert torch.equal(hot.gather([3, 4, 10, 11, 0]), pages)
    hot.kv.zero_()
    hot.scatter([1, 2, 3, 8, 11], pages)
    assert torch.equal(hot.gather([1, 2, 3, 8, 11]), pages)
    hot.kv.zero_()
    as_bytes = [pages[i].view(torch.uint8).numpy().tobytes() for i in (1, 3)]
    hot.store_pages([4, 0], [as_bytes[0], bytearray(as_bytes[1])])   # read-only and writable buffers
    assert torch.equal(hot.read_page(4), pages[1]) and torch.equal(hot.read_page(0), pages[3])
    assert [bytes(p) for p in hot.payloads([4, 0])] == as_bytes
    warm.store_pages([3], [as_bytes[0]])
    assert bytes(warm.payloads([3])[0]) == as_bytes[0] and torch.equal(warm.pages[3], pages[1])
    if head_room:
        assert (warm.buffer.view(12, warm.stride)[:, :head_room] == 0xAB).all()


@pytest.mark.parametrize("head_room", [0, 64])
def test_large_tier_copies_go_by_blocks_and_are_exact(monkeypatch, head_room):
    """Copies of a MiB or more between tiers go to the native copy as blocks of contiguous bytes (here
    each layer's K or V of a page, 8 KiB: the hot tier keeps a layer's pages together) and land
    exactly, in both directions, leaving the warm slots' head room alone."""
    from kvstore.pages import native_copy
    requires(native_copy.copier() is not None, f"the native copy: {native_copy.why_not}")
    calls = []
    copy_blocks = native_copy.NativeCopy.copy_blocks
    monkeypatch.setattr(native_copy.NativeCopy, "copy_blocks",
                        lambda self, dsts, srcs, n: calls.append((len(dsts), n)) or copy_blocks(self, dsts, srcs, n))
    spec = KVSpec(4, 4, 64, "bfloat16", 16)   # 64 KiB pages
    hot, warm = DeviceTier(spec, 40), HostTier(spec, 40, pin=False, head_room=head_room)
    if head_room:
        warm.buffer.view(40, warm.stride)[:, :head_room] = 0xAB
    hot.kv.copy_(torch.randn(hot.kv.shape, generator=torch.Generator().manual_seed(2)).to(hot.kv.dtype))
    pages = hot.gather(list(range(3, 23)))   # 20 pages, 1.25 MiB: one call of 20 x 4 layers x K, V blocks
    hot.save_to(list(range(3, 23)), warm, list(range(10, 30)))
    assert torch.equal(warm.pages[10:30].view(torch.int16), pages.view(torch.int16))
    hot.kv.zero_()
    hot.load_from(list(range(20, 40)), warm, list(range(10, 30)))
    assert torch.equal(hot.gather(list(range(20, 40))).view(torch.int16), pages.view(torch.int16))
    assert not hot.gather(list(range(20))).view(torch.int16).any()
    assert calls == [(20 * 4 * 2, 16 * 4 * 64 * 2)] * 5   # every copy above: gather, save, load, gathers
    if head_room:
        assert (warm.buffer.view(40, warm.stride)[:, :head_room] == 0xAB).all()


def test_a_large_copy_to_a_target_off_a_cache_line_is_exact():
    """A target that does not start on a 64-byte line is copied without streaming stores (memcpy),
    exactly, and nothing before or after it is touched."""
    src = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    room = torch.zeros((3 << 20) + 128, dtype=torch.uint8)
    start = (8 - room.data_ptr()) % 64
    copy_serial(room[start:start + (3 << 20)], src)
    assert torch.equal(room[start:start + (3 << 20)], src)
    assert not room[:start].any() and not room[start + (3 << 20):].any()


def test_warm_head_room_lies_before_each_page_and_is_checked():
    spec = KVSpec(2, 1, 8, "float32", 4)   # 512-byte pages
    warm = HostTier(spec, 5, pin=False, head_room=128)
    assert warm.stride == 640 and warm.buffer.numel() == 5 * 640
    base = warm.buffer.data_ptr()
    for s, target in enumerate(warm.targets(range(5))):
        assert target.data_ptr() == base + s * 640 + 128 and target.numel() == 512
        assert target.data_ptr() % 64 == 0
    assert HostTier(spec, 5, pin=False).stride == 512   # no room: slots back to back
    for bad in (-64, 100):
        with pytest.raises(ValueError, match="multiple of 64"):
            HostTier(spec, 2, pin=False, head_room=bad)
    with pytest.raises(ValueError, match="0 for shared memory"):
        HostTier(spec, 2, pin=False, shared=True, head_room=64)


def test_copy_serial_refuses_a_mismatch():
    with pytest.raises(ValueError, match="copy of"):
        copy_serial(torch.zeros(4), torch.zeros(5))
    with pytest.raises(ValueError, match="copy of"):
        copy_serial(torch.zeros(4), torch.zeros(4, dtype=torch.float16))
    with pytest.raises(ValueError, match="payload is 12 bytes"):
        copy_bytes_serial(torch.zeros(4), bytes(12))


# Run in a child, so that the thread count is this check's alone. A copy of PyTorch's on a thread
# other than the one that made its team makes that thread a team (the detector's own check shows
# it); the tier's copies on such a thread must not.
_CHILD = textwrap.dedent("""
    import os, threading, torch
    from kvstore.pages.spec import KVSpec
    from kvstore.tiers.device import DeviceTier
    from kvstore.tiers.host import HostTier
    torch.set_num_threads(2)
    threads = lambda: len(os.listdir("/proc/self/task"))
    spec = KVSpec(4, 4, 64, "float32", 16)              # 32K elements a page: PyTorch splits its copies
    hot, warm = DeviceTier(spec, 16), HostTier(spec, 16, pin=False)
    (hot.kv + 1).sum()                                  # the main thread's team exists
    def on_a_thread(fn):   # threads before and after fn, counted on the thread that runs it:
                           # a team lives as long as the thread that made it
        counts = []
        def run():
            counts.append(threads())
            fn()
            counts.append(threads())
        t = threading.Thread(target=run)
        t.start()
        t.join()
        return counts
    def tier_copies():
        pages = hot.gather(list(range(8)))
        hot.save_to(list(range(8)), warm, list(range(8)))
        hot.load_from(list(range(8)), warm, list(range(8, 16)))
        hot.scatter(list(range(8)), pages)
        hot.store_pages([3, 4], hot.payloads([5, 6]))
    print(*on_a_thread(tier_copies), *on_a_thread(lambda: hot.kv.clone()))
""")


def test_tier_copies_start_no_thread_team_on_other_threads():
    requires(sys.platform.startswith("linux"), "this test counts threads in /proc/self/task (Linux)")
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before_tier, after_tier, before_torch, after_torch = map(int, out.stdout.split())
    counts = f"threads before/after the tier's copies {before_tier}/{after_tier}, PyTorch's {before_torch}/{after_torch}"
    assert after_torch > before_torch, f"the detector sees no team from a PyTorch copy on another thread: {counts}"
    assert after_tier == before_tier, counts


def test_host_buffers_lie_in_whole_huge_pages_and_populating_changes_no_byte():
    """A CPU tier's buffer starts on a 2 MiB boundary (transparent huge pages can back all of it); the
    warm tier's pages are faulted in by a thread of its own, which leaves every byte as it finds
    it, slots written while it runs included, and stops when the tier closes."""
    from kvstore.tiers.buffers import Populator, huge_page_buffer
    zeroed = huge_page_buffer(5 << 20, zero=True)
    assert zeroed.data_ptr() % (2 << 20) == 0 and zeroed.numel() == 5 << 20 and not zeroed.any()
    buf = huge_page_buffer(300 << 20)
    pattern = torch.arange(256, dtype=torch.uint8).repeat(1 << 12)          # 1 MiB
    for mib in (0, 70, 299):   # before the populator starts, in its first chunk and in its last
        buf[mib << 20:(mib + 1) << 20] = pattern
    populator = Populator(buf, "test-populate")
    buf[150 << 20:151 << 20] = pattern    # while it runs
    populator.thread.join(timeout=60)
    assert not populator.thread.is_alive()
    for mib in (0, 70, 150, 299):
        assert torch.equal(buf[mib << 20:(mib + 1) << 20], pattern)
    spec = KVSpec(4, 4, 64, "float32", 16)   # 128 KiB pages
    warm = HostTier(spec, 1024, pin=False)
    assert warm._populator is not None and warm.buffer.data_ptr() % (2 << 20) == 0
    warm.close()
    assert warm._populator.stopped.is_set()
    warm._populator.thread.join(timeout=60)
    assert not warm._populator.thread.is_alive()
