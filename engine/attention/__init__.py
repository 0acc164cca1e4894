"""Attention backends over the hot tier's paged KV layout, behind one interface.

`torch` is the paged reference in plain PyTorch (any device), the exactness baseline; `sdpa`
runs PyTorch's fused scaled_dot_product_attention over the same pages (the fast CPU path);
`flashinfer` uses FlashInfer's paged kernels (CUDA only, imported lazily). `auto` picks
flashinfer when CUDA and the package are present, else sdpa. All take the same AttentionBatch
and give the same results (within dtype tolerance).
"""

from __future__ import annotations

import importlib.util

import torch

from engine.attention.base import AttentionBackend, AttentionBatch
from kvstore.errors import ConfigError

BACKENDS = ("auto", "flashinfer", "sdpa", "torch")


def create_backend(name: str, device: torch.device, **kwargs) -> AttentionBackend:
    if name not in BACKENDS:
        raise ConfigError("engine.attention_backend", name, f"must be one of {', '.join(BACKENDS)}")
    if name == "auto":
        name = "flashinfer" if device.type == "cuda" and importlib.util.find_spec("flashinfer") else "sdpa"
    if name == "flashinfer":
        if device.type != "cuda":
            raise ConfigError("engine.attention_backend", name, "needs a CUDA device; use sdpa or torch on CPU")
        from engine.attention.flashinfer import FlashInferBackend
        return FlashInferBackend(device, **kwargs)
    if name == "sdpa":
        from engine.attention.sdpa import SdpaBackend
        return SdpaBackend()
    from engine.attention.torch_ref import TorchBackend
    return TorchBackend()


__all__ = ["AttentionBackend", "AttentionBatch", "create_backend", "BACKENDS"]
