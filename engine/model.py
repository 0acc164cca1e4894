"""A Llama-family decoder (Llama, Mistral, Qwen2): RMSNorm, RoPE, GQA, SwiGLU.

Parameter names follow Hugging Face's, so a checkpoint's state dict loads as it is. The model
is stateless between steps: K/V live in the hot tier's pages, written here (RoPE already
applied) before attention reads them through the backend.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, AttentionBatch
from kvstore.shapes import ModelShape


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(shape: ModelShape) -> torch.Tensor:
    d = shape.head_dim
    inv = 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = shape.rope_scaling
    if not s or s.get("rope_type", s.get("type")) in (None, "default"):
        return inv
    # Llama 3.1: scale long wavelengths down, keep short ones, blend in between
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        h, d = shape.hidden_size, shape.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, d
        self.q_proj = nn.Linear(h, shape.num_heads * d, bias=shape.qkv_bias)
        self.k_proj = nn.Linear(h, shape.num_kv_heads * d, bias=shape.qkv_bias)
        self.v_proj = nn.Linear(h, shape.num_kv_heads * d, bias=shape.qkv_bias)
        self.o_proj = nn.Linear(shape.num_heads * d, h, bias=False)

    def forward(self, x, cos, sin, kv_cache, write_pages, write_offsets, backend: AttentionBackend, warm_cache=None):
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q = (q * cos + rotate_half(q) * sin).to(x.dtype)
        k = (k * cos + rotate_half(k) * sin).to(x.dtype)
        # kv_cache: [pages, 2, page_size, kv_heads, head_dim]
        kv_cache[write_pages, 0, write_offsets] = k.to(kv_cache.dtype)
        kv_cache[write_pages, 1, write_offsets] = v.to(kv_cache.dtype)
        out = backend.run(q.to(kv_cache.dtype), kv_cache, warm_cache).to(x.dtype)
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        h, i = shape.hidden_size, shape.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape)


class Backbone(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


class LlamaModel(nn.Module):
    """forward(token ids, positions, batch, per-layer caches) -> logits of the requested rows."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.shape = shape
        self.model = Backbone(shape)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(shape), persistent=False)

    def rope(self, positions: torch.Tensor):
        freqs = positions.float()[:, None] * self.inv_freq[None, :].to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:, None, :], emb.sin()[:, None, :]   # [tokens, 1, head_dim]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_caches: list[torch.Tensor], backend: AttentionBackend,
                logit_rows: torch.Tensor | None = None, warm_caches: list[torch.Tensor] | None = None) -> torch.Tensor:
        ps = batch.page_size
        # where this step's tokens go: page (hot slot) and offset in it
        pages = torch.tensor([batch.page_tables[i][p // ps - batch.num_warm(i)]
                              for i in range(batch.num_seqs)
                              for p in range(batch.kv_lens[i] - (batch.qo_indptr[i + 1] - batch.qo_indptr[i]),
                                             batch.kv_lens[i])], dtype=torch.long, device=input_ids.device)
        offsets = positions.long() % ps
        backend.plan(batch, kv_caches[0].dtype)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions)
        warm_caches = warm_caches if batch.spilled else [None] * len(kv_caches)
        for layer, cache, warm in zip(self.model.layers, kv_caches, warm_caches):
            x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, cache, pages, offsets, backend, warm)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if logit_rows is not None:
            x = x[logit_rows]
        return self.lm_head(self.model.norm(x)).float()
