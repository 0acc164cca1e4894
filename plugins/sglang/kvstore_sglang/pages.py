"""PageMap: how the pages of one SGLang host pool (HiCache's L2) map onto kvstore pages.

A kvstore page holds one SGLang page of every layer of this rank, in one byte order whatever the
host pool's layout, so pools of different layouts share pages:

    MHA: [2 (K, V), layers, page_size, kv_heads, head_dim]
    MLA: [layers, page_size, 1, kv_lora_rank + qk_rope_head_dim]

Host layouts: layer_first, page_first and page_first_direct. host_pages(index, n) is a view of n
consecutive host pages in that order (no copy), so a run of pages moves in one strided copy.
The sidecar's geometry must be this page's: an MHA page is the KVSpec (layers, kv_heads, head_dim,
dtype, page_size); an MLA page, whose one latent row is not split into K and V, is described to it
as one KV head of half the row (the same bytes).
"""

from __future__ import annotations

import torch

from kvstore.pages.spec import KVSpec

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
          torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}


class PageMap:
    def __init__(self, pool, mla: bool):
        self.mla = mla
        self.layout = getattr(pool, "layout", None)
        if self.layout not in LAYOUTS:
            raise ValueError(f"kvstore: the HiCache host layout {self.layout!r} is not supported; use "
                             f"--hicache-mem-layout with one of {', '.join(LAYOUTS)}")
        if pool.dtype not in DTYPES:
            raise ValueError(f"kvstore: the KV dtype {pool.dtype} is not supported (one of "
                             f"{', '.join(map(str, DTYPES))})")
        if getattr(pool, "dcp_size", 1) > 1:
            raise ValueError("kvstore: decode context parallelism (DCP) host pools are not supported")
        self.buffer: torch.Tensor = pool.kv_buffer
        self.page_size, self.layers, self.dtype = pool.page_size, pool.layer_num, pool.dtype
        if mla:
            self.row = pool.kv_cache_dim
            if self.row % 2:
                raise ValueError(f"kvstore: an MLA row of {self.row} values does not split into two halves")
            self.shape = (self.layers, self.page_size, 1, self.row)
            self.spec = KVSpec(self.layers, 1, self.row // 2, DTYPES[self.dtype], self.page_size)
        else:
            if getattr(pool, "v_head_dim", pool.head_dim) != pool.head_dim:
                raise ValueError(f"kvstore: K and V head dims differ ({pool.head_dim}, {pool.v_head_dim})")
            self.shape = (2, self.layers, self.page_size, pool.head_num, pool.head_dim)
            self.spec = KVSpec(self.layers, pool.head_num, pool.head_dim, DTYPES[self.dtype], self.page_size)
        self.kind = "mla" if mla else "mha"

    def host_pages(self, index: int, n: int) -> torch.Tensor:
        """[n, *shape]: a view of the n host pages from token index `index` (a page start)."""
        b, ps, i = self.buffer, self.page_size, index
        if self.layout == "page_first_direct":
            p = i // ps
            return b[:, p:p + n].transpose(0, 1) if not self.mla else b[p:p + n]
        if self.mla:
            if self.layout == "layer_first":   # [layers, size, 1, row]
                return b[:, i:i + n * ps].unflatten(1, (n, ps)).transpose(0, 1)
            return b[i:i + n * ps].unflatten(0, (n, ps)).transpose(1, 2)   # page_first: [size, layers, 1, row]
        if self.layout == "layer_first":       # [2, layers, size, heads, dim]
            return b[:, :, i:i + n * ps].unflatten(2, (n, ps)).permute(2, 0, 1, 3, 4, 5)
        return b[:, i:i + n * ps].unflatten(1, (n, ps)).permute(1, 0, 3, 2, 4, 5)   # page_first: [2, size, layers, ...]

    def from_flat(self, flat: torch.Tensor) -> torch.Tensor:
        """[*shape]: a view of one page as the host pool's get_data_page(flat=True) lays it out."""
        if self.layout != "page_first":
            return flat.view(self.shape)
        if self.mla:   # [page_size, layers, 1, row]
            return flat.view(self.page_size, self.layers, 1, self.row).transpose(0, 1)
        s = self.shape   # [2, page_size, layers, heads, dim]
        return flat.view(2, self.page_size, self.layers, s[3], s[4]).transpose(1, 2)

    def describe(self) -> str:
        s = self.spec
        return (f"{s.num_layers} layers, {s.num_kv_heads} KV heads of {s.head_dim}, {s.dtype}, "
                f"pages of {s.page_size} tokens")
