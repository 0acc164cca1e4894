"""The test and benchmark harness (kvstore_vllm.testing): its sidecar fits the model it serves."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from kvstore_vllm.testing import HOT_PAGES, Sidecar, page_bytes

# a real model's shape (SmolLM2-135M): one 128-token float32 page of its 30 layers is 5.6 MiB
SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
           "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "head_dim": 64, "vocab_size": 49152, "max_position_embeddings": 8192, "rope_theta": 100000.0,
           "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "torch_dtype": "float32"}


def test_sidecar_for_a_30_layer_model_starts_and_holds_its_pages(tmp_path):
    model = tmp_path / "smollm2-shape"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMOLLM2))
    assert page_bytes(model, "float32", 128) == 30 * 2 * 128 * 3 * 64 * 4 > 4 << 20
    sock_dir = Path(tempfile.mkdtemp(prefix="kvh-"))   # a short path: a socket's stays under 108 bytes
    try:
        sidecar = Sidecar(model, tmp_path / "data", sock_dir / "kv.sock", block_size=128, warm_bytes="64MiB",
                          cold_bytes="256MiB")
        try:
            tiers = sidecar.stats()["tiers"]
            assert tiers["hot"]["capacity_bytes"] == HOT_PAGES * page_bytes(model, "float32", 128), tiers["hot"]
        finally:
            assert sidecar.stop() == 0
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
