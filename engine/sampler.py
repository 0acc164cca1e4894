"""SamplingParams and the sampler: greedy, temperature, top-k, top-p, seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstore.errors import KVStoreError

GREEDY_BELOW = 1e-5     # a temperature below this samples greedily (as vLLM): logits / 1e-127 overflow


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
    ignore_eos: bool = False

    def validate(self) -> "SamplingParams":
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
        ]
        for ok, name, allowed in checks:
            if not ok:
                raise InvalidRequest(f"{name} = {getattr(self, name)!r}: must be {allowed}")
        return self


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)   # JSON true is not 1


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from one row of logits [vocab] (fp32)."""
    if params.temperature < GREEDY_BELOW:
        return int(logits.argmax())
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < params.top_p   # always keeps the first
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> dict:
    lp = logits.log_softmax(-1)
    out = {"token_id": token, "logprob": float(lp[token])}
    if k:
        top = torch.topk(lp, k)
        out["top"] = [(int(i), float(v)) for v, i in zip(top.values, top.indices)]
    return out
