"""CUDA paths of the hot and warm tiers: pinned and shared-memory warm buffers, copy streams.

Run where a GPU is present; elsewhere these tests are skipped (the CPU paths are covered by
the store tests).
"""

from __future__ import annotations

import pytest
import torch

from kvstore.pages.spec import KVSpec
from kvstore.tiers.device import DeviceTier
from kvstore.tiers.host import HostTier

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SPEC = KVSpec(4, 8, 128, "bfloat16", 16)


@pytest.mark.parametrize("shared,head_room", [(False, 0), (True, 0), (False, 256)])
def test_round_trip_through_pinned_warm_is_byte_identical(shared, head_room):
    hot = DeviceTier(SPEC, 64, "cuda")
    warm = HostTier(SPEC, 64, shared=shared, head_room=head_room)   # head room: a page a DMA
    assert warm.raw.is_pinned() or shared
    hot.kv.copy_(torch.randn(hot.kv.shape, device="cuda").to(SPEC.torch_dtype))
    before = hot.kv.clone()
    src = [3, 4, 5, 9, 10, 40, 41, 42, 43, 1]      # runs and singles
    dst = [0, 1, 2, 7, 8, 20, 21, 22, 23, 63]
    hot.save_to(src, warm, dst)
    for s, d in zip(src, dst):
        assert torch.equal(warm.pages[d], before[:, s].cpu())
    hot.kv.zero_()
    back = [11, 12, 13, 50, 51, 30, 31, 32, 33, 0]
    hot.load_from(back, warm, dst)
    torch.cuda.synchronize()
    for s, b in zip(src, back):
        assert torch.equal(hot.kv[:, :, b], before[:, :, s])
    warm.close()


def test_copies_wait_for_the_compute_stream():
    hot = DeviceTier(SPEC, 8, "cuda")
    warm = HostTier(SPEC, 8)
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(50_000_000)  # keep the stream busy, then write the page
        hot.kv[:, :, 2].fill_(3.0)
    with torch.cuda.stream(compute):
        hot.save_to([2], warm, [5])
    assert torch.all(warm.pages[5] == 3.0)
