"""What the engine benchmarks share (long_doc_qa.py, decode.py, compare.py): synthetic token ids,
transformers on the engine's own weights, the engine built from the command line's options, and the
small helpers of timing, rounding, progress and option checks.
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import sys
from typing import Callable

import torch

from engine.llm import LLM
from kvstore.config import parse_set
from kvstore.errors import ConfigError, KVStoreError
from kvstore.pages.shapes import PRESETS, load_shape

MiB, GiB = 1 << 20, 1 << 30


class Mismatch(KVStoreError):
    """Tokens that must agree do not: the timings compare different computations."""


# inputs
def token_pool(llm) -> list[int]:
    """Ids a synthetic prompt draws from: what the tokenizer can produce, minus its special ids."""
    tok = llm.tokenizer
    special = {tok.bos_token_id, *tok.eos_token_ids, getattr(tok, "pad_token_id", None)}
    return [i for i in range(llm.runner.vocab_limit) if i not in special]


def synthetic(pool: list[int], n: int, seed: int, bos: int | None = None) -> list[int]:
    rng = random.Random(seed)
    head = [bos] if bos is not None and n > 0 else []
    return head + [pool[rng.randrange(len(pool))] for _ in range(n - len(head))]


# transformers on the engine's weights
def hf_model(llm):
    """The transformers model of llm's weights (same config, the engine's state dict), eval mode."""
    try:
        import transformers
    except ImportError:
        raise KVStoreError("the comparison with Hugging Face transformers needs the transformers package "
                           "(pip install transformers), or pass --skip-hf") from None
    loaded = llm.loaded
    if loaded.path is not None:
        config = transformers.AutoConfig.from_pretrained(loaded.path)
    else:
        s = loaded.shape
        kind = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
        config = transformers.AutoConfig.for_model(
            kind[s.architecture], vocab_size=s.vocab_size, hidden_size=s.hidden_size,
            num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
            head_dim=s.head_dim, intermediate_size=s.intermediate_size, max_position_embeddings=s.max_position,
            rms_norm_eps=s.rms_norm_eps, rope_theta=s.rope_theta, rope_scaling=s.rope_scaling,
            tie_word_embeddings=s.tie_embeddings)
    with torch.device(llm.store.hot.device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=llm.dtype)
    model.load_state_dict(loaded.model.state_dict(), strict=True)
    model.eval()
    gen = model.generation_config
    gen.eos_token_id = gen.bos_token_id = None   # exactly the tokens asked for, as the engine's ignore_eos
    gen.pad_token_id = 0
    return model


def hf_generate(model, prompts: list[list[int]], new_tokens: int, vocab_limit: int) -> list[list[int]]:
    """Greedy continuations of equal-length prompts in one batch; ids at or past vocab_limit are never
    chosen, as in the engine (they are beyond what the tokenizer can decode)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class VocabLimit(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[:, vocab_limit:] = float("-inf")
            return scores

    device = next(model.parameters()).device
    ids = torch.tensor(prompts, device=device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, logits_processor=LogitsProcessorList([VocabLimit()]))
    return out[:, ids.shape[1]:].tolist()


# the engine
def make_llm(args: argparse.Namespace, workdir: str, **options) -> LLM:
    opts = dict(dtype=args.dtype, attention_backend=args.attention_backend, data_dir=workdir)
    opts.update(options)
    opts.update({k.replace(".", "__"): v for k, v in parse_set(args.set).items()})
    return LLM(args.model, **opts)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}") if x and math.isfinite(x) else x


def _ratio(a: float | None, b: float | None) -> float | None:
    return _sig(a / b) if a and b else None


def _progress(name: str) -> Callable[[str], None]:
    tty = sys.stderr.isatty()

    def say(message: str) -> None:
        if tty:
            print(f"bench_engine {name}: {message}", file=sys.stderr, flush=True)
    return say


def _backend_name(llm: LLM) -> str:
    return type(llm.backend).__name__.removesuffix("Backend").lower()


def _spec(args: argparse.Namespace):
    """The KV geometry the engine will have, to size its tiers before building it (auto dtype: the larger)."""
    page_size = int(parse_set(args.set).get("page_size", 16))
    return load_shape(args.model).kv_spec(args.dtype if args.dtype != "auto" else "float32", page_size)


def _positive(flag: str, value: int, minimum: int = 1) -> int:
    if value < minimum:
        raise ConfigError(flag, value, f"must be an integer >= {minimum}")
    return value


def _common(p: argparse.ArgumentParser, model: str = "small") -> None:
    p.add_argument("--model", default=model,
                   help=f"a preset ({', '.join(PRESETS)}) or a Hugging Face model directory (default {model})")
    p.add_argument("--dtype", default="float32", help="engine and transformers dtype (default float32)")
    p.add_argument("--attention-backend", default="auto", help="auto, native, sdpa, torch or flashinfer (default auto: flashinfer on CUDA, else native where it builds, else sdpa)")
    p.add_argument("--skip-hf", action="store_true", help="do not run Hugging Face transformers")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other config key for the engine, e.g. --set engine.decode_concurrency=32")
    p.add_argument("--dir", help="parent of the temporary data directory (default: the system temp dir)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")



def discard(llm, workdir: str) -> None:
    """A benchmark's engine and working directory, gone (nothing persisted)."""
    if llm is not None:
        llm.store.close(persist=False)
    shutil.rmtree(workdir, ignore_errors=True)
