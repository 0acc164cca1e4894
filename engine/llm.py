"""LLM: the engine, stepped synchronously (engine.async_llm runs it in a thread for the HTTP API).

    from engine import LLM, SamplingParams
    llm = LLM(model="tiny")                      # a preset or a Hugging Face directory
    out = llm.generate(["some text", [1, 2, 3]], SamplingParams(max_tokens=32))

Keyword options are config keys: top-level ones by name (page_size=16), the engine's by name
(dtype="float32", attention_backend="torch"), any other as section__key (hot__pool="1GiB").
"""

from __future__ import annotations

import collections
import itertools
import logging
from typing import Callable, Sequence

import torch

from engine.attention import create_backend
from engine.loader import load_model
from engine.model import can_prepack
from engine.omp import release_thread_team
from engine.request import Request, RequestOutput, Status
from engine.runner import ModelRunner
from engine.sampler import InvalidRequest, SamplingParams
from engine.scheduler import Scheduler
from engine.tokenizer import check_text
from engine.config import Config, key_paths, load_config
from kvstore.config import Config as StoreConfig
from kvstore.config import key_paths as store_key_paths
from kvstore.errors import ConfigError
from kvstore.store.tiered import TieredStore
from kvstore.tiers.device import resolve_device

_ids = itertools.count()
log = logging.getLogger("kvstore.engine")
_ENGINE_KEYS = {f.split(".", 1)[1] for f in key_paths() if f.startswith("engine.")}


def _overrides(model: str, kwargs: dict) -> dict:
    out = {"model": model}
    for k, v in kwargs.items():
        path = f"engine.{k}" if k in _ENGINE_KEYS else k.replace("__", ".")
        out[path] = v
    return out


class LLM:
    def __init__(self, model: str = "tiny", config: StoreConfig | None = None, **options):
        if config is not None and not isinstance(config, Config):   # the store's tree: the engine's defaults
            config = load_config(env={}, overrides=_flatten(config))
        self.config = config.replace(model=model) if config else load_config(overrides=_overrides(model, options))
        if config and options:
            self.config = load_config(env={}, overrides={**_flatten(self.config), **_overrides(model, options)})
        cfg = self.config
        device = resolve_device(cfg.hot.device)
        dtype = cfg.engine.dtype if cfg.engine.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
        self.dtype = getattr(torch, dtype)
        self.loaded = load_model(model, self.dtype, device, cfg.engine.seed,
                                 prepack=_prepack(cfg.engine.prepack_weights, device, self.dtype))
        self.tokenizer = self.loaded.tokenizer
        self.model_name = model.rstrip("/").split("/")[-1] if "/" in model else model
        kv_dtype = cfg.kv_dtype if cfg.kv_dtype != "auto" else dtype
        spec = self.loaded.shape.kv_spec(kv_dtype, cfg.page_size)
        self.store = TieredStore(cfg, spec=spec, model_id=self.loaded.model_id)
        self.max_seq_len = min(cfg.max_seq_len, self.loaded.shape.max_position,
                               getattr(self.loaded, "sliding_window", None) or cfg.max_seq_len)
        self.backend = create_backend(cfg.engine.attention_backend, device, spec.torch_dtype, self.loaded.shape.head_dim)
        self.runner = ModelRunner(self.loaded.model, self.store.hot, self.store.warm, self.backend,
                                  min(self.tokenizer.vocab_size, self.loaded.shape.vocab_size))
        self.can_spill = self.backend.supports_spill and self.store.warm.num_slots > 0
        # a cached prefix in warm is leased there and attended in place (the CPU's native kernel)
        warm_in_place = (self.can_spill and self.backend.reads_warm_in_place
                         and self.store.hot.device.type == "cpu")
        self.scheduler = Scheduler(self.store, cfg, self.can_spill, warm_in_place)
        self.aborted: collections.deque[str] = collections.deque()   # request ids, from any thread
        self.fault: Callable[[list[tuple[Request, int]]], None] | None = None   # test hook: raise to fail a step
        self.failed_steps = 0
        release_thread_team()   # loading made this thread a team: the engine's thread makes the one kept (omp.py)

    # requests
    def namespace(self, tenant: str):
        """The namespace of a tenant's pages: its own, or the shared one with engine.share_across_tenants."""
        return self.store.namespace("" if self.config.engine.share_across_tenants else check_text(tenant, "tenant"))

    def make_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, tenant: str = "",
                     request_id: str | None = None, priority: int = 0) -> Request:
        params = (params or SamplingParams()).validate(vocab_size=self.loaded.shape.vocab_size)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequest("prompt is empty")
        if not all(isinstance(t, int) and 0 <= t < self.loaded.shape.vocab_size for t in ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {self.loaded.shape.vocab_size})")
        if len(ids) + 1 > self.max_seq_len:
            raise InvalidRequest(f"prompt is {len(ids)} tokens; the maximum sequence length is {self.max_seq_len}")
        pages = self.store.spec.pages_for(len(ids) + 1)
        room = self.store.hot.num_pages + (self.store.warm.num_slots if self.can_spill else 0)
        if pages > room:
            raise InvalidRequest(f"prompt needs {pages} KV pages; the hot and warm tiers hold {room} "
                                 "(raise hot.pool or warm.bytes)")
        return Request(request_id or f"req-{next(_ids)}", ids, params, self.namespace(tenant),
                       tenant=tenant, priority=priority)

    def submit(self, req: Request) -> None:
        """Queue a request (thread-safe); QueueFull past scheduler.max_queue_depth."""
        self.scheduler.add(req)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # the loop
    def step(self) -> list[Request]:
        """One engine step: schedule, execute, postprocess; returns the requests that advanced (got
        a token or finished).

        An exception inside the step fails only the requests of that step (finish_reason "error",
        their pages released); it is logged once with its traceback and the engine goes on."""
        ids = set()
        while self.aborted:
            ids.add(self.aborted.popleft())
        changed = self.scheduler.abort(ids) if ids else []
        batch: list[tuple[Request, int]] = []
        try:
            batch = self.scheduler.schedule()
            changed += self.scheduler.ended
            if batch:
                changed += self._postprocess(batch, self._execute(batch))
            else:
                changed += self.scheduler.idle()
            if self.config.engine.check_invariants and (problems := self.scheduler.check()):
                raise RuntimeError("engine invariants broken: " + "; ".join(problems[:5]))
        except Exception as exc:  # noqa: BLE001 - one step's failure must not stop the engine
            changed += self._fail_step(batch, exc)
        return changed

    def _execute(self, batch: list[tuple[Request, int]]) -> list[Request]:
        if self.fault is not None:
            self.fault(batch)
        return self.runner.execute(batch)

    def _postprocess(self, batch: list[tuple[Request, int]], sampled: list[Request]) -> list[Request]:
        """Stop checks for the requests that got a token, then the keys of the pages that filled up."""
        for req in sampled:
            if req.error:
                self.scheduler.finish(req, "error")
            else:
                self._check_stop(req)
        for req, _ in batch:
            if req.status is Status.RUNNING:
                self.scheduler.admission.commit(req)
        return sampled

    def _fail_step(self, batch: list[tuple[Request, int]], exc: Exception) -> list[Request]:
        """Fail the step's requests. When scheduling itself failed: the request it was scheduling
        (else every running one), so that a request that cannot be scheduled never fails step
        after step."""
        self.failed_steps += 1
        victims = [r for r, _ in batch] or self.scheduler.culprits()
        log.error("engine step %d failed; failing its %d requests", self.scheduler.step_no, len(victims),
                  exc_info=exc)
        failed = []
        for req in victims:
            if req.status is Status.FINISHED:
                continue
            req.error = f"internal error in the engine step: {type(exc).__name__}: {exc}"
            try:
                self.scheduler.finish(req, "error")
            except Exception:  # noqa: BLE001 - its pages may be inconsistent; still take it out of the queues
                log.exception("releasing the pages of failed request %s failed", req.id)
                self.scheduler.drop(req, "error")
            failed.append(req)
        return failed

    def abort(self, request_id: str) -> None:
        """Stop a request at the next step (thread-safe); its pages are released."""
        self.aborted.append(request_id)

    def _check_stop(self, req: Request) -> None:
        p = req.params
        token = req.tokens[-1]
        out = req.output_ids
        req.text = self.tokenizer.decode(out)
        reason = None
        if (token in self.tokenizer.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        for s in p.stop:
            cut = req.text.find(s)
            if cut >= 0:
                req.text, reason = req.text[:cut], "stop"
        if reason is None and (len(out) >= p.max_tokens or len(req.tokens) >= self.max_seq_len):
            reason = "length"
        if reason:
            self.scheduler.finish(req, reason)

    def generate(self, prompts, params: SamplingParams | None = None, tenant: str = "") -> list[RequestOutput]:
        """Run prompts (a text, a token id list, or a list of those) to completion, batched."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        reqs = [self.make_request(p, params, tenant) for p in prompts]
        for r in reqs:
            self.scheduler.add(r, bounded=False)
        while any(r.status is not Status.FINISHED for r in reqs):
            self.step()
        return [r.output() for r in reqs]

    def stats(self) -> dict:
        return {"computed_tokens": self.runner.computed_tokens, "preemptions": self.scheduler.preemptions,
                **self.scheduler.counts(), "failed_steps": self.failed_steps,
                "spilled_pages": self.scheduler.admission.spilled_pages}

    def close(self) -> None:
        self.store.close()


def _prepack(value: str, device: torch.device, dtype: torch.dtype) -> bool:
    """engine.prepack_weights: auto = wherever it can (the CPU, float32 or bfloat16)."""
    possible = can_prepack(device, dtype)
    if value == "true" and not possible:
        raise ConfigError("engine.prepack_weights", value,
                          f"needs the CPU and float32 or bfloat16 weights (here: {device.type}, "
                          f"{str(dtype).removeprefix('torch.')}); use auto or false")
    return value == "true" or (value == "auto" and possible)


def _flatten(cfg: StoreConfig) -> dict:
    out = {}
    for path in store_key_paths(type(cfg)):
        obj = cfg
        for part in path.split("."):
            obj = getattr(obj, part)
        out[path] = ",".join(f"{k}={v}" for k, v in obj.items()) if isinstance(obj, dict) else obj
    return out
