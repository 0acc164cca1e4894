"""KVSpec: the geometry of one page of KV cache, and how many bytes it takes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

from typing import TYPE_CHECKING

import blake3

from kvstore.errors import ConfigError

if TYPE_CHECKING:
    import torch

# name (torch's) -> bytes per element. torch itself loads only when a tensor is made, so that the
# config and the commands that only read it (plan, config, --help) start at once.
DTYPES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
                 "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}

# Bumped whenever the page-first byte layout changes; part of every namespace and fingerprint.
LAYOUT_VERSION = "page-first-v1"


def canonical_dtype(name: str, key: str = "dtype") -> str:
    name = DTYPE_ALIASES.get(str(name).lower(), str(name).lower())
    if name not in DTYPES:
        raise ConfigError(key, name, f"must be one of {', '.join(DTYPES)} (or fp32, fp16, bf16, fp8)")
    return name


def is_power_of_two(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class KVSpec:
    """Page geometry. A page holds K and V of `page_size` tokens for every layer.

    Hot layout (one tensor per layer, FlashInfer NHD, K and V apart): [2, num_pages, page_size, kv_heads, head_dim].
    Warm/cold layout (page-first): one page is [layers, 2, page_size, kv_heads, head_dim], contiguous.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    page_size: int = 16

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(name, value, "must be a positive integer")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if not is_power_of_two(self.page_size):
            raise ConfigError("page_size", self.page_size, "must be a positive power of two (e.g. 16)")

    @property
    def torch_dtype(self) -> "torch.dtype":
        import torch

        return getattr(torch, self.dtype)

    @cached_property
    def itemsize(self) -> int:
        return DTYPES[self.dtype]

    @cached_property
    def token_bytes(self) -> int:
        """KV bytes per token: 2 (K,V) x layers x kv_heads x head_dim x itemsize."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

    @cached_property
    def page_bytes(self) -> int:
        return self.token_bytes * self.page_size

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """Page-first shape of one page: [layers, 2, page_size, kv_heads, head_dim]."""
        return (self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)

    def layer_shape(self, num_pages: int) -> tuple[int, int, int, int, int]:
        """Hot (NHD, K and V apart) shape of one layer: [2, num_pages, page_size, kv_heads, head_dim]."""
        return (2, num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @cached_property
    def fingerprint(self) -> bytes:
        """16 bytes naming this geometry and layout; stored in every cold record."""
        text = (f"{LAYOUT_VERSION}|L{self.num_layers}|H{self.num_kv_heads}|D{self.head_dim}"
                f"|{self.dtype}|P{self.page_size}")
        return blake3.blake3(text.encode()).digest(16)

    def replace(self, **changes) -> "KVSpec":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        return (f"{self.num_layers} layers x {self.num_kv_heads} kv heads x {self.head_dim} head dim, "
                f"{self.dtype}, {self.page_size} tokens/page = {self.page_bytes} bytes/page")
