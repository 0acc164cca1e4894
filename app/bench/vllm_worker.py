"""vLLM (CPU build) as a child process of `scripts/bench_engine compare`, run by the Python of
vLLM's own venv (scripts/bootstrap_vllm); it needs only vllm and the standard library.

    VENV/bin/python -I app/bench/vllm_worker.py

One JSON object a line on stdin, one answer a line on stdout ({"ok": true, ...} or
{"ok": false, "error": "..."}):

    {"cmd": "load", "model": DIR, "dtype": "float32", "max_model_len": 8192, "seed": 0, "enforce_eager": false}
        -> vllm (its version), threads (torch's), seconds
    {"cmd": "generate", "prompts": [[ids], ...], "max_tokens": N, "ignore_eos": true, "vocab_limit": null}
        -> tokens ([[ids], ...], greedy), cached_tokens (prefix cache hits a prompt), seconds
           (the generate call alone)
    {"cmd": "reset_prefix_cache"} -> reset (vLLM's answer)
    {"cmd": "quit"}

Everything vLLM prints (its logs go to stdout by default) lands on stderr: the answers own the
original stdout. The parent sets the threading environment (contenders.VLLMWorker.ENV).
"""

from __future__ import annotations

import json
import os
import sys
import time


def _answer_channel():
    """The original stdout for answers; fd 1 (Python's and C's prints) then points at stderr."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


def _architecture(model: str) -> dict:
    """A config.json without `architectures` (scripts/real_model writes null there) makes vLLM resolve the
    bare LlamaModel, without its LM head: name the causal-LM class from model_type instead."""
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    if config.get("architectures"):
        return {}
    causal = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    return {"architectures": [causal[config["model_type"]]]}


class Worker:
    def __init__(self):
        self.llm = None

    def load(self, model: str, dtype: str = "float32", max_model_len: int = 8192, seed: int = 0,
             enforce_eager: bool = False) -> dict:
        t = time.perf_counter()
        import torch
        import vllm

        self.llm = vllm.LLM(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed,
                            enable_prefix_caching=True, skip_tokenizer_init=True, enforce_eager=enforce_eager,
                            hf_overrides=_architecture(model))
        return {"vllm": vllm.__version__, "threads": torch.get_num_threads(),
                "seconds": time.perf_counter() - t}

    def generate(self, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = True,
                 vocab_limit: int | None = None) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        allowed = list(range(vocab_limit)) if vocab_limit else None   # ids past the tokenizer's, as the engine
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens if ignore_eos else 0,
                                ignore_eos=ignore_eos, detokenize=False, allowed_token_ids=allowed)
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        t = time.perf_counter()
        outs = self.llm.generate(requests, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                "cached_tokens": [o.num_cached_tokens or 0 for o in outs], "seconds": seconds}

    def reset_prefix_cache(self) -> dict:
        return {"reset": bool(self.llm.reset_prefix_cache())}


def main() -> int:
    answers = _answer_channel()
    worker = Worker()
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        cmd = request.pop("cmd")
        if cmd == "quit":
            break
        try:
            if cmd not in ("load", "generate", "reset_prefix_cache"):
                raise ValueError(f"unknown command {cmd!r}")
            if cmd != "load" and worker.llm is None:
                raise RuntimeError(f"{cmd} before load")
            answer = {"ok": True, **getattr(worker, cmd)(**request)}
        except Exception as exc:   # the parent reports it; the worker stays up for the next command
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        answers.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
