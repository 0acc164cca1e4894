"""FlashInfer backend: paged prefill/append and decode kernels on the hot tier's NHD pages (K and V
apart: each layer is passed as the pair (K, V) of [pages, page_size, kv_heads, head_dim]).

Imported only when this backend is chosen on CUDA. plan() runs once per step (int32 page
tables, CSR form); run() once per layer. RoPE is applied by the model before K is written,
so the kernels run with pos_encoding_mode NONE. Causal masking in FlashInfer's append
attention is bottom-right aligned, as in the torch reference.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionBatch
from kvstore.errors import NotBuilt

try:
    import flashinfer
except ImportError as exc:  # pragma: no cover - depends on the machine
    raise ImportError("the flashinfer attention backend needs the flashinfer-python package "
                      "(pip install -e '.[gpu]'); use engine.attention_backend: torch") from exc

WORKSPACE_BYTES = 256 << 20


class FlashInferBackend(AttentionBackend):
    def __init__(self, device: torch.device):
        self.device = device
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        self.wrapper = None

    def plan(self, batch: AttentionBatch, dtype: torch.dtype) -> None:
        if batch.spilled:
            raise NotBuilt("the flashinfer backend cannot read pages spilled to the warm tier")
        indptr, indices, last = batch.kv_indptr(), batch.kv_indices(), batch.kv_last_page_len()
        if batch.is_decode:
            self.decode.plan(indptr, indices, last, batch.num_qo_heads, batch.num_kv_heads, batch.head_dim,
                             batch.page_size, pos_encoding_mode="NONE", q_data_type=dtype, kv_data_type=dtype)
            self.wrapper = self.decode
        else:
            qo = torch.tensor(batch.qo_indptr, dtype=torch.int32, device=self.device)
            self.prefill.plan(qo, indptr, indices, last, batch.num_qo_heads, batch.num_kv_heads, batch.head_dim,
                              batch.page_size, causal=True, pos_encoding_mode="NONE", q_data_type=dtype,
                              kv_data_type=dtype)
            self.wrapper = self.prefill

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, warm_cache: torch.Tensor | None = None) -> torch.Tensor:
        return self.wrapper.run(q.contiguous(), (kv_cache[0], kv_cache[1]))
