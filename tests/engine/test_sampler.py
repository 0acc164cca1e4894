"""The sampler's penalties, logit bias and min-p against references computed here from their definitions
(OpenAI's for presence/frequency, vLLM's for repetition, min-p and the order), the validation of each
parameter, and the parameters end to end through the engine (CPU, fp32, the tiny preset)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import InvalidRequest, SamplerState, sample


def greedy(row, tokens=(), num_prompt=0, **params) -> int:
    return sample(torch.tensor(row, dtype=torch.float32), SamplingParams(**params).validate(), None,
                  list(tokens), num_prompt)


def reference_logits(row, tokens, num_prompt, logit_bias=None, repetition_penalty=1.0, frequency_penalty=0.0,
                     presence_penalty=0.0) -> np.ndarray:
    """Bias, then repetition over prompt and output, then frequency and presence over the output."""
    out = np.array(row, dtype=np.float64)
    for token, bias in (logit_bias or {}).items():
        out[token] += bias
    for token in set(tokens):
        out[token] = out[token] / repetition_penalty if out[token] > 0 else out[token] * repetition_penalty
    for token in set(tokens[num_prompt:]):
        count = tokens[num_prompt:].count(token)
        out[token] -= frequency_penalty * count + presence_penalty
    return out


def reference_support(row, temperature, min_p=0.0, top_p=1.0) -> set[int]:
    """Tokens that can be drawn: min_p after temperature, then top_p on what is left, renormalised."""
    logits = np.array(row, dtype=np.float64) / temperature
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    kept = [i for i in range(len(row)) if probs[i] >= min_p * probs.max()]
    kept.sort(key=lambda i: -probs[i])
    total = sum(probs[i] for i in kept)
    support, before = set(), 0.0
    for i in kept:
        if before < top_p:
            support.add(i)
        before += probs[i] / total
    return support


def drawn(row, draws: int, **params) -> set[int]:
    generator = torch.Generator().manual_seed(1234)
    p = SamplingParams(**params).validate()
    logits = torch.tensor(row, dtype=torch.float32)
    return {sample(logits, p, generator) for _ in range(draws)}


# logit_bias
def test_logit_bias_forces_and_forbids_tokens():
    row = np.random.default_rng(0).normal(size=300).tolist()
    top = int(np.argmax(row))
    assert greedy(row, logit_bias={7: 100}) == 7 != top
    forbid = {top: -100}
    assert greedy(row, logit_bias=forbid) == int(np.argmax(reference_logits(row, [], 0, forbid)))
    assert greedy(row, logit_bias=forbid) != top


def test_logit_bias_on_ids_past_the_row_is_ignored():
    row = [0.0, 1.0, 0.5]   # the model's vocabulary may be wider than the tokenizer's
    assert greedy(row, tokens=[5, 5, 0], num_prompt=1, logit_bias={4: 100}, repetition_penalty=2,
                  frequency_penalty=1) == 1


# penalties
def test_repetition_penalty_flips_the_argmax_over_prompt_and_output():
    row = [0.0] * 10
    row[3], row[4] = 2.0, 1.5          # 3 was seen: 2.0 / 1.5 = 1.33 < 1.5
    for tokens, num_prompt in (([1, 3], 2), ([1, 3], 1)):   # 3 in the prompt, then 3 in the output
        want = int(np.argmax(reference_logits(row, tokens, num_prompt, repetition_penalty=1.5)))
        assert want == 4
        assert greedy(row, tokens, num_prompt, repetition_penalty=1.5) == want
    assert greedy(row, [1], 1, repetition_penalty=1.5) == 3
    negative = [-5.0] * 10
    negative[3], negative[4] = -1.0, -1.2   # seen and negative: -1.0 * 1.5 = -1.5 < -1.2
    assert int(np.argmax(reference_logits(negative, [3], 1, repetition_penalty=1.5))) == 4
    assert greedy(negative, [3], 1, repetition_penalty=1.5) == 4
    assert greedy(row, [4], 1, repetition_penalty=0.5) == 4    # below 1 it favours repeats: 1.5 / 0.5 = 3


def test_frequency_and_presence_penalties_count_generated_tokens_only():
    row = [-10.0] * 8
    row[1], row[2], row[3] = 0.0, 1.0, 2.3     # generated 0, 1 and 3 times
    prompt = [1, 1, 1, 1, 5]
    tokens = prompt + [2, 3, 3, 3]
    winners = set()
    for frequency in (0.0, 0.3, 0.5, 1.0, 2.0, -0.5):
        for presence in (0.0, 0.6, 1.5, -1.0):
            ref = reference_logits(row, tokens, len(prompt), frequency_penalty=frequency, presence_penalty=presence)
            top2 = np.sort(ref)[-2:]
            if top2[1] - top2[0] < 1e-4:
                continue   # a tie: either answer is right
            want = int(np.argmax(ref))
            assert greedy(row, tokens, len(prompt), frequency_penalty=frequency, presence_penalty=presence) == want, \
                (frequency, presence)
            winners.add(want)
    assert winners == {1, 2, 3}
    row[1] = 3.0   # the prompt's four 1s are not counted: counted, 1 would fall to 3.0 - 2 * 4 - 2
    assert greedy(row, prompt, len(prompt), frequency_penalty=2, presence_penalty=2) == 1


def test_bias_comes_before_the_repetition_penalty():
    row = [0.0, 1.0, 2.5]
    # bias first: (1 + 3) / 2 = 2 < 2.5; the penalty first would give 0.5 + 3 = 3.5
    ref = reference_logits(row, [1], 1, logit_bias={1: 3.0}, repetition_penalty=2.0)
    assert int(np.argmax(ref)) == 2
    assert greedy(row, [1], 1, logit_bias={1: 3.0}, repetition_penalty=2.0) == 2


def test_random_rows_match_the_reference():
    rng = np.random.default_rng(5)
    checked = 0
    for _ in range(300):
        vocab = int(rng.integers(5, 60))
        row = rng.normal(scale=2.0, size=vocab).tolist()
        tokens = rng.integers(0, vocab, size=int(rng.integers(1, 30))).tolist()
        num_prompt = int(rng.integers(0, len(tokens) + 1))
        bias = {int(t): float(rng.uniform(-5, 5)) for t in rng.integers(0, vocab, size=3)}
        params = dict(logit_bias=bias, repetition_penalty=float(rng.uniform(0.5, 2.0)),
                      frequency_penalty=float(rng.uniform(-2, 2)), presence_penalty=float(rng.uniform(-2, 2)))
        ref = reference_logits(row, tokens, num_prompt, **params)
        top2 = np.sort(ref)[-2:]
        if top2[1] - top2[0] < 1e-4:
            continue
        assert greedy(row, tokens, num_prompt, **params) == int(np.argmax(ref))
        checked += 1
    assert checked > 280


def test_the_row_is_left_unchanged():
    row = torch.tensor([0.5, 2.0, -1.0, 3.0])
    before = row.clone()
    params = SamplingParams(logit_bias={0: 5}, repetition_penalty=1.3, frequency_penalty=1, presence_penalty=1,
                            min_p=0.1, temperature=0.8).validate()
    sample(row, params, torch.Generator().manual_seed(0), [1, 3, 3], 1)
    assert torch.equal(row, before)   # logprobs are taken from the raw row afterwards


# min_p
def test_min_p_removes_exactly_the_reference_tokens():
    row = [3.0, 2.6, 2.2, 1.0, 0.9, -1.0, 2.9, 0.0]
    for temperature, min_p in ((1.0, 0.3), (0.5, 0.3), (2.0, 0.3), (1.0, 0.04)):
        support = reference_support(row, temperature, min_p=min_p)
        assert 1 < len(support) < len(row)
        assert drawn(row, 3000, temperature=temperature, min_p=min_p) == support, (temperature, min_p)


def test_min_p_comes_before_top_p():
    row = np.log([0.4, 0.3, 0.2, 0.1]).tolist()
    # min_p drops 0.1 (< 0.12); renormalised, 0.44 + 0.33 reaches 0.75 before the third token
    support = reference_support(row, 1.0, min_p=0.3, top_p=0.75)
    assert support == {0, 1}
    assert drawn(row, 2000, temperature=1.0, min_p=0.3, top_p=0.75) == support
    assert drawn(row, 2000, temperature=1.0, top_p=0.75) == reference_support(row, 1.0, top_p=0.75) == {0, 1, 2}


# validation
BAD = [
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", True), ("presence_penalty", "1"),
    ("presence_penalty", None), ("presence_penalty", math.nan),
    ("frequency_penalty", 3), ("frequency_penalty", -2.5), ("frequency_penalty", False), ("frequency_penalty", [1]),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("repetition_penalty", math.nan), ("repetition_penalty", True), ("repetition_penalty", "1.2"),
    ("min_p", -0.1), ("min_p", 1.01), ("min_p", True), ("min_p", math.nan), ("min_p", "0.1"),
    ("logit_bias", {"abc": 1}), ("logit_bias", {"1.5": 1}), ("logit_bias", {" 5": 1}), ("logit_bias", {"-3": 1}),
    ("logit_bias", {1.0: 1}), ("logit_bias", {True: 1}), ("logit_bias", {-1: 1}), ("logit_bias", {1: "x"}),
    ("logit_bias", {1: True}), ("logit_bias", {1: math.nan}), ("logit_bias", {1: None}), ("logit_bias", [1, 2]),
    ("logit_bias", "x"),
]


@pytest.mark.parametrize("name, value", BAD)
def test_validate_refuses_bad_values(name, value):
    with pytest.raises(InvalidRequest, match=rf"^{name} = .*: must "):
        SamplingParams(**{name: value}).validate()


def test_validate_accepts_the_bounds_and_normalises_logit_bias():
    for name, value in (("presence_penalty", -2), ("presence_penalty", 2.0), ("frequency_penalty", -2.0),
                        ("frequency_penalty", 2), ("repetition_penalty", 0.01), ("repetition_penalty", 7),
                        ("min_p", 0), ("min_p", 1.0)):
        SamplingParams(**{name: value}).validate()
    p = SamplingParams(logit_bias={"50256": -250, 3: 10**400, "7": 1.5, 9: -math.inf}).validate()
    assert p.logit_bias == {50256: -100.0, 3: 100.0, 7: 1.5, 9: -100.0}
    assert all(type(k) is int and type(v) is float for k, v in p.logit_bias.items())
    assert SamplingParams(logit_bias=None).validate().logit_bias == {}


def test_validate_refuses_logit_bias_ids_outside_the_vocabulary():
    assert SamplingParams(logit_bias={511: 1, "0": 1}).validate(vocab_size=512).logit_bias == {511: 1.0, 0: 1.0}
    for bias in ({512: 1}, {"600": 1}):
        with pytest.raises(InvalidRequest, match=r"^logit_bias = .*: must map token ids \(integers in \[0, 512\)"):
            SamplingParams(logit_bias=bias).validate(vocab_size=512)


# end to end
@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    engine = LLM("tiny", dtype="float32", attention_backend="torch", data_dir=str(tmp_path_factory.mktemp("llm")),
                 hot__device="cpu", hot__pool="4MiB", warm__bytes="4MiB")
    yield engine
    engine.close()


PROMPT = [256, 10, 20, 30, 40, 50]


def generate(llm, prompt=PROMPT, **params) -> list[int]:
    [out] = llm.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True, **params))
    return out.token_ids


def test_engine_logit_bias_forces_every_token(llm):
    default = generate(llm)
    assert set(default) != {65}
    assert generate(llm, logit_bias={65: 100}) == [65] * 10
    assert generate(llm, logit_bias={"66": 100}) == [66] * 10


def test_engine_neutral_penalties_change_nothing(llm):
    neutral = dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, min_p=0.0, logit_bias={})
    assert generate(llm, **neutral) == generate(llm)
    seeded = dict(temperature=1.0, seed=3)
    assert generate(llm, **seeded, **neutral) == generate(llm, **seeded)


def test_engine_penalties_follow_the_generated_tokens(llm):
    # 65 and 66 both +100: the raw logits of the tiny model differ by far less than the penalties
    both = {65: 100, 66: 100}
    frequent = generate(llm, logit_bias=both, frequency_penalty=2.0)
    assert set(frequent) == {65, 66}
    assert all(abs(frequent[:i].count(65) - frequent[:i].count(66)) <= 1 for i in range(len(frequent) + 1))
    present = generate(llm, logit_bias=both, presence_penalty=2.0)
    assert set(present) <= {65, 66} and present[0] != present[1]
    # repetition counts the prompt: the boosted token already in it loses the first pick
    assert generate(llm, PROMPT + [65], logit_bias=both, repetition_penalty=1.5)[0] == 66
    assert generate(llm, PROMPT + [66], logit_bias=both, repetition_penalty=1.5)[0] == 65


def test_one_request_whose_logits_cannot_be_sampled_fails_alone(llm, monkeypatch, caplog):
    """A NaN row (greedy: argmax would pick it silently; sampled: multinomial raises) fails its own
    request with finish_reason "error"; the others of the step get exactly their tokens."""
    other = [256, 5, 6, 7, 8]
    params = dict(max_tokens=6, ignore_eos=True)
    for extra in ({}, {"temperature": 1.0, "seed": 5}):
        alone = llm.generate([PROMPT], SamplingParams(**params, **extra))[0].token_ids
        forward = llm.runner.model.forward

        def poisoned(ids, positions, attn, *args, **kwargs):
            out = forward(ids, positions, attn, *args, **kwargs).clone()
            if out.shape[0] == 2:   # the two requests sampled together: the second one's row is poisoned
                out[1] = float("nan")
            return out
        monkeypatch.setattr(llm.runner.model, "forward", poisoned)
        with caplog.at_level("ERROR", logger="kvstore.engine"):
            good, bad = llm.generate([PROMPT, other], SamplingParams(**params, **extra))
        monkeypatch.undo()
        assert good.finish_reason == "length" and good.token_ids == alone
        assert bad.finish_reason == "error" and "NaN" in bad.error and bad.token_ids == []
        assert llm.failed_steps == 0 and any("sampling failed" in r.getMessage() for r in caplog.records)
        assert llm.generate([other], SamplingParams(**params, **extra))[0].finish_reason == "length"


PENALIZED = dict(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4, logit_bias={3: 2.0, 9: -1.5})


def test_the_kept_state_samples_as_the_whole_sequence_does():
    """Step by step, a SamplerState kept across steps gives the tokens that rebuilding everything
    from the whole sequence gives (greedy and seeded draws; ids past the row are ignored)."""
    gen = torch.Generator().manual_seed(0)
    for extra in ({}, {"temperature": 0.8}):
        params = SamplingParams(**PENALIZED, **extra).validate(vocab_size=64)
        tokens, state = [1, 3, 3, 70, 5], SamplerState()
        g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
        for _ in range(30):
            row = torch.randn(64, generator=gen)
            kept = sample(row, params, g1, tokens, 5, state)
            assert kept == sample(row, params, g2, tokens, 5)
            tokens.append(kept)


def test_a_step_folds_in_only_its_new_token_and_builds_the_bias_once(monkeypatch):
    params = SamplingParams(**PENALIZED).validate(vocab_size=64)
    tokens, state = list(range(40)), SamplerState()
    sample(torch.randn(64), params, None, tokens, 40, state)
    built = []
    real = torch.tensor

    def recording(data, *args, **kwargs):
        built.append(len(data))
        return real(data, *args, **kwargs)
    monkeypatch.setattr(torch, "tensor", recording)
    for step in range(10):
        tokens.append(step % 64)
        sample(torch.randn(64), params, None, tokens, 40, state)
    assert built and max(built) <= 1   # one new id a step: never the whole sequence, never the bias again
