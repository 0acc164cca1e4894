"""Model shapes: named presets and Hugging Face `config.json`, turned into a KVSpec."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.errors import ConfigError
from kvstore.pages.spec import KVSpec

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama-family decoder (Llama, Mistral, Qwen2)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool = False
    qkv_bias: bool = False
    rope_theta: float = 10000.0
    max_position: int = 4096
    architecture: str = "LlamaForCausalLM"
    rms_norm_eps: float = 1e-5
    rope_scaling: dict | None = field(default=None, compare=False, hash=False)  # e.g. Llama-3's "llama3"
    sliding_window: int | None = None

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings, attention, SwiGLU MLP, RMSNorms, LM head unless tied)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0)
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_size * h
        head = 0 if self.tie_embeddings else self.vocab_size * h
        return embed + self.num_layers * per_layer + h + head

    def kv_spec(self, dtype: str = "bfloat16", page_size: int = 16) -> KVSpec:
        return KVSpec(self.num_layers, self.num_kv_heads, self.head_dim, dtype, page_size)


PRESETS: dict[str, ModelShape] = {s.name: s for s in (
    # For tests: tiny and quick on any CPU.
    ModelShape("tiny", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
               intermediate_size=128, vocab_size=512),
    # About 100M parameters, for CPU benchmarks.
    ModelShape("small", num_layers=14, hidden_size=768, num_heads=12, num_kv_heads=4, head_dim=64,
               intermediate_size=2048, vocab_size=8192, max_position=16384),
    # Real shapes, for planning.
    ModelShape("llama-3-8b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
               intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, max_position=8192),
    ModelShape("llama-3-70b", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, head_dim=128,
               intermediate_size=28672, vocab_size=128256, rope_theta=500000.0, max_position=8192),
    ModelShape("qwen2-7b", num_layers=28, hidden_size=3584, num_heads=28, num_kv_heads=4, head_dim=128,
               intermediate_size=18944, vocab_size=152064, qkv_bias=True, rope_theta=1000000.0,
               max_position=32768, architecture="Qwen2ForCausalLM"),
    ModelShape("mistral-7b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
               intermediate_size=14336, vocab_size=32000, rope_theta=1000000.0, max_position=32768,
               architecture="MistralForCausalLM"),
)}


def from_hf_config(path: str | Path) -> ModelShape:
    """Read a Hugging Face model directory's (or file's) config.json."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError("model", str(path), "must be a preset name or a directory holding config.json")
    try:
        cfg = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError("model", str(file), f"config.json is not readable JSON ({exc})") from None
    archs = cfg.get("architectures") or ["LlamaForCausalLM"]
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ConfigError("model", archs[0], f"architecture must be one of {', '.join(SUPPORTED_ARCHITECTURES)}")
    # transformers 5 writes rope_parameters; earlier versions rope_theta and rope_scaling
    rope = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling and scaling.get("rope_type", scaling.get("type")) not in ("llama3", "default", None):
        raise ConfigError("model", str(file), f"rope scaling {scaling.get('rope_type', scaling.get('type'))!r} "
                          "is not supported (supported: llama3)")
    if cfg.get("mlp_bias") or (archs[0] != "Qwen2ForCausalLM" and cfg.get("attention_bias")):
        raise ConfigError("model", str(file), "attention or MLP biases are supported only as in Qwen2")
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return ModelShape(
            name=path.name if path.is_dir() else path.parent.name,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=archs[0] == "Qwen2ForCausalLM",
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            max_position=int(cfg.get("max_position_embeddings", 4096)),
            architecture=archs[0],
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_scaling=scaling,
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
        )
    except KeyError as exc:
        raise ConfigError("model", str(file), f"config.json lacks {exc.args[0]}") from None


def load_shape(model: str) -> ModelShape:
    """A preset name (see PRESETS) or a path to a Hugging Face model directory."""
    if model in PRESETS:
        return PRESETS[model]
    if Path(model).exists():
        return from_hf_config(model)
    raise ConfigError("model", model, f"must be a preset ({', '.join(PRESETS)}) or a model directory")
