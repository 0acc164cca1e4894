"""load_model: a preset with seeded random weights, or a Hugging Face directory's safetensors."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model import LlamaModel, rope_inv_freq
from engine.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from kvstore.errors import ConfigError
from kvstore.pages.shapes import PRESETS, ModelShape, from_hf_config


@dataclass
class LoadedModel:
    model: LlamaModel               # eval mode, on its device, in its dtype
    shape: ModelShape
    tokenizer: ByteTokenizer | HFTokenizer
    model_id: str                   # the identity cache namespaces bind: never shared by two weight sets
    path: Path | None = None        # None for presets
    # Mistral's window: the engine does full attention, so it refuses sequences longer than this
    sliding_window: int | None = None


def load_model(model: str, dtype: torch.dtype, device: torch.device, seed: int = 0,
               prepack: bool = False) -> LoadedModel:
    """`model` is a preset name (kvstore.pages.shapes.PRESETS: random weights drawn from `seed`) or a
    Hugging Face model directory (config.json, *.safetensors, tokenizer.json). `prepack` also keeps
    the projections' weights in oneDNN's layout (CPU; engine.model.Projection)."""
    if model in PRESETS:
        shape = PRESETS[model]
        net = _random_model(shape, seed)
        return LoadedModel(_finish(net, dtype, device, prepack), shape, load_tokenizer(model),
                           f"preset:{model}:seed{seed}")
    path = Path(model)
    if not path.is_dir():
        raise ConfigError("model", model, f"must be a preset ({', '.join(PRESETS)}) or a model directory")
    shape, tokenizer, files = from_hf_config(path), load_tokenizer(model), _weight_files(path)
    net = _checkpoint_model(shape, files, dtype)
    return LoadedModel(_finish(net, dtype, device, prepack), shape, tokenizer,
                       f"{path.resolve().name}:{_digest(path / 'config.json', files)}", path,
                       shape.sliding_window)


def _random_model(shape: ModelShape, seed: int) -> LlamaModel:
    with torch.device("meta"):
        net = LlamaModel(shape)
    net.to_empty(device="cpu")
    _tie(net)
    gen = torch.Generator().manual_seed(seed)    # the global RNG stays untouched
    with torch.no_grad():
        for name, p in net.named_parameters():   # tied weights come once
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return net


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as exc:
            raise ConfigError("model", str(index), f"is not a valid safetensors index ({exc!r})") from None
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ConfigError("model", str(path), f"shards listed in {index.name} are missing: {', '.join(missing)}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError("model", str(path), "the model directory holds no *.safetensors weights")
    return files


def _checkpoint_model(shape: ModelShape, files: list[Path], dtype: torch.dtype) -> LlamaModel:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    # rotary inv_freq buffers are recomputed; a tied lm_head is the embedding
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if shape.tie_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        net = LlamaModel(shape)
    expected = {k: v.shape for k, v in net.state_dict().items()
                if not (shape.tie_embeddings and k == "lm_head.weight")}
    where = str(files[0].parent)
    if missing := sorted(expected.keys() - state.keys()):
        raise ConfigError("model", where, f"the checkpoint lacks tensors: {_names(missing)}")
    if unexpected := sorted(state.keys() - expected.keys()):
        raise ConfigError("model", where, f"the checkpoint has unexpected tensors: {_names(unexpected)}")
    if wrong := sorted(k for k in expected if state[k].shape != expected[k]):
        raise ConfigError("model", where, "tensor shapes do not match config.json: " + _names(
            [f"{k} {tuple(state[k].shape)} != {tuple(expected[k])}" for k in wrong]))
    net.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True, strict=False)
    _tie(net)
    return net


def _finish(net: LlamaModel, dtype: torch.dtype, device: torch.device, prepack: bool) -> LlamaModel:
    inv_freq = rope_inv_freq(net.shape)   # the model was built on the meta device
    net.inv_freq = inv_freq
    net.to(device=device, dtype=dtype)
    _tie(net)
    net.inv_freq = inv_freq.to(device)    # fp32 whatever the weights' dtype
    net.fuse(prepack)
    return net.eval()


def _tie(net: LlamaModel) -> None:
    if net.shape.tie_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight


def _digest(config: Path, files: list[Path]) -> str:
    """blake3 over config.json and every weight file's bytes: fine-tunes of one shape differ."""
    import blake3

    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for file in (config, *files):
        h.update(file.name.encode() + b"\0")
        h.update_mmap(file)
    return h.hexdigest()[:16]


def _names(items: list[str], limit: int = 8) -> str:
    more = f" (and {len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more
