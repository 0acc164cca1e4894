"""engine/model.py against transformers on the same random checkpoints: prefill logits and greedy
decoding through the paged cache, for Llama (plain and with Llama-3.1 rope scaling), Mistral and Qwen2,
on the reference path (torch attention, F.linear) and on the fast CPU path (sdpa attention, weights
prepacked for oneDNN)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"

from hfutil import greedy, run_prefill, write_hf_model  # noqa: E402

from engine.loader import load_model  # noqa: E402
from engine.model import rope_inv_freq  # noqa: E402

PROMPT_LEN, NEW_TOKENS = 40, 32


PATHS = {"reference": ("torch", False), "fast": ("sdpa", True), "native": ("native", True)}   # attention backend, prepacked weights


@pytest.fixture(scope="module", params=[(a, p) for a in ("llama", "llama3", "mistral", "qwen2") for p in PATHS],
                ids=lambda ap: f"{ap[0]}-{ap[1]}")
def pair(request, tmp_path_factory):
    """(engine LoadedModel, transformers model, prompt, attention backend) for one architecture and path."""
    from transformers import AutoModelForCausalLM

    arch, path_name = request.param
    backend, prepack = PATHS[path_name]
    path = write_hf_model(tmp_path_factory.mktemp(arch), arch, seed=0)
    ours = load_model(str(path), torch.float32, torch.device("cpu"), prepack=prepack)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = torch.randint(3, ours.shape.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7))
    return ours, ref, prompt.tolist(), backend


def test_prefill_logits_match(pair):
    ours, ref, prompt, backend = pair
    logits = run_prefill(ours.model, prompt, backend)
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0].float()
    assert logits.shape == expected.shape == (PROMPT_LEN, ours.shape.vocab_size)
    assert (logits - expected).abs().max().item() < 1e-3


def test_greedy_tokens_match(pair):
    ours, ref, prompt, backend = pair
    tokens = greedy(ours.model, prompt, NEW_TOKENS, backend)
    expected = []
    with torch.no_grad():   # the reference recomputes the whole sequence every step: no cache involved
        for _ in range(NEW_TOKENS):
            expected.append(int(ref(torch.tensor([prompt + expected])).logits[0, -1].argmax()))
    assert tokens == expected
    assert len(set(tokens)) > 2     # a run of one repeated token would prove little


def test_llama3_rope_scaling_reaches_past_original_context(tmp_path):
    from transformers import AutoModelForCausalLM

    path = write_hf_model(tmp_path, "llama3", seed=0)
    ours = load_model(str(path), torch.float32, torch.device("cpu"))
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    scaling = ours.shape.rope_scaling
    assert scaling["rope_type"] == "llama3" and scaling["original_max_position_embeddings"] == 32
    assert PROMPT_LEN + NEW_TOKENS > scaling["original_max_position_embeddings"]
    unscaled = rope_inv_freq(dataclasses.replace(ours.shape, rope_scaling=None))
    assert not torch.allclose(ours.model.inv_freq, unscaled)   # the scaling changes frequencies
    torch.testing.assert_close(ours.model.inv_freq, ref.model.rotary_emb.inv_freq.float())
