"""Model shapes (presets, config.json) and hash-chained page keys."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, clean_env

from kvstore.errors import ConfigError
from kvstore.pages.keys import KEY_BYTES, Namespace, chain_key, page_keys
from kvstore.pages.shapes import PRESETS, from_hf_config, load_shape

MIB = 1 << 20


# shapes

def test_llama_3_8b_page_is_2_mib_at_bf16():
    spec = PRESETS["llama-3-8b"].kv_spec("bf16", 16)
    assert spec.token_bytes == 2 * 32 * 8 * 128 * 2 == 131072
    assert spec.page_bytes == 2 * MIB
    assert spec.page_shape == (32, 2, 16, 8, 128)


@pytest.mark.parametrize("name, layers, kv_heads, head_dim", [
    ("llama-3-70b", 80, 8, 128), ("qwen2-7b", 28, 4, 128), ("mistral-7b", 32, 8, 128), ("tiny", 2, 2, 16),
])
def test_preset_kv_bytes(name, layers, kv_heads, head_dim):
    spec = load_shape(name).kv_spec("fp16", 16)
    assert spec.page_bytes == 2 * layers * kv_heads * head_dim * 2 * 16
    assert load_shape(name).kv_spec("fp32", 16).page_bytes == 2 * spec.page_bytes


def test_preset_parameter_counts_are_plausible():
    assert 8.0e9 < PRESETS["llama-3-8b"].num_params < 8.1e9
    assert 70e9 < PRESETS["llama-3-70b"].num_params < 71e9
    assert 7.0e9 < PRESETS["qwen2-7b"].num_params < 7.7e9


def _write_config(directory, **cfg):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


LLAMA = dict(architectures=["LlamaForCausalLM"], num_hidden_layers=16, hidden_size=2048,
             num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
             rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True)
QWEN2 = dict(architectures=["Qwen2ForCausalLM"], num_hidden_layers=24, hidden_size=896,
             num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
             rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True)


def test_llama_config_json(tmp_path):
    shape = from_hf_config(_write_config(tmp_path / "llama-1b", **LLAMA))
    assert (shape.name, shape.num_layers, shape.num_heads, shape.num_kv_heads) == ("llama-1b", 16, 32, 8)
    assert shape.head_dim == 2048 // 32 == 64
    assert shape.tie_embeddings and not shape.qkv_bias and shape.rope_theta == 500000.0
    assert shape.kv_spec("bf16", 16).page_bytes == 2 * 16 * 8 * 64 * 2 * 16
    assert load_shape(str(tmp_path / "llama-1b")) == shape


def test_qwen2_config_json_with_gqa(tmp_path):
    shape = from_hf_config(_write_config(tmp_path / "qwen", **QWEN2))
    assert shape.architecture == "Qwen2ForCausalLM" and shape.qkv_bias
    assert (shape.num_heads, shape.num_kv_heads, shape.head_dim) == (14, 2, 64)


def test_explicit_head_dim_wins(tmp_path):
    shape = from_hf_config(_write_config(tmp_path / "m", **{**LLAMA, "head_dim": 128}))
    assert shape.head_dim == 128


def test_missing_kv_heads_means_multi_head_attention(tmp_path):
    cfg = {k: v for k, v in LLAMA.items() if k != "num_key_value_heads"}
    assert from_hf_config(_write_config(tmp_path / "m", **cfg)).num_kv_heads == 32


def test_unsupported_architecture_is_named(tmp_path):
    directory = _write_config(tmp_path / "gpt2", **{**LLAMA, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ConfigError, match="GPT2LMHeadModel"):
        from_hf_config(directory)


def test_missing_config_json(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        from_hf_config(tmp_path)
    with pytest.raises(ConfigError, match="preset"):
        load_shape(str(tmp_path / "absent"))


def test_config_json_missing_a_field(tmp_path):
    cfg = {k: v for k, v in LLAMA.items() if k != "intermediate_size"}
    with pytest.raises(ConfigError, match="intermediate_size"):
        from_hf_config(_write_config(tmp_path / "m", **cfg))


# keys

NS = Namespace(model="llama-3-8b", kv_dtype="bfloat16")
TOKENS = list(range(1000, 1000 + 16 * 4 + 5))   # 4 full pages and 5 tokens


def test_only_full_pages_get_keys():
    assert len(page_keys(NS, TOKENS, 16)) == 4
    assert page_keys(NS, TOKENS[:15], 16) == []
    assert len(page_keys(NS, TOKENS[:16], 16)) == 1
    assert all(len(k) == KEY_BYTES for k in page_keys(NS, TOKENS, 16))


def test_keys_are_a_chain():
    keys = page_keys(NS, TOKENS, 16)
    assert keys[0] == chain_key(NS.digest, NS.digest, TOKENS[:16])
    for i in range(1, 4):
        assert keys[i] == chain_key(NS.digest, keys[i - 1], TOKENS[16 * i:16 * (i + 1)])
    assert page_keys(NS, TOKENS, 16, start=2, parent=keys[1]) == keys[2:]
    with pytest.raises(ValueError):
        page_keys(NS, TOKENS, 16, start=2)


def test_a_key_depends_on_every_earlier_page():
    keys = page_keys(NS, TOKENS, 16)
    for page in range(4):
        changed = list(TOKENS)
        changed[page * 16 + 3] += 1
        other = page_keys(NS, changed, 16)
        assert other[:page] == keys[:page]                      # pages before the change keep their keys
        assert all(a != b for a, b in zip(other[page:], keys[page:]))  # it and every later page change


def test_same_pages_at_different_positions_differ():
    page = TOKENS[:16]
    keys = page_keys(NS, page * 3, 16)
    assert len(set(keys)) == 3


@pytest.mark.parametrize("other", [
    Namespace(model="llama-3-8b", kv_dtype="bfloat16", tenant="acme"),
    Namespace(model="llama-3-8b", kv_dtype="bfloat16", salt="s1"),
    Namespace(model="mistral-7b", kv_dtype="bfloat16"),
    Namespace(model="llama-3-8b", kv_dtype="float16"),
    Namespace(model="llama-3-8b", kv_dtype="bfloat16", layout="page-first-v2"),
])
def test_namespace_separates_keys(other):
    assert set(page_keys(other, TOKENS, 16)).isdisjoint(page_keys(NS, TOKENS, 16))


def test_namespace_fields_do_not_run_together():
    a = Namespace(model="ab", kv_dtype="c")
    b = Namespace(model="a", kv_dtype="bc")
    assert a.digest != b.digest


def test_namespace_for_spec_binds_the_geometry():
    spec = PRESETS["llama-3-8b"].kv_spec("bf16", 16)
    a = Namespace.for_spec("m", spec)
    b = Namespace.for_spec("m", spec.replace(page_size=32))
    assert a.kv_dtype == "bfloat16" and a.digest != b.digest
    assert Namespace.for_spec("m", spec, tenant="t") == a.with_tenant("t")


_KEYS_SCRIPT = """
from kvstore.pages.keys import Namespace, page_keys
ns = Namespace(model="llama-3-8b", kv_dtype="bfloat16", tenant="t1", salt="s")
print(" ".join(k.hex() for k in page_keys(ns, list(range(1000, 1069)), 16)))
"""


def test_keys_are_identical_across_processes():
    outputs = []
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", _KEYS_SCRIPT], capture_output=True, text=True,
                             env=clean_env(PYTHONHASHSEED=seed), cwd=REPO, timeout=120)
        assert out.returncode == 0, out.stderr
        outputs.append(out.stdout.split())
    ns = Namespace(model="llama-3-8b", kv_dtype="bfloat16", tenant="t1", salt="s")
    here = [k.hex() for k in page_keys(ns, TOKENS, 16)]
    assert outputs[0] == outputs[1] == here and len(here) == 4
