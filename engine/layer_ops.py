"""The element-wise work between a decoder layer's projections: the residual add and the RMSNorm
after it, RoPE with the write of K and V into the hot layer's pages, SwiGLU's silu(gate) * up.

TorchLayerOps does it in PyTorch ops, the reference arithmetic; an attention backend may bring
its own (AttentionBackend.layer_ops: the native backend's does each in one call of its library).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TorchLayerOps:
    """The element-wise work between a layer's projections, in PyTorch ops: the reference (a backend
    may bring its own, as the native one does: NativeLayerOps, the same arithmetic in fewer calls)."""

    @staticmethod
    def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, norm) -> torch.Tensor:
        """x += delta (the residual, in place), then norm(x) (an engine.model.RMSNorm)."""
        if delta is not None:
            x.add_(delta)
        return norm(x)

    @staticmethod
    def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                   write_rows: torch.Tensor, nh: int, nkv: int, d: int) -> torch.Tensor:
        """RoPE on the query and key heads of qkv [tokens, (nh + 2 nkv) d]; K and V written to their
        rows of the hot layer kv_cache [2, pages, page_size, nkv, d]; returns q [tokens, nh, d]."""
        t = qkv.shape[0]
        qk = qkv[:, :(nh + nkv) * d].view(t, nh + nkv, d)
        qk = (qk * cos + rotate_half(qk) * sin).to(qkv.dtype)   # query and key heads together
        q, k = qk[:, :nh], qk[:, nh:]
        v = qkv[:, (nh + nkv) * d:].view(t, nkv, d)
        rows = kv_cache.view(2, -1, nkv, d)   # write_rows: each token's row in this token view
        rows[0].index_copy_(0, write_rows, k.to(kv_cache.dtype))
        rows[1].index_copy_(0, write_rows, v.to(kv_cache.dtype))
        return q.to(kv_cache.dtype)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


TORCH_OPS = TorchLayerOps()
