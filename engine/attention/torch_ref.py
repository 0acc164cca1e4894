"""The paged attention reference in plain PyTorch: GQA, bottom-right causal mask, fp32 math.

Decode-only steps run as one padded batch; steps with prefill chunks go sequence by sequence.
"""

from __future__ import annotations

import math

import torch

from engine.attention.base import AttentionBackend, AttentionBatch, hot_tokens, warm_tokens


class TorchBackend(AttentionBackend):
    supports_spill = True

    def plan(self, batch: AttentionBatch, dtype: torch.dtype) -> None:
        self.batch = batch
        dev, ps = batch.device, batch.page_size
        used = batch.hot_pages()
        self.decode = batch.is_decode and not batch.spilled
        self._warm = [torch.tensor(batch.warm_tables[i] if batch.warm_tables else [], dtype=torch.long, device=dev)
                      for i in range(batch.num_seqs)]
        if self.decode:
            self._pages = batch.padded_pages(used, dev)
            lens = torch.tensor(batch.kv_lens, device=dev)
            self._valid = torch.arange(self._pages.shape[1] * ps, device=dev)[None, :] < lens[:, None]   # [seqs, width*ps]
            return
        self._pages = [torch.tensor(p, dtype=torch.long, device=dev) for p in used]
        self._masks = []
        for i, n in enumerate(batch.kv_lens):
            q_len = batch.qo_indptr[i + 1] - batch.qo_indptr[i]
            qpos = torch.arange(n - q_len, n, device=dev)[:, None]
            self._masks.append(torch.arange(n, device=dev)[None, :] <= qpos)  # [q_len, kv_len]

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, warm_cache: torch.Tensor | None = None) -> torch.Tensor:
        return self._run_decode(q, kv_cache) if self.decode else self._run_each(q, kv_cache, warm_cache)

    def _run_decode(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        b = self.batch
        seqs, group = b.num_seqs, b.num_qo_heads // b.num_kv_heads
        kv = kv_cache[:, self._pages]                  # [2, seqs, width, page_size, kv_heads, head_dim]
        k = kv[0].reshape(seqs, -1, b.num_kv_heads, b.head_dim).float()
        v = kv[1].reshape(seqs, -1, b.num_kv_heads, b.head_dim).float()
        qg = q.float().view(seqs, b.num_kv_heads, group, b.head_dim)
        scores = torch.einsum("bhgd,bkhd->bhgk", qg, k) / math.sqrt(b.head_dim)
        scores.masked_fill_(~self._valid[:, None, None, :], float("-inf"))
        out = torch.einsum("bhgk,bkhd->bhgd", scores.softmax(-1), v)
        return out.reshape(seqs, b.num_qo_heads, b.head_dim).to(q.dtype)

    def _run_each(self, q: torch.Tensor, kv_cache: torch.Tensor, warm_cache: torch.Tensor | None) -> torch.Tensor:
        b = self.batch
        group = b.num_qo_heads // b.num_kv_heads
        scale = 1.0 / math.sqrt(b.head_dim)
        out = torch.empty_like(q)
        for i, n in enumerate(b.kv_lens):
            lo, hi = b.qo_indptr[i], b.qo_indptr[i + 1]
            k, v = hot_tokens(kv_cache, 0, self._pages[i]), hot_tokens(kv_cache, 1, self._pages[i])
            if len(self._warm[i]):                              # the oldest pages, spilled to warm
                k = torch.cat([warm_tokens(warm_cache, 0, self._warm[i]).to(k.device), k])
                v = torch.cat([warm_tokens(warm_cache, 1, self._warm[i]).to(v.device), v])
            k = k[:n].float().repeat_interleave(group, dim=1).transpose(0, 1)   # [heads, kv_len, head_dim]
            v = v[:n].float().repeat_interleave(group, dim=1).transpose(0, 1)
            qi = q[lo:hi].float().transpose(0, 1)                   # [heads, q_len, head_dim]
            scores = (qi @ k.transpose(1, 2)) * scale               # [heads, q_len, kv_len]
            scores.masked_fill_(~self._masks[i], float("-inf"))
            out[lo:hi] = (scores.softmax(-1) @ v).transpose(0, 1).to(q.dtype)
        return out
