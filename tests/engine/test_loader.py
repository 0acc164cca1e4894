"""load_model (presets and Hugging Face directories), its errors, and the tokenizers."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"

from hfutil import run_prefill, write_hf_model  # noqa: E402

from engine.loader import load_model  # noqa: E402
from engine.sampler import InvalidRequest  # noqa: E402
from engine.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer  # noqa: E402
from kvstore.errors import ConfigError  # noqa: E402
from kvstore.pages.shapes import PRESETS  # noqa: E402

CPU = torch.device("cpu")
TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "  spaces\tand\nnewlines ",
         "Ünïcödé 🙂 text", ""]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_hf_model(tmp_path_factory.mktemp("llama") / "model", "llama", seed=0)


def copy_model(src, tmp_path):
    return shutil.copytree(src, tmp_path / "model")


# presets

def test_preset_weights_follow_the_seed():
    rng = torch.get_rng_state()
    a, b, c = (load_model("tiny", torch.float32, CPU, seed=s) for s in (0, 0, 1))
    assert torch.equal(torch.get_rng_state(), rng)          # the global RNG is left alone
    assert a.model_id == "preset:tiny:seed0" and c.model_id == "preset:tiny:seed1"
    sa, sb, sc = (m.model.state_dict() for m in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.self_attn.q_proj.weight"], sc["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(sa["model.norm.weight"], torch.ones(a.shape.hidden_size))
    assert not a.model.training and a.path is None and a.sliding_window is None
    assert isinstance(a.tokenizer, ByteTokenizer)


def test_tied_preset_shares_one_embedding(monkeypatch):
    monkeypatch.setitem(PRESETS, "tied", dataclasses.replace(PRESETS["tiny"], name="tied", tie_embeddings=True))
    for name in ("tied", "tiny"):
        net = load_model(name, torch.float32, CPU).model
        assert (net.lm_head.weight is net.model.embed_tokens.weight) == (name == "tied")
        assert net.lm_head.weight.std() > 0.01


def test_preset_in_bfloat16_keeps_rope_in_float32():
    loaded = load_model("tiny", torch.bfloat16, CPU)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.model.inv_freq.dtype == torch.float32
    logits = run_prefill(loaded.model, loaded.tokenizer.encode("hello"))
    assert logits.shape == (6, loaded.shape.vocab_size) and torch.isfinite(logits).all()


# Hugging Face directories

def test_model_id_binds_the_weights(llama_dir, tmp_path):
    other = write_hf_model(tmp_path / "model", "llama", seed=1)      # same name, same config
    assert (other / "config.json").read_text() == (llama_dir / "config.json").read_text()
    a, b = load_model(str(llama_dir), torch.float32, CPU), load_model(str(other), torch.float32, CPU)
    assert a.model_id.startswith("model:") and b.model_id.startswith("model:")
    assert a.model_id != b.model_id
    assert load_model(str(llama_dir), torch.float32, CPU).model_id == a.model_id
    assert a.path == llama_dir and isinstance(a.tokenizer, HFTokenizer)


def test_sharded_checkpoint_and_sliding_window(tmp_path):
    path = write_hf_model(tmp_path, "mistral", seed=0)
    assert (path / "model.safetensors.index.json").is_file()
    loaded = load_model(str(path), torch.float32, CPU)
    assert loaded.sliding_window == 4096
    (path / sorted(path.glob("model-*.safetensors"))[1].name).unlink()
    with pytest.raises(ConfigError, match=r"missing: model-00002-of-"):
        load_model(str(path), torch.float32, CPU)


def test_tied_checkpoint_with_lm_head_and_rotary_buffers_loads(tmp_path):
    from safetensors.torch import load_file, save_file

    path = write_hf_model(tmp_path, "qwen2", seed=0)
    state = load_file(path / "model.safetensors")
    assert "lm_head.weight" not in state
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    loaded = load_model(str(path), torch.float32, CPU)
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    assert torch.equal(loaded.model.lm_head.weight, state["model.embed_tokens.weight"])
    assert torch.equal(loaded.model.model.layers[0].self_attn.q_proj.bias,
                       state["model.layers.0.self_attn.q_proj.bias"])


@pytest.mark.parametrize("breakage, message", [
    ("no_config", "config.json"),
    ("no_weights", r"no \*\.safetensors"),
    ("architecture", "GPT2LMHeadModel.*architecture must be one of"),
    ("unexpected", "unexpected tensors: model.layers.0.extra.weight"),
    ("missing", "lacks tensors: model.layers.1.mlp.up_proj.weight"),
    ("wrong_shape", r"model.norm.weight \(32,\) != \(64,\)"),
    ("no_tokenizer", "tokenizer.json"),
    ("not_a_dir", "must be a preset"),
])
def test_broken_directories_raise_config_errors(llama_dir, tmp_path, breakage, message):
    from safetensors.torch import load_file, save_file

    path = copy_model(llama_dir, tmp_path)
    weights = path / "model.safetensors"
    if breakage == "no_config":
        (path / "config.json").unlink()
    elif breakage == "no_weights":
        weights.unlink()
    elif breakage == "architecture":
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(cfg | {"architectures": ["GPT2LMHeadModel"]}))
    elif breakage in ("unexpected", "missing", "wrong_shape"):
        state = load_file(weights)
        if breakage == "unexpected":
            state["model.layers.0.extra.weight"] = torch.zeros(2)
        elif breakage == "missing":
            del state["model.layers.1.mlp.up_proj.weight"]
        else:
            state["model.norm.weight"] = torch.ones(32)
        save_file(state, weights)
    elif breakage == "no_tokenizer":
        (path / "tokenizer.json").unlink()
    elif breakage == "not_a_dir":
        path = path / "nowhere"
    with pytest.raises(ConfigError, match=message):
        load_model(str(path), torch.float32, CPU)


# tokenizers

def test_byte_tokenizer_round_trips():
    tok = load_tokenizer("tiny")
    ids = tok.encode("héllo 🙂")
    assert ids[0] == tok.bos_token_id == 256 and max(ids[1:]) < 256
    assert tok.encode("hi", add_bos=False) == [104, 105]
    assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id]) == "héllo 🙂"
    assert tok.decode([0xFF, 104]) == "\ufffdh"          # broken UTF-8 is replaced, not raised
    assert tok.eos_token_ids == [257] and tok.vocab_size == 259
    chat = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert chat == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"


def test_hf_tokenizer_matches_transformers(llama_dir):
    from transformers import AutoTokenizer

    ours, ref = load_tokenizer(str(llama_dir)), AutoTokenizer.from_pretrained(llama_dir)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"]
        assert ids[0] == ours.bos_token_id == 0
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True) == text
    assert ours.encode("hello", add_bos=False) == ref("hello", add_special_tokens=False)["input_ids"]
    assert ours.vocab_size == len(ref) <= 320
    assert ours.eos_token_id == 1 and ours.eos_token_ids == [1]


def test_hf_chat_template_renders_as_transformers(llama_dir):
    from transformers import AutoTokenizer

    ours, ref = load_tokenizer(str(llama_dir)), AutoTokenizer.from_pretrained(llama_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]
    for prompt in (True, False):
        assert ours.apply_chat_template(messages, add_generation_prompt=prompt) == \
            ref.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
    assert ours.apply_chat_template(messages).startswith("<s><|system|>\nBe brief.</s>\n")
    with pytest.raises(InvalidRequest, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_is_compiled_once(llama_dir, monkeypatch):
    import jinja2.sandbox

    compiled = []
    original = jinja2.sandbox.ImmutableSandboxedEnvironment.from_string
    monkeypatch.setattr(jinja2.sandbox.ImmutableSandboxedEnvironment, "from_string",
                        lambda self, *a, **k: compiled.append(1) or original(self, *a, **k))
    tok = load_tokenizer(str(llama_dir))
    texts = {tok.apply_chat_template([{"role": "user", "content": f"question {i}"}]) for i in range(5)}
    assert len(texts) == 5 and len(compiled) == 1


def test_hf_tokenizer_eos_list_and_missing_template(llama_dir, tmp_path):
    path = copy_model(llama_dir, tmp_path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = HFTokenizer(path)
    assert tok.eos_token_id == 1 and tok.eos_token_ids == [1, 2]
    with pytest.raises(InvalidRequest, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert HFTokenizer(path).apply_chat_template([{"role": "user", "content": "Hi"}]) == "Hi"
