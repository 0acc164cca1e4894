"""Attention backends over the hot tier's paged KV layout, behind one interface.

`torch` is the paged reference in plain PyTorch (any device); `flashinfer` uses FlashInfer's
paged kernels (CUDA only, imported lazily). `auto` picks flashinfer when CUDA and the package
are present, else torch. Both take the same AttentionBatch and give the same results
(within dtype tolerance).
"""

from __future__ import annotations

import importlib.util

import torch

from engine.attention.base import AttentionBackend, AttentionBatch
from kvstore.errors import ConfigError

BACKENDS = ("auto", "flashinfer", "torch")


def create_backend(name: str, device: torch.device, **kwargs) -> AttentionBackend:
    if name not in BACKENDS:
        raise ConfigError("engine.attention_backend", name, f"must be one of {', '.join(BACKENDS)}")
    if name == "auto":
        name = "flashinfer" if device.type == "cuda" and importlib.util.find_spec("flashinfer") else "torch"
    if name == "flashinfer":
        if device.type != "cuda":
            raise ConfigError("engine.attention_backend", name, "needs a CUDA device; use torch on CPU")
        from engine.attention.flashinfer import FlashInferBackend
        return FlashInferBackend(device, **kwargs)
    from engine.attention.torch_ref import TorchBackend
    return TorchBackend()


__all__ = ["AttentionBackend", "AttentionBatch", "create_backend", "BACKENDS"]
