"""The fast CPU (and any-device) backend: PyTorch's fused flash attention, reading pages where they lie.

A sequence's KV is attended to in pieces, one call of the fused kernel each, and the pieces'
outputs are merged by their log-sum-exp (split-K), so that no mask is ever built and nothing is
masked that need not be:
- the cached prefix (the tokens before this step's queries), which every query sees whole: a
  piece per run of consecutive hot slots, each a strided view of the layer's K and V (the hot
  layout keeps K and V apart, so a run of slots is a run of tokens), nothing copied; pages
  spilled to warm are gathered into one more piece, and so is a prefix cut into more than
  MAX_RUNS runs (a fragmented pool), which costs less than as many calls;
- this step's own tokens, causal among themselves: one piece, in place when its slots are one
  run, else gathered (a chunk at most).
A decode-only step whose sequences are all short (SHORT_DECODE tokens) runs as one padded batch
instead, one gather and one call, which costs less than a call a sequence there.

The kernel is ATen's CPU flash attention (`_scaled_dot_product_flash_attention_for_cpu`, which
returns the log-sum-exp the merge needs); grouped query heads are native to it. Elsewhere (CUDA
without FlashInfer) the pieces go through the math of `torch_ref`'s einsums. The result differs
from the torch reference only in the order of floating-point sums; tests hold it to the reference
within a tolerance, with greedy tokens identical.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionBatch, hot_tokens, warm_tokens

MAX_RUNS = 16          # more runs than this in a prefix: one gather instead of a call a run
SHORT_DECODE = 512     # a decode step whose every sequence is at most this long runs as one padded batch

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [heads, q_len, head_dim], k and v [kv_len, kv_heads, head_dim] (any strides) -> (out [heads,
    q_len, head_dim] float32, log-sum-exp [heads, q_len]). Causal: query i sees keys 0..i (q_len == kv_len)."""
    k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if q.device.type == "cpu":
        out, lse = _flash(q[None], k, v, 0.0, causal)
        return out[0].float(), lse[0]
    scale = 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[0] // k.shape[1]
    kf, vf = k[0].float().repeat_interleave(group, 0), v[0].float().repeat_interleave(group, 0)
    scores = (q.float() @ kf.transpose(1, 2)) * scale
    if causal:
        n = scores.shape[-1]
        scores.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = scores.logsumexp(-1)
    return (scores - lse[..., None]).exp() @ vf, lse


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Attention over the union of the pieces' keys, from each piece's (out, log-sum-exp)."""
    out, lse = parts[0]
    for o, l in parts[1:]:
        total = torch.logaddexp(lse, l)
        out = out * (lse - total).exp()[..., None] + o * (l - total).exp()[..., None]
        lse = total
    return out


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(first page index, first slot, pages) of each run of consecutive slots."""
    out: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if out and out[-1][1] + out[-1][2] == s:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((i, s, 1))
    return out


class Piece:
    """Some of a sequence's keys: a run of hot slots (`start`, `pages`, of which the first `tokens`
    tokens), or gathered rows (hot pages `hot`, warm slots `warm`, then the first `tokens`)."""

    __slots__ = ("start", "pages", "tokens", "hot", "warm", "skip")

    def __init__(self, tokens: int, start: int = 0, pages: int = 0, hot=None, warm=None, skip: int = 0):
        self.tokens, self.start, self.pages, self.hot, self.warm, self.skip = tokens, start, pages, hot, warm, skip

    def kv(self, cache: torch.Tensor, warm_cache: torch.Tensor | None, which: int) -> torch.Tensor:
        """[tokens, kv_heads, head_dim]: a view of the layer for a run, else a gather."""
        if self.hot is None:
            run = cache[which, self.start:self.start + self.pages]
            return run.flatten(0, 1)[self.skip:self.skip + self.tokens]
        parts = []
        if self.warm is not None:
            parts.append(warm_tokens(warm_cache, which, self.warm).to(cache.device))
        if len(self.hot):
            parts.append(hot_tokens(cache, which, self.hot))
        rows = parts[0] if len(parts) == 1 else torch.cat(parts)
        return rows[self.skip:self.skip + self.tokens]


class SdpaBackend(AttentionBackend):
    supports_spill = True

    def plan(self, batch: AttentionBatch, dtype: torch.dtype) -> None:
        self.batch = batch
        dev = batch.device
        used = batch.hot_pages()
        self.group = batch.num_qo_heads // batch.num_kv_heads
        self.padded = batch.is_decode and not batch.spilled and max(batch.kv_lens) <= SHORT_DECODE
        if self.padded:
            ps = batch.page_size
            self._pages = batch.padded_pages(used, dev)
            lens = torch.tensor(batch.kv_lens, device=dev)
            valid = torch.arange(self._pages.shape[1] * ps, device=dev)[None, :] < lens[:, None]
            # every sequence at its full width needs no mask at all
            self._valid = None if bool(valid.all()) else valid[:, None, None, :]
            return
        self._seqs = [(batch.qo_indptr[i], batch.qo_indptr[i + 1], self._pieces(batch, i, used[i]))
                      for i in range(batch.num_seqs)]

    def _pieces(self, b: AttentionBatch, i: int, hot: list[int]) -> tuple[list[Piece], Piece | None]:
        """Sequence i's prefix pieces (seen whole) and its causal piece (None for a single query,
        which sees everything)."""
        dev, ps, n = b.device, b.page_size, b.kv_lens[i]
        q_len = b.qo_indptr[i + 1] - b.qo_indptr[i]
        seen = n if q_len == 1 else n - q_len          # keys every query sees
        warm = b.warm_tables[i] if b.num_warm(i) else []
        nw = len(warm) * ps                             # spilled tokens come first, all in the prefix
        causal = None
        if q_len > 1:
            first = seen // ps - len(warm)              # hot page holding the chunk's first token
            pages = hot[first:]
            runs = slot_runs(pages)
            if len(runs) == 1:
                causal = Piece(q_len, pages[0], len(pages), skip=seen % ps)
            else:
                causal = Piece(q_len, hot=torch.tensor(pages, dtype=torch.long, device=dev), skip=seen % ps)
        prefix: list[Piece] = []
        if seen == 0:
            return prefix, causal
        hot_seen = -(-(seen - nw) // ps) if seen > nw else 0
        runs = slot_runs(hot[:hot_seen])
        if warm or len(runs) > MAX_RUNS:
            return [Piece(seen, hot=torch.tensor(hot[:hot_seen], dtype=torch.long, device=dev),
                          warm=torch.tensor(warm, dtype=torch.long, device=dev) if warm else None)], causal
        for first, slot, pages in runs:
            prefix.append(Piece(min(pages * ps, seen - first * ps), slot, pages))
        return prefix, causal

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, warm_cache: torch.Tensor | None = None) -> torch.Tensor:
        return self._run_padded(q, kv_cache) if self.padded else self._run_each(q, kv_cache, warm_cache)

    def _run_padded(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        b = self.batch
        seqs, kvh, d = b.num_seqs, b.num_kv_heads, b.head_dim
        # [seqs, kv_heads, width*page_size, head_dim]
        k = hot_tokens(kv_cache, 0, self._pages.view(-1)).view(seqs, -1, kvh, d).transpose(1, 2)
        v = hot_tokens(kv_cache, 1, self._pages.view(-1)).view(seqs, -1, kvh, d).transpose(1, 2)
        qg = q.view(seqs, kvh, self.group, d)               # a KV head's query heads as its query rows
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=self._valid)
        return out.reshape(seqs, b.num_qo_heads, d)

    def _run_each(self, q: torch.Tensor, kv_cache: torch.Tensor, warm_cache: torch.Tensor | None) -> torch.Tensor:
        out = torch.empty_like(q)
        for lo, hi, (prefix, causal) in self._seqs:
            qi = q[lo:hi].transpose(0, 1)                   # [heads, q_len, head_dim]
            parts = [attend(qi, p.kv(kv_cache, warm_cache, 0), p.kv(kv_cache, warm_cache, 1), False) for p in prefix]
            if causal is not None:
                parts.append(attend(qi, causal.kv(kv_cache, warm_cache, 0), causal.kv(kv_cache, warm_cache, 1), True))
            out[lo:hi] = merge(parts).transpose(0, 1).to(q.dtype)
        return out
