"""The block <-> page copies and the page geometry, without an engine."""

from __future__ import annotations

import pytest
import torch

from kvstore.pages.spec import KVSpec
from kvstore_vllm.blocks import blocks_to_slots, check_layers, layer_order, slots_to_blocks

SPEC = KVSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", page_size=32)


def vllm_layers(num_blocks: int) -> list[torch.Tensor]:
    # vLLM CPU: [num_blocks, kv_heads, block_size, 2 * head_size] per layer, views of one buffer
    buf = torch.randn(SPEC.num_layers, num_blocks, 2, 32, 16)
    return [buf[i] for i in range(SPEC.num_layers)]


def test_blocks_round_trip_through_slots_byte_exactly():
    src, dst = vllm_layers(10), vllm_layers(10)
    pages = torch.zeros(6, *SPEC.page_shape)
    blocks_to_slots(src, [7, 2, 5], pages, [4, 0, 1])
    slots_to_blocks(pages, [4, 0, 1], dst, [1, 3, 9])
    for a, b in zip(src, dst):
        assert torch.equal(a[7], b[1]) and torch.equal(a[2], b[3]) and torch.equal(a[5], b[9])
    assert torch.count_nonzero(pages[[2, 3, 5]]) == 0   # other slots untouched


def test_check_layers_names_the_mismatch():
    layers = vllm_layers(4)
    check_layers(layers, ["a", "b", "c"], SPEC)
    with pytest.raises(ValueError, match="has 2 KV cache layers"):
        check_layers(layers[:2], ["a", "b"], SPEC)
    with pytest.raises(ValueError, match="layer b has blocks of"):
        check_layers([layers[0], layers[1].half(), layers[2]], ["a", "b", "c"], SPEC)


def test_layer_order_is_model_order():
    names = ["model.layers.10.self_attn.attn", "model.layers.2.self_attn.attn", "model.layers.0.self_attn.attn"]
    assert layer_order(names) == [names[2], names[1], names[0]]
