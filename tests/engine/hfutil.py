"""Engine test helpers: random-weight Hugging Face model directories, and running engine/model.py
directly over a plain paged cache (page tables [0, 1, 2, ...], page size 16)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

os.environ["HF_HUB_OFFLINE"] = "1"   # nothing is downloaded

from engine.attention import AttentionBatch, create_backend  # noqa: E402
from engine.model import LlamaModel  # noqa: E402

PAGE_SIZE = 16
ARCHS = ("llama", "llama3", "mistral", "qwen2")
SPECIALS = ["<s>", "</s>", "<pad>"]    # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Pages move between the hot, warm and cold tiers of the KV cache.",
    "Long documents, many questions: the prefix is computed once and reused.",
    "Ünïcödé tëxt and emoji 🙂 keep the byte-level fallback honest.",
] * 4


def write_hf_model(path: str | Path, arch: str = "llama", seed: int = 0) -> Path:
    """A small random-weight checkpoint written by transformers (float32 safetensors) with a
    tokenizer. "llama3" adds Llama-3.1 rope scaling (original context 32); "qwen2" has non-zero
    q/k/v biases and tied embeddings; "mistral" is saved in shards with an index."""
    import transformers

    path = Path(path)
    common = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=256,
                  rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    if arch in ("llama", "llama3"):
        config = transformers.LlamaConfig(**common | dict(num_hidden_layers=3))
        if arch == "llama3":
            config = transformers.LlamaConfig(**common | dict(num_hidden_layers=3, rope_scaling=dict(
                rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=32)))
        cls = transformers.LlamaForCausalLM
    elif arch == "mistral":
        config, cls = transformers.MistralConfig(**common, sliding_window=4096), transformers.MistralForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6)
        cls = transformers.Qwen2ForCausalLM
    else:
        raise ValueError(f"arch must be one of {ARCHS}")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = cls(config).float()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():     # weights strong enough that greedy choices are clear-cut, norms not all ones
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.1 * noise)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="100KB" if arch == "mistral" else "1GB")
    write_tokenizer(path)
    return path


def write_tokenizer(path: str | Path) -> None:
    """A byte-level BPE (about 300 tokens) adding <s> in front, plus tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 0)])
    path = Path(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        chat_template=CHAT_TEMPLATE)))


def new_caches(model: LlamaModel, tokens: int) -> list[torch.Tensor]:
    """One zeroed paged cache per layer for a sequence of up to `tokens` tokens."""
    s, p = model.shape, next(model.parameters())
    pages = -(-tokens // PAGE_SIZE)
    return [torch.zeros(2, pages, PAGE_SIZE, s.num_kv_heads, s.head_dim, dtype=p.dtype, device=p.device)
            for _ in range(s.num_layers)]


def step(model: LlamaModel, caches: list[torch.Tensor], token_ids: list[int], start: int,
         backend: str = "torch") -> torch.Tensor:
    """Run tokens at positions start.. of one sequence (the first `start` already cached) -> fp32
    logits [len(token_ids), vocab], through the named attention backend."""
    s, p = model.shape, next(model.parameters())
    device = p.device
    n = start + len(token_ids)
    batch = AttentionBatch(qo_indptr=[0, len(token_ids)], page_tables=[list(range(caches[0].shape[1]))],
                           kv_lens=[n], page_size=PAGE_SIZE, num_qo_heads=s.num_heads,
                           num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, device=device)
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    positions = torch.arange(start, n, device=device)
    return model(ids, positions, batch, caches, create_backend(backend, device, p.dtype, s.head_dim))


def run_prefill(model: LlamaModel, token_ids: list[int], backend: str = "torch") -> torch.Tensor:
    """Logits [T, vocab] of a whole prompt in one prefill step."""
    return step(model, new_caches(model, len(token_ids)), token_ids, 0, backend)


def greedy(model: LlamaModel, token_ids: list[int], n: int, backend: str = "torch") -> list[int]:
    """n greedy tokens: one prefill, then one decode step per token through the paged cache."""
    caches = new_caches(model, len(token_ids) + n)
    out = [int(step(model, caches, token_ids, 0, backend)[-1].argmax())]
    while len(out) < n:
        pos = len(token_ids) + len(out) - 1
        out.append(int(step(model, caches, [out[-1]], pos, backend)[-1].argmax()))
    return out
