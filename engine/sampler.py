"""SamplingParams and the sampler: greedy, temperature, top-k, top-p, min-p, penalties, logit bias, seeds,
logprobs, with the meanings and the order of vLLM's V1 sampler."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvstore.errors import KVStoreError

GREEDY_BELOW = 1e-5     # a temperature below this samples greedily (as vLLM): logits / 1e-127 overflow
MAX_LOGIT_BIAS = 100.0  # biases are clamped into [-100, 100] (as vLLM and OpenAI)


class InvalidRequest(KVStoreError):
    """A request the engine refuses (bad sampling parameters, prompt too long...): HTTP 400."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0        # 0 (or below GREEDY_BELOW): greedy
    top_k: int = 0                  # 0: off
    top_p: float = 1.0
    seed: int | None = None         # per-request generator, so a seeded request repeats exactly
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)   # stop strings, matched on the decoded text
    logprobs: int | None = None     # None: none; 0: the chosen token's; k: also the top k
    prompt_logprobs: int | None = None   # the same for each prompt token but the first (vLLM's): given those before
    ignore_eos: bool = False
    presence_penalty: float = 0.0   # subtracted from the logit of each token generated so far (OpenAI's)
    frequency_penalty: float = 0.0  # times a token's count in the output so far, subtracted from its logit
    repetition_penalty: float = 1.0  # tokens of the prompt or output: logit / this if > 0, else logit * this
    min_p: float = 0.0              # after temperature, drop tokens whose probability < min_p * the top one's
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit, first

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Refuse a bad value with InvalidRequest naming the field; returns self, normalised.

        logit_bias keys may be decimal strings (JSON object keys) and become ints; its values are clamped
        into [-100, 100]; None means no bias. With vocab_size, a logit_bias token id must be below it."""
        checks = [
            (_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an integer >= 1"),
            (_is_number(self.temperature) and 0 <= self.temperature <= 100, "temperature", "a number in [0, 100]"),
            (_is_int(self.top_k) and self.top_k >= 0, "top_k", "an integer >= 0"),
            (_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]"),
            (self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**63), "seed",
             "an integer in [-2^63, 2^63)"),
            (isinstance(self.stop_token_ids, list) and all(_is_int(t) for t in self.stop_token_ids),
             "stop_token_ids", "a list of integers"),
            (isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop), "stop",
             "a list of non-empty strings"),
            (self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20), "logprobs",
             "an integer in [0, 20]"),
            (self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
             "prompt_logprobs", "an integer in [0, 20]"),
            (_is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty",
             "a number in [-2, 2]"),
            (_is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
             "a number in [-2, 2]"),
            (_is_number(self.repetition_penalty) and 0 < self.repetition_penalty < math.inf, "repetition_penalty",
             "a finite number > 0"),
            (_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "a number in [0, 1]"),
        ]
        for ok, name, allowed in checks:
            if not ok:
                raise InvalidRequest(f"{name} = {getattr(self, name)!r}: must be {allowed}")
        self.logit_bias = _checked_logit_bias(self.logit_bias, vocab_size)
        return self

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits first: sample() is then the row's argmax."""
        return self.temperature < GREEDY_BELOW and not self.logit_bias and not self.has_penalties

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or bool(self.frequency_penalty) or bool(self.presence_penalty)


def _checked_logit_bias(bias, vocab_size: int | None) -> dict[int, float]:
    """bias with int keys and clamped values; InvalidRequest on the first bad entry."""
    if bias is None:
        return {}
    ids = "integers >= 0" if vocab_size is None else f"integers in [0, {vocab_size})"
    allowed = f"must map token ids ({ids}, or their decimal strings) to numbers"
    if not isinstance(bias, dict):
        raise InvalidRequest(f"logit_bias = {bias!r}: {allowed}")
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
        known = _is_int(token) and token >= 0 and (vocab_size is None or token < vocab_size)
        if not (known and _is_number(value) and value == value):   # NaN is the one number unequal to itself
            raise InvalidRequest(f"logit_bias = {{{key!r}: {value!r}}}: {allowed}")
        out[token] = float(min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, value)))   # clamp first: 10**400 overflows float()
    return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)   # JSON true is not 1


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class SamplerState:
    """What sample() keeps for one request between steps, so that a step costs the same however long
    the sequence: its logit_bias as tensors (built once), and for penalties which ids the sequence
    holds (prompt and output) and how often each was generated, brought up to date with the tokens
    added since the last step (never rebuilt from the whole sequence)."""

    def __init__(self):
        self.bias: tuple[torch.Tensor, torch.Tensor] | None = None
        self.seen: torch.Tensor | None = None     # [vocab] bool: in prompt or output
        self.counts: torch.Tensor | None = None   # [vocab] output counts
        self.synced = 0                           # tokens folded into seen and counts

    def bias_tensors(self, bias: dict[int, float], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.bias is None:
            self.bias = _bias_tensors(bias, logits)
        return self.bias

    def penalty_tensors(self, tokens: Sequence[int], num_prompt: int, logits: torch.Tensor):
        vocab = logits.numel()
        if self.seen is None:
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            self.counts = torch.zeros(vocab, dtype=logits.dtype, device=logits.device)
        fresh = [(i, t) for i, t in enumerate(tokens[self.synced:], self.synced) if t < vocab]
        if fresh:
            self.seen[torch.tensor([t for _, t in fresh], dtype=torch.long, device=logits.device)] = True
            out = [t for i, t in fresh if i >= num_prompt]
            if out:
                self.counts.index_add_(0, torch.tensor(out, dtype=torch.long, device=logits.device),
                                       torch.ones(len(out), dtype=logits.dtype, device=logits.device))
        self.synced = len(tokens)
        return self.seen, self.counts


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           tokens: Sequence[int] = (), num_prompt: int = 0, state: SamplerState | None = None) -> int:
    """One token id from one row of logits [vocab] (fp32), which is left unchanged.

    tokens: the request's tokens so far, its num_prompt prompt tokens first. Order (vLLM V1's Sampler):
    logit_bias, penalties (repetition, frequency, presence), greedy argmax below GREEDY_BELOW, else
    temperature, min_p, top_k, top_p, the draw. Ids at or past the row's width (ids the tokenizer
    cannot produce) are never sampled, so their bias and counts are ignored. `state`: the request's
    SamplerState, kept between its steps (without one, everything is built from `tokens`)."""
    state = state or SamplerState()
    if params.logit_bias:
        ids, values = state.bias_tensors(params.logit_bias, logits)
        logits = logits.index_add(0, ids, values)
    if params.has_penalties:
        logits = _penalize(logits, params, *state.penalty_tensors(tokens, num_prompt, logits))
    if params.temperature < GREEDY_BELOW:
        return int(logits.argmax())
    logits = logits / params.temperature
    if params.min_p:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < params.top_p   # always keeps the first
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def greedy_tokens(logits: torch.Tensor, params: Sequence[SamplingParams]) -> list[int | None]:
    """For rows of logits [rows, vocab] and their requests' params: the token sample() would give
    where it is the row's argmax (plain_greedy), taken with one argmax over all rows; None elsewhere."""
    plain = [p.plain_greedy for p in params]
    if not any(plain):
        return [None] * len(plain)
    top = logits.argmax(dim=1).tolist()
    return [t if is_plain else None for t, is_plain in zip(top, plain)]


def _bias_tensors(bias: dict[int, float], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids inside the row and their biases, on the row's device."""
    ids = torch.tensor(list(bias), dtype=torch.long)
    values = torch.tensor(list(bias.values()), dtype=logits.dtype)
    inside = ids < logits.numel()
    return ids[inside].to(logits.device), values[inside].to(logits.device)


def _penalize(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Repetition over prompt and output tokens (seen), then frequency and presence over the output
    only (counts)."""
    if params.repetition_penalty != 1:
        penalized = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    if params.frequency_penalty or params.presence_penalty:
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    return logits


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> dict:
    """The logprob of `token` under one row of logits [vocab], and with k the top k (id, logprob)."""
    return tokens_logprobs(logits[None], [token], k)[0]


def tokens_logprobs(logits: torch.Tensor, tokens: Sequence[int], k: int) -> list[dict]:
    """token_logprobs of each row of logits [rows, vocab] and its token, at once. A token at or past
    the rows' width (one the tokenizer cannot produce) has logprob -inf."""
    lp = logits.log_softmax(-1)
    width = lp.shape[-1]
    ids = torch.tensor(tokens, dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, ids.clamp(max=width - 1)[:, None])[:, 0].masked_fill(ids >= width, float("-inf"))
    out = [{"token_id": t, "logprob": v} for t, v in zip(tokens, chosen.tolist())]
    if k:
        top = torch.topk(lp, min(k, width))
        for entry, values, indices in zip(out, top.values.tolist(), top.indices.tolist()):
            entry["top"] = list(zip(indices, values))
    return out
