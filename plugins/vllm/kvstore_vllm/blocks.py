"""Copies between vLLM's paged KV cache and the kvstore sidecar's warm slots.

A vLLM block of one layer (on the CPU: [num_kv_heads, block_size, 2 * head_size]) holds exactly
the bytes of one layer of a kvstore page ([2, page_size, kv_heads, head_dim]) when the page size
is the block size: the connector stores each layer's block as opaque bytes in that layer's part of
a page and names vLLM's layout in the namespace, so such pages are never read as kvstore's own.
"""

from __future__ import annotations

import re
from typing import Sequence

import torch

from kvstore.pages.spec import KVSpec

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_order(names: Sequence[str]) -> list[str]:
    """Layer names in model order (by the first number in the name: model.layers.<i>.self_attn...)."""
    def key(name: str) -> tuple[int, str]:
        m = _LAYER_INDEX.search(f".{name}.")
        return (int(m.group(1)) if m else -1, name)
    return sorted(names, key=key)


def check_layers(layers: Sequence[torch.Tensor], names: Sequence[str], spec: KVSpec) -> None:
    """Each layer's block must be one layer of a page, byte for byte; say which one is not."""
    if len(layers) != spec.num_layers:
        raise ValueError(f"kvstore connector: vLLM has {len(layers)} KV cache layers, the page spec "
                         f"{spec.num_layers}")
    per_layer = spec.page_bytes // spec.num_layers
    for name, layer in zip(names, layers):
        block_bytes = layer[0].numel() * layer.element_size()
        if layer.dtype != spec.torch_dtype or block_bytes != per_layer:
            raise ValueError(f"kvstore connector: KV cache layer {name} has blocks of {list(layer.shape[1:])} "
                             f"{layer.dtype} ({block_bytes} bytes); expected {per_layer} bytes of {spec.dtype} "
                             f"({spec.describe()})")


def blocks_to_slots(layers: Sequence[torch.Tensor], block_ids: Sequence[int], pages: torch.Tensor,
                    slots: Sequence[int]) -> None:
    """Copy blocks block_ids[i] of every layer into warm slot slots[i] (pages: [slots, *page_shape])."""
    if not block_ids:
        return
    src = torch.tensor(list(block_ids), dtype=torch.long)
    dst = torch.tensor(list(slots), dtype=torch.long)
    page_layer = pages.shape[2:]
    for i, layer in enumerate(layers):
        pages[dst, i] = layer.index_select(0, src).view(len(src), *page_layer)


def slots_to_blocks(pages: torch.Tensor, slots: Sequence[int], layers: Sequence[torch.Tensor],
                    block_ids: Sequence[int]) -> None:
    """Copy warm slot slots[i] into block block_ids[i] of every layer."""
    if not block_ids:
        return
    src = torch.tensor(list(slots), dtype=torch.long)
    dst = torch.tensor(list(block_ids), dtype=torch.long)
    for i, layer in enumerate(layers):
        layer.index_copy_(0, dst, pages[src, i].reshape(len(src), *layer.shape[1:]))
