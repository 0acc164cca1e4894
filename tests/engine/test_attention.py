"""Attention backends: the torch reference against plain dense attention, and FlashInfer
against the torch reference where CUDA and flashinfer are present."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from engine.attention import AttentionBatch, create_backend
from kvstore.errors import ConfigError

PS, HQ, HKV, D = 16, 8, 2, 64


def random_batch(device, dtype, q_lens, kv_lens, num_pages=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn((num_pages, 2, PS, HKV, D), generator=g).to(device, dtype)
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables, at = [], 0
    for n in kv_lens:
        k = -(-n // PS)
        tables.append(perm[at:at + k])
        at += k
    indptr = [0]
    for q in q_lens:
        indptr.append(indptr[-1] + q)
    q = torch.randn((indptr[-1], HQ, D), generator=g).to(device, dtype)
    return AttentionBatch(indptr, tables, list(kv_lens), PS, HQ, HKV, D, torch.device(device)), q, cache


def dense_reference(batch, q, cache):
    out = []
    for i, n in enumerate(batch.kv_lens):
        lo, hi = batch.qo_indptr[i], batch.qo_indptr[i + 1]
        kv = cache[batch.page_tables[i]].float()
        k = kv[:, 0].reshape(-1, HKV, D)[:n].repeat_interleave(HQ // HKV, 1)
        v = kv[:, 1].reshape(-1, HKV, D)[:n].repeat_interleave(HQ // HKV, 1)
        for j in range(hi - lo):
            pos = n - (hi - lo) + j
            s = torch.einsum("hd,khd->hk", q[lo + j].float(), k[:pos + 1]) / math.sqrt(D)
            out.append(torch.einsum("hk,khd->hd", s.softmax(-1), v[:pos + 1]))
    return torch.stack(out)


@pytest.mark.parametrize("q_lens,kv_lens", [([1, 1, 1], [5, 16, 40]), ([7, 33, 1], [7, 50, 17]),
                                            ([16], [16]), ([3, 20], [35, 20])])
def test_torch_reference_matches_dense_attention(q_lens, kv_lens):
    batch, q, cache = random_batch("cpu", torch.float32, q_lens, kv_lens)
    be = create_backend("torch", torch.device("cpu"))
    be.plan(batch, torch.float32)
    assert torch.allclose(be.run(q, cache), dense_reference(batch, q, cache).to(q.dtype), atol=1e-5)


@pytest.mark.parametrize("q_lens,kv_lens", [([1, 1, 1], [5, 16, 40]), ([1, 1], [32, 32]), ([7, 33, 1], [7, 50, 17]),
                                            ([16], [16]), ([3, 20], [35, 20]), ([1, 40], [300, 40])])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_sdpa_matches_torch_reference(q_lens, kv_lens, dtype, tol):
    batch, q, cache = random_batch("cpu", dtype, q_lens, kv_lens, num_pages=64)
    ref, fast = create_backend("torch", batch.device), create_backend("sdpa", batch.device)
    ref.plan(batch, dtype)
    fast.plan(batch, dtype)
    torch.testing.assert_close(fast.run(q, cache).float(), ref.run(q, cache).float(), atol=tol, rtol=tol)


def test_sdpa_reads_spilled_pages_like_the_reference():
    """A sequence whose oldest pages were spilled to the warm tier: both backends read them from there."""
    batch, q, cache = random_batch("cpu", torch.float32, [5, 1], [70, 33], num_pages=64)
    warm = torch.randn((8, 2, PS, HKV, D), generator=torch.Generator().manual_seed(3))
    batch.warm_tables = [[6, 2], []]            # sequence 0: its first two pages are in warm slots 6 and 2
    batch.page_tables[0] = batch.page_tables[0][:-(-70 // PS) - 2]
    ref, fast = create_backend("torch", batch.device), create_backend("sdpa", batch.device)
    ref.plan(batch, torch.float32)
    fast.plan(batch, torch.float32)
    torch.testing.assert_close(fast.run(q, cache, warm), ref.run(q, cache, warm), atol=1e-5, rtol=1e-5)


def test_unknown_or_unavailable_backend_is_a_clear_error():
    with pytest.raises(ConfigError, match="attention_backend"):
        create_backend("xformers", torch.device("cpu"))
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        create_backend("flashinfer", torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
                    reason="needs CUDA and flashinfer")
@pytest.mark.parametrize("q_lens,kv_lens", [([1, 1, 1, 1], [5, 16, 40, 300]), ([7, 33, 1], [7, 50, 17])])
def test_flashinfer_matches_torch_reference_in_bf16(q_lens, kv_lens):
    batch, q, cache = random_batch("cuda", torch.bfloat16, q_lens, kv_lens, num_pages=128)
    ref, fi = create_backend("torch", batch.device), create_backend("flashinfer", batch.device)
    ref.plan(batch, torch.bfloat16)
    fi.plan(batch, torch.bfloat16)
    torch.testing.assert_close(fi.run(q, cache).float(), ref.run(q, cache).float(), atol=2e-2, rtol=2e-2)
