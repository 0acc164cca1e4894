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

from engine.attention import native
from engine.attention.base import AttentionBackend, AttentionBatch
from engine.layer_ops import TORCH_OPS, TorchLayerOps
from kvstore.pages.shapes import ModelShape


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:   # one fused op, the same arithmetic
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
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


def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for linears that read the same input: each linear's parameters become
    row views of it, so the state dict, its names and its loading are unchanged, and one GEMM
    replaces several. Returns the fused weight and bias."""
    weight = torch.cat([m.weight.detach() for m in linears])
    bias = None if linears[0].bias is None else torch.cat([m.bias.detach() for m in linears])
    at = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[at:at + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[at:at + n], requires_grad=False)
        at += n
    return weight, bias


PREPACK_DTYPES = (torch.float32, torch.bfloat16)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in PREPACK_DTYPES and torch.backends.mkldnn.is_available()


def native_linear_library(weight: torch.Tensor):
    """The native kernels' library when it should run this weight's projection (float32 on a CPU
    the kernels are tuned for: engine/attention/linear.cpp), else None."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or native.unsuitable(torch.float32):
        return None
    return native.load()


class Projection:
    """The GEMM of one or more linears that read the same input (their outputs side by side).

    Several linears are fused into one weight (theirs become views of it). With `prepack` the
    weight is also kept in a packed copy made once at load: float32 weights on a CPU with AVX-512
    or AVX2 in the native kernels' layout (linear.cpp: 1.3x oneDNN at decode's 8 rows with AVX-512,
    1.5x with AVX2; the same bits at any number of rows), other CPU weights in oneDNN's blocked layout (about 1.5x F.linear at small
    batches); the cost is a second copy of the weights in memory. The result differs from
    F.linear's only in the order of the sums. A later change of a linear's weight (a `.to()`, an
    assignment, an in-place load) is noticed and the linears then run one by one, so stale
    weights are never used.
    """

    def __init__(self, *linears: nn.Linear, prepack: bool = False):
        self.linears = linears
        if len(linears) > 1:
            self.weight, self.bias = fuse_linears(*linears)
        else:
            self.weight, self.bias = linears[0].weight.detach(), linears[0].bias
        self.packed = self.native = self.lib = self.bias_ptr = None
        if prepack and (lib := native_linear_library(self.weight)) is not None:
            n, k = self.weight.shape
            self.lib, self.native = lib, torch.empty(lib.kv_packed_linear_floats(n, k), dtype=torch.float32)
            if self.bias is not None:   # the fused bias (the linears' are views of it): read where it lies
                self.bias = self.bias.detach().contiguous()
                self.bias_ptr = self.bias.data_ptr()
            lib.kv_pack_linear(self.weight.contiguous().data_ptr(), n, k, self.native.data_ptr(), torch.get_num_threads())
        elif prepack:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 8)
        self._state = self._current()

    def _current(self) -> tuple:
        return tuple((m.weight.data_ptr(), m.weight._version) for m in self.linears)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._current() != self._state:
            return torch.cat([m(x) for m in self.linears], dim=-1)
        if (self.native is not None and x.dim() == 2 and x.stride(1) == 1 and x.dtype == torch.float32
                and x.shape[1] == self.weight.shape[1]):
            (m, k), n = x.shape, self.weight.shape[0]
            out = torch.empty((m, n), dtype=torch.float32)
            self.lib.kv_linear(x.data_ptr(), x.stride(0), m, self.native.data_ptr(), self.bias_ptr, n, k,
                               out.data_ptr(), n, torch.get_num_threads())
            return out
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        h, d = shape.hidden_size, shape.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, d
        self.q_proj = nn.Linear(h, shape.num_heads * d, bias=shape.qkv_bias)
        self.k_proj = nn.Linear(h, shape.num_kv_heads * d, bias=shape.qkv_bias)
        self.v_proj = nn.Linear(h, shape.num_kv_heads * d, bias=shape.qkv_bias)
        self.o_proj = nn.Linear(shape.num_heads * d, h, bias=False)
        self.qkv = self.out = None

    def fuse(self, prepack: bool) -> None:
        self.qkv = Projection(self.q_proj, self.k_proj, self.v_proj, prepack=prepack)
        self.out = Projection(self.o_proj, prepack=prepack)

    def forward(self, x, cos, sin, kv_cache, write_rows, backend: AttentionBackend, warm_cache=None,
                ops: TorchLayerOps = TORCH_OPS):
        t = x.shape[0]
        if self.qkv is not None:
            qkv = self.qkv(x)
        else:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        # kv_cache: [2, pages, page_size, kv_heads, head_dim]; write_rows: each token's row in its token view
        q = ops.rope_write(qkv, cos, sin, kv_cache, write_rows, self.num_heads, self.num_kv_heads, self.head_dim)
        out = backend.run(q, kv_cache, warm_cache).to(x.dtype).reshape(t, -1)
        return self.out(out) if self.out is not None else self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        h, i = shape.hidden_size, shape.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.gate_up = self.down = None

    def fuse(self, prepack: bool) -> None:
        self.gate_up = Projection(self.gate_proj, self.up_proj, prepack=prepack)
        self.down = Projection(self.down_proj, prepack=prepack)

    def forward(self, x, ops: TorchLayerOps = TORCH_OPS):
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down(ops.silu_mul(self.gate_up(x)))


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
        self.head: Projection | None = None

    def rope(self, positions: torch.Tensor):
        freqs = positions.float()[:, None] * self.inv_freq[None, :].to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:, None, :], emb.sin()[:, None, :]   # [tokens, 1, head_dim]

    def fuse(self, prepack: bool = False) -> None:
        """Fuse each layer's q/k/v and gate/up projections, and with `prepack` keep every projection's
        weight in oneDNN's layout too (CPU; see Projection). Call once the weights are on their device
        and in their dtype."""
        with torch.no_grad():
            for layer in self.model.layers:
                layer.self_attn.fuse(prepack)
                layer.mlp.fuse(prepack)
            self.head = Projection(self.lm_head, prepack=prepack)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_caches: list[torch.Tensor], backend: AttentionBackend,
                logit_rows: torch.Tensor | None = None, warm_caches: list[torch.Tensor] | None = None) -> torch.Tensor:
        ps = batch.page_size
        rows = torch.tensor(write_pages(batch), dtype=torch.long, device=input_ids.device) * ps + positions.long() % ps
        backend.plan(batch, kv_caches[0].dtype)
        x = self.model.embed_tokens(input_ids)   # a new tensor: the residual stream, added to in place
        cos, sin = self.rope(positions)
        warm_caches = warm_caches if batch.spilled else [None] * len(kv_caches)
        ops = backend.layer_ops if backend.layer_ops is not None and x.dtype == torch.float32 else TORCH_OPS
        layers = self.model.layers
        h = ops.add_rms_norm(x, None, layers[0].input_layernorm)
        for i, (layer, cache, warm) in enumerate(zip(layers, kv_caches, warm_caches)):
            h = ops.add_rms_norm(x, layer.self_attn(h, cos, sin, cache, rows, backend, warm, ops),
                                 layer.post_attention_layernorm)
            out = layer.mlp(h, ops)
            if i + 1 < len(layers):
                h = ops.add_rms_norm(x, out, layers[i + 1].input_layernorm)
            else:
                x.add_(out)
        if logit_rows is not None:
            x = x[logit_rows]
        x = ops.add_rms_norm(x, None, self.model.norm)
        return (self.head(x) if self.head is not None else self.lm_head(x)).float()


def write_pages(batch: AttentionBatch) -> list[int]:
    """The hot page (slot) each of this step's tokens is written to, page by page."""
    ps, out = batch.page_size, []
    for i in range(batch.num_seqs):
        n, q = batch.kv_lens[i], batch.qo_indptr[i + 1] - batch.qo_indptr[i]
        table, warm = batch.page_tables[i], batch.num_warm(i)
        for page in range((n - q) // ps, (n - 1) // ps + 1):
            out += [table[page - warm]] * (min(n, (page + 1) * ps) - max(n - q, page * ps))
    return out
