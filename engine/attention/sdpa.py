"""The fast CPU (and any-device) backend: PyTorch's fused scaled_dot_product_attention over the pages.

It reads a layer's K and V from the cache once per sequence and step, each in one gather of
page halves (no per-head expansion: grouped heads go through `enable_gqa`, or, for one
query token, as rows of their KV head), and never builds a score matrix of its own: a whole
prompt runs causal, a chunk after a cached prefix with a bottom-right mask built once per step,
and a decode-only step as one padded batch. It differs from the torch reference (engine/
attention/torch_ref.py, the exactness baseline) only in the order of floating-point sums; tests
hold it to the reference within a tolerance, with greedy tokens identical.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionBatch


def gather(cache: torch.Tensor, which: int, pages: torch.Tensor) -> torch.Tensor:
    """K (which=0) or V (1) of these pages, contiguous: [pages, page_size, kv_heads, head_dim]. One
    index_select of whole page halves (a memcpy each; cache[idx] goes element by element), so that
    the token axis merges without another copy."""
    return cache.select(1, which).index_select(0, pages)


class SdpaBackend(AttentionBackend):
    supports_spill = True

    def plan(self, batch: AttentionBatch, dtype: torch.dtype) -> None:
        self.batch = batch
        dev, ps = batch.device, batch.page_size
        used = batch.hot_pages()
        self.group = batch.num_qo_heads // batch.num_kv_heads
        self.decode = batch.is_decode and not batch.spilled
        if self.decode:
            self._pages = batch.padded_pages(used, dev)
            lens = torch.tensor(batch.kv_lens, device=dev)
            valid = torch.arange(self._pages.shape[1] * ps, device=dev)[None, :] < lens[:, None]
            # every sequence at its full width needs no mask at all
            self._valid = None if bool(valid.all()) else valid[:, None, None, :]
            return
        # sequence by sequence: hot (and spilled warm) page indices, query span, and its mask kind
        self._seqs = []
        for i, n in enumerate(batch.kv_lens):
            lo, hi = batch.qo_indptr[i], batch.qo_indptr[i + 1]
            warm = batch.warm_tables[i] if batch.num_warm(i) else None
            mask = None
            if 1 < hi - lo < n:   # a chunk after cached tokens: bottom-right causal
                mask = torch.arange(n, device=dev)[None, :] <= torch.arange(n - (hi - lo), n, device=dev)[:, None]
            self._seqs.append((lo, hi, n, torch.tensor(used[i], dtype=torch.long, device=dev),
                               None if warm is None else torch.tensor(warm, dtype=torch.long, device=dev), mask))

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, warm_cache: torch.Tensor | None = None) -> torch.Tensor:
        return self._run_decode(q, kv_cache) if self.decode else self._run_each(q, kv_cache, warm_cache)

    def _run_decode(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        b = self.batch
        seqs, kvh, d = b.num_seqs, b.num_kv_heads, b.head_dim
        k = gather(kv_cache, 0, self._pages.view(-1)).view(seqs, -1, kvh, d).transpose(1, 2)
        v = gather(kv_cache, 1, self._pages.view(-1)).view(seqs, -1, kvh, d).transpose(1, 2)
        # [seqs, kv_heads, width*page_size, head_dim]
        qg = q.view(seqs, kvh, self.group, d)               # a KV head's query heads as its query rows
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=self._valid)
        return out.reshape(seqs, b.num_qo_heads, d)

    def _run_each(self, q: torch.Tensor, kv_cache: torch.Tensor, warm_cache: torch.Tensor | None) -> torch.Tensor:
        b = self.batch
        kvh, d = b.num_kv_heads, b.head_dim
        out = torch.empty_like(q)
        for lo, hi, n, pages, warm, mask in self._seqs:
            k, v = gather(kv_cache, 0, pages), gather(kv_cache, 1, pages)   # [pages, page_size, kv_heads, head_dim]
            if warm is not None:                            # the oldest pages, spilled to warm
                k = torch.cat([gather(warm_cache, 0, warm).to(k.device), k])
                v = torch.cat([gather(warm_cache, 1, warm).to(v.device), v])
            # 4-D views [1, kv_heads, n, head_dim]: the fused CPU kernel takes only 4-D inputs
            k = k.view(-1, kvh, d)[:n].transpose(0, 1)[None]
            v = v.view(-1, kvh, d)[:n].transpose(0, 1)[None]
            if hi - lo == 1:                                # one query: its heads as rows, nothing masked
                qg = q[lo].view(1, kvh, self.group, d)
                out[lo] = F.scaled_dot_product_attention(qg, k, v).reshape(-1, d)
                continue
            qi = q[lo:hi].transpose(0, 1)[None]             # [1, heads, q_len, head_dim]
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
            out[lo:hi] = o[0].transpose(0, 1)
        return out
