"""ModelRunner: runs one scheduled step on the hot tier's pages and samples the next tokens.

The model computes the logits of the rows it samples from and, for a request with prompt
logprobs (SamplingParams.prompt_logprobs), of every prompt position in its chunk (position p
scores prompt token p + 1). A request whose rows cannot be used (a NaN in them, or a sampler
error) fails alone: it gets no token and its `error` is set (the engine finishes it with
finish_reason "error"); the other requests of the step go on."""

from __future__ import annotations

import logging
import time

import torch

from engine.attention import AttentionBackend, AttentionBatch
from engine.model import LlamaModel
from engine.request import Request
from engine.sampler import greedy_tokens, sample, token_logprobs, tokens_logprobs
from kvstore.tiers.device import DeviceTier
from kvstore.tiers.host import HostTier

log = logging.getLogger("kvstore.engine")


class ModelRunner:
    def __init__(self, model: LlamaModel, hot: DeviceTier, warm: HostTier, backend: AttentionBackend,
                 vocab_limit: int):
        self.model, self.hot, self.backend = model, hot, backend
        # per-layer views of the warm tier, for pages a long sequence spilled there
        self.warm_layers = [warm.pages[:, layer] for layer in range(hot.spec.num_layers)]
        self.device = hot.device
        self.vocab_limit = vocab_limit   # ids the tokenizer can produce; the rest are masked
        self.computed_tokens = 0
        self.compute_seconds = 0.0

    @property
    def tokens_per_s(self) -> float:
        """Measured compute speed (tokens through the model per second), for cost estimates."""
        return self.computed_tokens / self.compute_seconds if self.compute_seconds else 0.0

    def execute(self, batch: list[tuple[Request, int]]) -> list[Request]:
        """Compute the scheduled tokens; returns the requests that got a new token or an error."""
        t0 = time.monotonic()
        ids, positions, indptr, rows, sampled = [], [], [0], [], []
        prompt_rows, scored = [], []      # rows scoring prompt tokens; (request, its positions)
        for req, n in batch:
            start = req.num_computed
            ids += req.tokens[start:start + n]
            positions += range(start, start + n)
            indptr.append(indptr[-1] + n)
            if start + n == len(req.tokens):
                rows.append(indptr[-1] - 1)
                sampled.append(req)
            positions_scored = req.scored(start, n)
            if positions_scored:
                prompt_rows += (indptr[-2] + p - start for p in positions_scored)
                scored.append((req, positions_scored))
        shape = self.model.shape
        attn = AttentionBatch(indptr, [r.handle.slots for r, _ in batch], [r.num_computed + n for r, n in batch],
                              self.hot.spec.page_size, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                              self.device, warm_tables=[r.handle.spilled for r, _ in batch])
        logits = self.model(torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device),
                            attn, self.hot.layers, self.backend,
                            logit_rows=torch.tensor(rows + prompt_rows, dtype=torch.long, device=self.device),
                            warm_caches=self.warm_layers)
        logits = logits[:, :self.vocab_limit].cpu()
        failed = self._score_prompts(scored, logits[len(rows):])
        for req, n in batch:
            if req.num_computed < len(req.prompt):
                req.prefill_tokens += min(n, len(req.prompt) - req.num_computed)
            req.num_computed += n
        self.computed_tokens += len(ids)
        now = time.monotonic()
        self.compute_seconds += now - t0
        nan_rows = torch.isnan(logits[:len(rows)]).any(dim=1).tolist()   # one pass for the step's rows
        greedy = greedy_tokens(logits[:len(rows)], [req.params for req in sampled])
        for req, row, nan, token in zip(sampled, logits, nan_rows, greedy):
            if req.error:
                continue
            try:
                if nan:
                    raise _nan_error()
                if token is None:
                    token = sample(row, req.params, req.generator, req.tokens, len(req.prompt), req.sampler)
                lp = token_logprobs(row, token, req.params.logprobs) if req.logprobs is not None else None
            except Exception as exc:  # noqa: BLE001 - one request's bad row must not fail the others
                _fail(req, "sampling", exc)
                continue
            if lp is not None:
                req.logprobs.append(lp)
            req.tokens.append(token)
            if req.first_token_at is None:
                req.first_token_at = now
        return sampled + [r for r in failed if r not in sampled]

    @staticmethod
    def _score_prompts(scored: list[tuple[Request, range]], logits: torch.Tensor) -> list[Request]:
        """Append each request's prompt logprobs from its rows of logits [rows, vocab], in the order of
        `scored`; returns the requests that failed."""
        failed, first = [], 0
        for req, positions in scored:
            rows, first = logits[first:first + len(positions)], first + len(positions)
            try:
                _check_no_nan(rows)
                req.prompt_logprobs += tokens_logprobs(rows, req.prompt[positions.start + 1:positions.stop + 1],
                                                       req.params.prompt_logprobs)
            except Exception as exc:  # noqa: BLE001 - as for sampling: this request alone fails
                _fail(req, "prompt logprobs", exc)
                failed.append(req)
        return failed


def _nan_error() -> FloatingPointError:
    return FloatingPointError("the model's logits hold NaN")


def _check_no_nan(logits: torch.Tensor) -> None:
    if bool(torch.isnan(logits).any()):
        raise _nan_error()


def _fail(req: Request, what: str, exc: Exception) -> None:
    req.error = f"{what} failed: {type(exc).__name__}: {exc}"
    log.error("request %s: %s failed (%s: %s); it alone ends with an error", req.id, what, type(exc).__name__, exc)
