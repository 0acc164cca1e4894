"""`kvstore serve` under cache pressure: a hot tier of 64 pages, concurrent greedy clients over a
sliding window of new prompts, half of them behind one of three shared prefixes.

Every answer must equal the prompt's answer with nothing cached (computed here, one prompt at a
time, by the engine library with the same preset, seed and dtype), no request may fail, and
the engine must still serve at the end. The server's stats must show that the run reused cached
pages and ran under pressure (preemptions or evictions), or the test proves nothing.

KVSTORE_PRESSURE_S shortens (or lengthens) the run for local checks.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import load_config

from conftest import clean_env, terminate

DURATION_S = float(os.environ.get("KVSTORE_PRESSURE_S", "60"))
CLIENTS = 4
WINDOW = 8                  # a request asks one of the newest WINDOW prompts
NEW_EVERY = 3               # requests per new prompt
PREFIX_WORDS = 50
SEED = 20240
SERVE_SETTINGS = {"hot.pool": "512KiB", "warm.bytes": "512KiB", "max_seq_len": "1024",
                  "hot.device": "cpu"}      # fp32 on the CPU, the reference on the same backend: token for token
REQUEST_TIMEOUT_S = 30
THREADS = 1                 # torch threads, here and in the server: fast small ops, the same numerics
READY_TIMEOUT_S = 120

pytestmark = [pytest.mark.slow, pytest.mark.timeout(DURATION_S + 240)]


# prompts
def _words(rng: random.Random, n: int) -> list[str]:
    syllables = ["ka", "lo", "mi", "ren", "tus", "va", "dor", "pe", "qui", "zan", "bel", "fo", "gri", "hu", "sol"]
    return ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(n)]


PREFIXES = [" ".join(_words(random.Random(SEED + i), PREFIX_WORDS)) for i in range(3)]


def prompt(n: int) -> tuple[str, int]:
    """Prompt number n and its max_tokens: even ones continue a shared prefix, odd ones stand alone."""
    rng = random.Random(SEED * 1000 + n)
    if n % 2 == 0:
        text = f"{PREFIXES[(n // 2) % 3]} question {n}: {' '.join(_words(rng, rng.randint(4, 30)))}?"
    else:
        text = f"note {n}: {' '.join(_words(rng, rng.randint(20, 90)))}."
    return text, rng.randint(8, 48)


def prompt_of_request(k: int) -> int:
    """The prompt request k asks: a new prompt enters the window every NEW_EVERY requests."""
    newest = k // NEW_EVERY
    return newest - random.Random(SEED + 7 * k).randrange(min(newest + 1, WINDOW))


# the server
@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    admin: str
    log: Path

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's log, without the access log."""
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return "\n".join(line for line in lines if ".access" not in line)[-chars:]


def start_serve(tmp: Path, settings: dict = SERVE_SETTINGS) -> Server:
    sets = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    out, log = tmp / "serve.out", tmp / "serve.log"
    with open(out, "wb") as stdout, open(log, "wb") as stderr:     # files: a full pipe would block the server
        proc = subprocess.Popen([sys.executable, "-m", "app", "serve", "--model", "tiny", "--port", "0",
                                 "--admin-port", "0", "--data-dir", str(tmp / "data"), *sets],
                                stdout=stdout, stderr=stderr, env=clean_env(OMP_NUM_THREADS=str(THREADS)), cwd=tmp)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        m = re.search(r"ready on (http://\S+) .*admin API on (http://\S+)\n", out.read_text())
        if m:
            return Server(proc, m.group(1), m.group(2), log)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    stop_serve(Server(proc, "", "", log))
    pytest.fail(f"kvstore serve did not start (exit {proc.returncode}):\n{log.read_text(errors='replace')[-3000:]}")


def stop_serve(server: Server) -> None:
    terminate(server.proc)


# the clients
@dataclass
class Run:
    answers: list[tuple[int, list[int], str]] = field(default_factory=list)   # (prompt, token ids, finish_reason)
    statuses: collections.Counter = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)
    cached_tokens: int = 0
    requests: int = 0


async def complete(session: aiohttp.ClientSession, url: str, n: int) -> tuple[int, dict | str]:
    text, max_tokens = prompt(n)
    body = {"model": "tiny", "prompt": text, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.json() if r.content_type == "application/json" else await r.text()


async def client(session: aiohttp.ClientSession, url: str, counter, deadline: float, run: Run) -> None:
    while time.monotonic() < deadline and len(run.failures) < 20:
        k = next(counter)
        n = prompt_of_request(k)
        run.requests += 1
        try:
            status, body = await complete(session, url, n)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            run.statuses[type(exc).__name__] += 1
            run.failures.append(f"request {k} (prompt {n}): {type(exc).__name__}: {exc}")
            continue
        run.statuses[status] += 1
        if status != 200:
            run.failures.append(f"request {k} (prompt {n}): {status} {str(body)[:200]}")
            continue
        choice = body["choices"][0]
        run.answers.append((n, choice["token_ids"], choice["finish_reason"]))
        run.cached_tokens += body["usage"]["prompt_tokens_details"]["cached_tokens"]


async def load(server: Server) -> tuple[Run, dict]:
    """The clients for DURATION_S; then /health, one more request and the admin stats."""
    run = Run()
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        counter = itertools.count()
        deadline = time.monotonic() + DURATION_S
        await asyncio.gather(*(client(session, server.url, counter, deadline, run) for _ in range(CLIENTS)))
        end: dict = {}
        try:
            async with session.get(server.url + "/health") as r:
                end["health"] = (r.status, await r.text())
            status, body = await complete(session, server.url, 0)
            end["final"] = (status, body)
            async with session.get(server.admin + "/v1/stats") as r:
                end["stats"] = await r.json()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            end["error"] = f"{type(exc).__name__}: {exc}"
    return run, end


# the reference
def reference(tmp: Path, numbers: set[int]) -> dict[int, list[int]]:
    """Each prompt's greedy answer with nothing cached: one at a time, each in a tenant of its own
    (no prefix is shared between them), a hot tier that holds every prompt, no cold tier."""
    config = load_config(None, {}, {"data_dir": str(tmp / "ref"), "hot.device": "cpu", "hot.pool": "16MiB",
                                    "warm.bytes": "0", "cold.enabled": "false",
                                    "max_seq_len": SERVE_SETTINGS["max_seq_len"]})
    llm = LLM("tiny", config=config)
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        want = {}
        for n in sorted(numbers):
            text, max_tokens = prompt(n)
            [out] = llm.generate([text], SamplingParams(max_tokens=max_tokens, temperature=0.0), tenant=f"ref-{n}")
            assert sum(out.cached_tokens.values()) == 0
            want[n] = out.token_ids
        return want
    finally:
        torch.set_num_threads(threads)
        llm.close()


def test_serve_answers_exactly_under_cache_pressure(tmp_path):
    server = start_serve(tmp_path)
    try:
        run, end = asyncio.run(load(server))
        exited = server.proc.poll()
    finally:
        stop_serve(server)
    stats = end.get("stats", {})
    tiers = {name: {k: t[k] for k in ("hits", "misses", "evictions")} for name, t in stats.get("tiers", {}).items()}
    summary = (f"{run.requests} requests, {len(run.answers)} answered, statuses {dict(run.statuses)}, "
               f"{run.cached_tokens} cached prompt tokens; tiers {tiers}; engine {stats.get('engine')}; "
               f"server log without the access log:\n{server.log_tail()}")

    want = reference(tmp_path, {n for n, _, _ in run.answers} | {0})
    wrong = [f"prompt {n}: got {got[:8]} ({len(got)} tokens, {reason}), want {want[n][:8]} ({len(want[n])})"
             for n, got, reason in run.answers if got != want[n]]
    problems = []
    if run.failures:
        problems.append(f"{len(run.failures)} failed requests, first: {run.failures[:5]}")
    if wrong:
        problems.append(f"{len(wrong)} of {len(run.answers)} answers differ from the uncached ones, first: {wrong[:5]}")
    if exited is not None:
        problems.append(f"the server exited with status {exited} during the run")
    if "error" in end:
        problems.append(f"after the run: {end['error']}")
    if end.get("health", (200,))[0] != 200:
        problems.append(f"/health after the run: {end['health']}")
    final = end.get("final")
    if final is not None and (final[0] != 200 or final[1]["choices"][0]["token_ids"] != want[0]):
        problems.append(f"the final request: {final[0]} {str(final[1])[:300]}")
    assert not problems, "\n".join(problems) + "\n" + summary

    # the run must have exercised reuse and pressure
    hits = sum(t["hits"] for t in tiers.values())
    evictions = sum(t["evictions"] for t in tiers.values())
    assert run.cached_tokens > 0 and hits > 0, "no cache hits: " + summary
    assert stats["engine"]["preemptions"] + evictions > 0, "no preemption nor eviction: " + summary
    assert len(run.answers) >= CLIENTS * DURATION_S / 10, "too few answers: " + summary
