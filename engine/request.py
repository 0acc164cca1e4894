"""A request's state as it moves through the scheduler, and what the caller gets back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from engine.sampler import SamplerState, SamplingParams
from kvstore.errors import KVStoreError
from kvstore.pages.keys import Namespace
from kvstore.placement.index import CACHE_TIERS
from kvstore.store.handle import CacheHandle


class QueueFull(KVStoreError):
    """The waiting queue is at scheduler.max_queue_depth: retry later (HTTP 429)."""

    def __init__(self, depth: int, retry_after_s: float = 1.0):
        self.retry_after_s = retry_after_s
        super().__init__(f"queue full: {depth} requests waiting (scheduler.max_queue_depth); "
                         f"retry in {retry_after_s:g} s")


class StepFailed(Exception):
    """The engine step that ran this request failed (HTTP 500); the engine goes on with the others."""


class Status(Enum):
    WAITING = "waiting"
    LOADING = "loading"   # its cached prefix is coming up from cold
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[dict] | None
    ttft_s: float | None
    latency_s: float | None
    cached_tokens: dict[str, int]
    prefill_tokens: int
    error: str | None = None               # set when finish_reason is "error": what went wrong
    prompt_logprobs: list[dict | None] | None = None   # with SamplingParams.prompt_logprobs: per prompt token


@dataclass(eq=False)
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    namespace: Namespace
    tenant: str = ""
    priority: int = 0                      # higher runs first under the priority policies
    arrival: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    tokens: list[int] = field(default_factory=list)   # prompt + generated
    handle: CacheHandle | None = None      # its pages in the store, from its first admission on
    num_computed: int = 0                  # tokens whose K/V are in its pages
    cached_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CACHE_TIERS, 0))
    fetched_pages: dict[str, range] = field(default_factory=dict)   # source (remote, peer) -> pages it brought
    prefill_tokens: int = 0                # prompt tokens computed (not served from the cache)
    admitted: bool = False
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    text: str = ""
    logprobs: list[dict] | None = None
    prompt_logprobs: list[dict | None] | None = None   # per prompt token so far; the first has none (None)
    generator: torch.Generator | None = None
    sampler: SamplerState = field(default_factory=SamplerState)   # sample()'s state between its steps
    preemptions: int = 0
    preempted_step: int = -1               # the scheduler step that last preempted it
    load_tried: bool = False               # a load of its cached prefix was started (or not needed)
    load_deadline: float = 0.0             # monotonic; LOADING gives up then (prefetch.policy timeout)
    stuck_since: float | None = None       # monotonic; when its current spell of steps stuck alone began
    error: str | None = None

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def cacheable(self) -> int:
        """How many of its leading tokens may come from a cached prefix: all but the last (computed
        to sample from). A request with prompt logprobs needs the logits of every prompt position
        (position p gives token p + 1's logprob), so it reuses no cached prefix for the positions
        whose logprobs it has yet to compute: none at first, after a preemption those it has."""
        if self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt):
            return len(self.prompt_logprobs) - 1
        return len(self.tokens) - 1

    def scored(self, start: int, n: int) -> range:
        """The positions among start .. start + n - 1 whose logits give a prompt token's logprob it
        has yet to compute."""
        if self.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs) - 1), min(start + n, len(self.prompt) - 1))

    @property
    def pending(self) -> int:
        """Tokens to compute before the next sample."""
        return len(self.tokens) - self.num_computed

    def output(self) -> RequestOutput:
        done = self.finished_at
        return RequestOutput(
            request_id=self.id, prompt_token_ids=list(self.prompt), token_ids=list(self.output_ids),
            text=self.text, finish_reason=self.finish_reason,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            ttft_s=self.first_token_at - self.arrival if self.first_token_at else None,
            latency_s=done - self.arrival if done else None,
            cached_tokens=dict(self.cached_tokens), prefill_tokens=self.prefill_tokens, error=self.error,
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None)
