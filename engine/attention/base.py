"""The attention backend interface and the batch description both backends plan from."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionBatch:
    """One step's sequences, flattened: sequence i owns query rows qo_indptr[i]:qo_indptr[i+1].

    Its KV (this step's tokens included, already written) is kv_lens[i] tokens: first the pages
    warm_tables[i] of the warm tier (a long sequence's oldest pages, spilled there), then the hot
    pages page_tables[i]. Queries are the last q_len of those tokens (bottom-right causal alignment).
    """

    qo_indptr: list[int]
    page_tables: list[list[int]]
    kv_lens: list[int]
    page_size: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    device: torch.device
    warm_tables: list[list[int]] | None = None

    @property
    def spilled(self) -> bool:
        return bool(self.warm_tables) and any(self.warm_tables)

    def num_warm(self, i: int) -> int:
        return len(self.warm_tables[i]) if self.warm_tables else 0

    def hot_pages(self) -> list[list[int]]:
        """Each sequence's hot pages that hold its KV (its page table past the spilled ones, as
        many as its kv_len fills)."""
        ps = self.page_size
        return [p[:-(-n // ps) - self.num_warm(i)] for i, (p, n) in enumerate(zip(self.page_tables, self.kv_lens))]

    def padded_pages(self, used: list[list[int]], device) -> torch.Tensor:
        """The used page lists as one [sequences, longest] tensor, each padded with its first page."""
        width = max(len(p) for p in used)
        return torch.tensor([p + [p[0]] * (width - len(p)) for p in used], dtype=torch.long, device=device)

    @property
    def num_seqs(self) -> int:
        return len(self.kv_lens)

    @property
    def is_decode(self) -> bool:
        return all(self.qo_indptr[i + 1] - self.qo_indptr[i] == 1 for i in range(self.num_seqs))

    # FlashInfer's CSR page-table form (int32)
    def kv_indptr(self) -> torch.Tensor:
        out = [0]
        for pages, n in zip(self.page_tables, self.kv_lens):
            out.append(out[-1] + -(-n // self.page_size))
        return torch.tensor(out, dtype=torch.int32, device=self.device)

    def kv_indices(self) -> torch.Tensor:
        flat = [p for pages, n in zip(self.page_tables, self.kv_lens) for p in pages[:-(-n // self.page_size)]]
        return torch.tensor(flat, dtype=torch.int32, device=self.device)

    def kv_last_page_len(self) -> torch.Tensor:
        return torch.tensor([(n - 1) % self.page_size + 1 for n in self.kv_lens], dtype=torch.int32,
                            device=self.device)


def hot_tokens(cache: torch.Tensor, which: int, pages: torch.Tensor) -> torch.Tensor:
    """K (which=0) or V (1) of these hot pages, gathered: [pages * page_size, kv_heads, head_dim]. One
    index_select of whole pages (a memcpy each) on the layer's [2, pages, page_size, kv_heads, head_dim]."""
    return cache[which].index_select(0, pages).flatten(0, 1)


def warm_tokens(warm_cache: torch.Tensor, which: int, slots: torch.Tensor) -> torch.Tensor:
    """The same of warm slots, from the warm tier's page-first layer view [slots, 2, page_size, kv_heads,
    head_dim]."""
    return warm_cache.index_select(0, slots).select(1, which).flatten(0, 1)


class AttentionBackend(ABC):
    """plan() once per step, then run() once per layer with that layer's paged cache.

    A backend with supports_spill reads spilled pages from the warm tier's layer view too; one with
    reads_warm_in_place reads them there as fast as hot pages, so that a cached prefix in warm is
    attended where it lies instead of being copied up to hot first. `layer_ops`: the backend's own
    element-wise work between a layer's projections (engine.layer_ops.TorchLayerOps' interface, float32
    activations), or None for PyTorch's."""

    supports_spill = False
    reads_warm_in_place = False
    layer_ops = None

    @abstractmethod
    def plan(self, batch: AttentionBatch, dtype: torch.dtype) -> None: ...

    @abstractmethod
    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, warm_cache: torch.Tensor | None = None) -> torch.Tensor:
        """q [tokens, qo_heads, head_dim]; kv_cache the hot layer [2, pages, page_size, kv_heads, head_dim]
        (K, V), warm_cache the warm tier's layer view [slots, 2, page_size, kv_heads, head_dim]
        -> [tokens, qo_heads, head_dim]."""
