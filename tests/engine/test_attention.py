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


def random_batch(device, dtype, q_lens, kv_lens, num_pages=64, seed=0, layout="scattered"):
    """Pages drawn at random from the pool (`scattered`: runs of one slot, mostly), in order (`runs`:
    each sequence's pages one run of slots), or in order with a gap after every third page (`broken`)."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn((2, num_pages, PS, HKV, D), generator=g).to(device, dtype)   # a hot layer: K, V
    perm = {"scattered": torch.randperm(num_pages, generator=g).tolist(), "runs": list(range(num_pages)),
            "broken": [p for p in range(num_pages) if p % 4 != 3]}[layout]
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
        kv = cache[:, batch.page_tables[i]].float()
        k = kv[0].reshape(-1, HKV, D)[:n].repeat_interleave(HQ // HKV, 1)
        v = kv[1].reshape(-1, HKV, D)[:n].repeat_interleave(HQ // HKV, 1)
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
@pytest.mark.parametrize("dtype,tol,name", [(torch.float32, 1e-5, "sdpa"), (torch.bfloat16, 2e-2, "sdpa"),
                                            (torch.float32, 1e-5, "native")])
def test_fast_backends_match_torch_reference(q_lens, kv_lens, dtype, tol, name):
    batch, q, cache = random_batch("cpu", dtype, q_lens, kv_lens, num_pages=64)
    ref, fast = create_backend("torch", batch.device), create_backend(name, batch.device, dtype, D)
    ref.plan(batch, dtype)
    fast.plan(batch, dtype)
    torch.testing.assert_close(fast.run(q, cache).float(), ref.run(q, cache).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("name", ["sdpa", "native"])
@pytest.mark.parametrize("layout", ["runs", "broken", "scattered"])
@pytest.mark.parametrize("q_lens,kv_lens", [([32], [300]), ([17], [17]), ([40], [301]), ([1, 1, 1], [600, 33, 700]),
                                            ([1, 25, 1], [900, 250, 17]), ([64, 1], [64, 520]), ([200], [1000]),
                                            ([1] * 8, [700] * 8), ([100, 40], [1000, 60])])
def test_in_place_paths_match_the_reference(q_lens, kv_lens, layout, name):
    """sdpa: prefix runs read in place, prefixes gathered (more runs than MAX_RUNS), a chunk in one run
    or straddling runs, long decodes one by one; native: the same batches in one call, key ranges split
    across threads, several query blocks (the wide blocks of a question after a long prefix beside the
    narrow ones of a prefill). All equal the reference within float32's tolerance."""
    batch, q, cache = random_batch("cpu", torch.float32, q_lens, kv_lens, num_pages=512, layout=layout)
    ref, fast = create_backend("torch", batch.device), create_backend(name, batch.device, torch.float32, D)
    ref.plan(batch, torch.float32)
    fast.plan(batch, torch.float32)
    torch.testing.assert_close(fast.run(q, cache), ref.run(q, cache), atol=1e-5, rtol=1e-5)


def test_sdpa_reads_a_prefix_in_place():
    """A prefix in one run of slots is attended where it lies: changing a key outside the sequence's pages
    changes nothing, and its own pages are never copied (a view of the cache, same storage)."""
    from engine.attention.sdpa import SdpaBackend
    batch, q, cache = random_batch("cpu", torch.float32, [8], [200], num_pages=64, layout="runs")
    be = SdpaBackend()
    be.plan(batch, torch.float32)
    (prefix, causal), = [p for _, _, p in be._seqs]
    assert len(prefix) == 1 and prefix[0].hot is None and causal.hot is None
    k = prefix[0].kv(cache, None, 0)
    assert k.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    before = be.run(q, cache)
    cache[:, 50:].normal_()
    assert torch.equal(be.run(q, cache), before)


@pytest.mark.parametrize("name", ["sdpa", "native"])
def test_fast_backends_read_spilled_pages_like_the_reference(name):
    """A sequence whose oldest pages were spilled to the warm tier: every backend reads them from there."""
    batch, q, cache = random_batch("cpu", torch.float32, [5, 1], [70, 33], num_pages=64)
    warm = torch.randn((8, 3, 2, PS, HKV, D), generator=torch.Generator().manual_seed(3))[:, 1]   # layer 1 of 3
    batch.warm_tables = [[6, 2], []]            # sequence 0: its first two pages are in warm slots 6 and 2
    batch.page_tables[0] = batch.page_tables[0][:-(-70 // PS) - 2]
    ref, fast = create_backend("torch", batch.device), create_backend(name, batch.device, torch.float32, D)
    ref.plan(batch, torch.float32)
    fast.plan(batch, torch.float32)
    torch.testing.assert_close(fast.run(q, cache, warm), ref.run(q, cache, warm), atol=1e-5, rtol=1e-5)


def test_unknown_or_unavailable_backend_is_a_clear_error():
    with pytest.raises(ConfigError, match="attention_backend"):
        create_backend("xformers", torch.device("cpu"))
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        create_backend("flashinfer", torch.device("cpu"))
    with pytest.raises(ConfigError, match="float32 only"):
        create_backend("native", torch.device("cpu"), torch.bfloat16, D)
    with pytest.raises(ConfigError, match="head_dim"):
        create_backend("native", torch.device("cpu"), torch.float32, 72)


def test_auto_picks_native_on_an_avx512_or_avx2_cpu_for_float32_and_sdpa_otherwise(monkeypatch):
    from engine.attention import native
    from engine.attention.native import NativeBackend
    from engine.attention.sdpa import SdpaBackend
    expected = SdpaBackend if native.preferred() else NativeBackend
    assert isinstance(create_backend("auto", torch.device("cpu"), torch.float32, D), expected)
    assert isinstance(create_backend("auto", torch.device("cpu"), torch.bfloat16, D), SdpaBackend)
    monkeypatch.setattr(native, "preferred", lambda: "this CPU has neither AVX-512 nor AVX2")
    assert isinstance(create_backend("auto", torch.device("cpu"), torch.float32, D), SdpaBackend)
    assert isinstance(create_backend("native", torch.device("cpu"), torch.float32, D), NativeBackend)   # asked for


def test_native_kernel_without_a_compiler_is_a_clear_error(monkeypatch, tmp_path):
    """No C++ compiler and no kernel built: `native` is refused with a one-line reason, `auto` takes sdpa."""
    from engine.attention import native
    from engine.attention.sdpa import SdpaBackend
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match="needs a C\\+\\+ compiler"):
        create_backend("native", torch.device("cpu"), torch.float32, D)
    assert isinstance(create_backend("auto", torch.device("cpu"), torch.float32, D), SdpaBackend)


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
                    reason="needs CUDA and flashinfer")
@pytest.mark.parametrize("q_lens,kv_lens", [([1, 1, 1, 1], [5, 16, 40, 300]), ([7, 33, 1], [7, 50, 17])])
def test_flashinfer_matches_torch_reference_in_bf16(q_lens, kv_lens):
    batch, q, cache = random_batch("cuda", torch.bfloat16, q_lens, kv_lens, num_pages=128)
    ref, fi = create_backend("torch", batch.device), create_backend("flashinfer", batch.device)
    ref.plan(batch, torch.bfloat16)
    fi.plan(batch, torch.bfloat16)
    torch.testing.assert_close(fi.run(q, cache).float(), ref.run(q, cache).float(), atol=2e-2, rtol=2e-2)
