"""Attention backends over the hot tier's paged KV layout, behind one interface.

`torch` is the paged reference in plain PyTorch (any device), the exactness baseline; `native`
is a compiled CPU kernel that reads the pages in place (engine/attention/native.py, float32,
built for this machine on first use); `sdpa` runs PyTorch's fused flash attention over the same
pages in place, piece by piece, merged by log-sum-exp (any dtype); `flashinfer` uses FlashInfer's
paged kernels (CUDA only, imported lazily). `auto` picks flashinfer on CUDA when the package is
present, else native on the CPU where it can run (float32, a head_dim it is built for, a C++ compiler)
and is the faster one (an x86-64 CPU with AVX-512, or AVX2 and FMA), else sdpa. All take the same AttentionBatch and give the same results (within dtype tolerance).
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from engine.attention.base import AttentionBackend, AttentionBatch
from kvstore.errors import ConfigError

BACKENDS = ("auto", "flashinfer", "native", "sdpa", "torch")
log = logging.getLogger("kvstore.engine")


def create_backend(name: str, device: torch.device, dtype: torch.dtype = torch.float32,
                   head_dim: int | None = None, **kwargs) -> AttentionBackend:
    """The backend `name` for KV of this dtype and head_dim on this device (ConfigError when it cannot run)."""
    if name not in BACKENDS:
        raise ConfigError("engine.attention_backend", name, f"must be one of {', '.join(BACKENDS)}")
    if name == "auto":
        if device.type == "cuda":
            name = "flashinfer" if importlib.util.find_spec("flashinfer") else "sdpa"
        else:
            from engine.attention import native
            why = native.unsuitable(dtype, head_dim)
            if why:
                log.info("attention: sdpa (%s)", why)
            name = "sdpa" if why else "native"
    if name == "flashinfer":
        if device.type != "cuda":
            raise ConfigError("engine.attention_backend", name, "needs a CUDA device; use sdpa or torch on CPU")
        from engine.attention.flashinfer import FlashInferBackend
        return FlashInferBackend(device, **kwargs)
    if name == "native":
        from engine.attention import native
        why = "needs the CPU; use flashinfer or sdpa on CUDA" if device.type != "cpu" else native.available(dtype, head_dim)
        if why:
            raise ConfigError("engine.attention_backend", name, why)
        return native.NativeBackend()
    if name == "sdpa":
        from engine.attention.sdpa import SdpaBackend
        return SdpaBackend()
    from engine.attention.torch_ref import TorchBackend
    return TorchBackend()


__all__ = ["AttentionBackend", "AttentionBatch", "create_backend", "BACKENDS"]
