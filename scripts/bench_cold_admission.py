#!/usr/bin/env python3
"""Inter-token latency (ITL) of running streams while requests whose long prefixes are in the
cold tier arrive, next to the same streams with nothing arriving.

    scripts/bench_cold_admission.py [--model tiny-16k] [--streams 8] [--arrivals 6]
                                    [--prefix-tokens 8192] [--rounds 3] [--window-s 3]

Prints one JSON object on stdout (progress goes to stderr).

One `kvstore serve` (a child process, free loopback ports, a temporary data directory) runs
the model. Setup: `--arrivals` prompts of `--prefix-tokens` tokens (seeded random token ids)
are computed once (max_tokens=1), then pushed into the cold tier with the admin API
(POST /v1/evict to=cold), and POST /v1/lookup must report each of them cached in cold only
(`--prefix-tier warm` or `hot` keep them there instead: controls).
Then rounds, baseline and with-arrivals interleaved (B, W, B, W, ...):
    every round   pushes the prefixes back down (and checks), starts `--streams` streaming
                  greedy completions (short prompts, ignore_eos) and waits until each has its
                  first tokens; the measured window then lasts `--window-s` seconds
    W rounds      also send, spread over the first half of the window, one request per prefix:
                  the prefix and a short question new to the round; the window lasts at least
                  until every one of them is answered
ITL: for each stream, the time between consecutive chunks inside the window, split evenly over
the tokens a chunk carries. Reported: p50, p99, mean and max ITL of each kind, the ratio
p99 with arrivals / p99 baseline (goal <= 1.5), what the arrivals found in cache, and the
server's garbage collections over the whole run (`gc`: by generation, how many and the longest
pause; the objects frozen at startup).

The arrivals ask for one token: an 8K-token request that went on decoding would add its 8K-token
attention to every step of every stream whatever tier its prefix came from (and the torch backend
pads a decode batch to its longest context). Each arrival still costs one step that computes its
question over its 8K-token prefix; `--prefix-tier hot` measures that floor.

Model: `tiny-16k` (the default) is the tiny preset's shape (2 layers, 2 KV heads of 16, fp32 KV:
8 KiB a page) with 16K positions, written as a model directory of seeded random weights, since
the tiny preset stops at 4,096 positions. Any preset or model directory may be given instead
(`small` fits 8K prompts, but computing one takes minutes on two cores). The server runs with
OMP_NUM_THREADS=--threads (default 1: steadier step times on a busy machine).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
if (VENV / "bin" / "python").exists() and Path(sys.prefix).resolve() != VENV.resolve():
    os.execv(str(VENV / "bin" / "python"), [str(VENV / "bin" / "python"), __file__, *sys.argv[1:]])
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import aiohttp  # noqa: E402

from kvstore.placement.index import CACHE_TIERS  # noqa: E402
from remote_harness import terminate  # noqa: E402

BOS = 256               # the byte tokenizer's, and tiny-16k's
QUESTION_TOKENS = 24
STREAM_PROMPT_TOKENS = 32
ARRIVAL_MAX_TOKENS = 1    # see the module docstring
GOAL_P99_RATIO = 1.5
READY_TIMEOUT_S = 300


class BenchError(Exception):
    """The benchmark cannot go on: printed on stderr, exit 1."""


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


# the model
def write_tiny_16k(path: Path, seed: int = 0) -> Path:
    """The tiny preset's shape with 16K positions: config.json, seeded random weights and a
    byte-level tokenizer (ids 0-255 are bytes, then <s>, </s>, <pad>)."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    from engine.model import LlamaModel
    from kvstore.pages.shapes import from_hf_config

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "vocab_size": 512, "max_position_embeddings": 16384, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "bos_token_id": 256, "eos_token_id": 257}))
    net = LlamaModel(from_hf_config(path))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn(p.shape, generator=gen) * 0.02)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path / "model.safetensors"))

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    order = sorted(byte_chars, key=lambda c: _byte_of(c))
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(order)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>", "<pad>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                            "pad_token": "<pad>"}))
    return path


def _byte_of(char: str) -> int:
    """GPT-2's byte-to-unicode map, inverted: printable bytes map to themselves, the rest above 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if ord(char) in printable:
        return ord(char)
    others = [b for b in range(256) if b not in printable]
    return others[ord(char) - 256]


def kv_bytes_per_token(model: str) -> int:
    from kvstore.pages.shapes import load_shape

    return load_shape(model).kv_spec("float32", 16).page_bytes // 16


# the server
class Server:
    def __init__(self, model: str, data: Path, settings: dict[str, str], threads: int):
        sets = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        env["OMP_NUM_THREADS"] = str(threads)
        self.out, self.log = data.parent / "serve.out", data.parent / "serve.log"
        with open(self.out, "wb") as stdout, open(self.log, "wb") as stderr:
            self.proc = subprocess.Popen([sys.executable, "-m", "app", "serve", "--model", model, "--port", "0",
                                          "--admin-port", "0", "--data-dir", str(data), *sets],
                                         stdout=stdout, stderr=stderr, env=env, cwd=data.parent)
        self.url = self.admin = ""

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            m = re.search(r"ready on (http://\S+) .*admin API on (http://\S+)\n", self.out.read_text())
            if m:
                self.url, self.admin = m.group(1), m.group(2)
                return
            time.sleep(0.2)
        raise BenchError(f"kvstore serve did not start:\n{self.log.read_text(errors='replace')[-3000:]}")

    def stop(self) -> None:
        terminate(self.proc, 60, "kvstore serve")


async def post(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with session.post(url, json=body) as r:
        data = await r.json(content_type=None)
        if r.status != 200:
            raise BenchError(f"POST {url}: {r.status} {str(data)[:300]}")
        return data


# measuring
class Stream:
    """One streaming completion: (arrival time, tokens) of each chunk until stopped."""

    def __init__(self, session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int):
        self.chunks: list[tuple[float, int]] = []
        self.task = asyncio.create_task(self._run(session, url, prompt, max_tokens))

    async def _run(self, session, url, prompt, max_tokens) -> None:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "return_token_ids": True}
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                raise BenchError(f"stream: {r.status} {(await r.text())[:300]}")
            async for line in r.content:
                now = time.perf_counter()
                line = line.strip()
                if not line.startswith(b"data: {"):
                    continue
                choice = json.loads(line[len(b"data: "):])["choices"][0]
                if choice.get("token_ids"):
                    self.chunks.append((now, len(choice["token_ids"])))

    def tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    def itl(self, t0: float, t1: float) -> list[float]:
        out = []
        for (a, _), (b, n) in zip(self.chunks, self.chunks[1:]):
            if t0 <= a and b <= t1:
                out += [(b - a) / n] * n
        return out

    async def stop(self) -> None:
        self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass


async def arrive(session, url: str, prompt: list[int], at: float) -> dict:
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    start = time.perf_counter()
    out = await post(session, url + "/v1/completions", {"prompt": prompt, "max_tokens": ARRIVAL_MAX_TOKENS,
                                                        "temperature": 0, "ignore_eos": True})
    return {"latency_s": time.perf_counter() - start, "done": time.perf_counter(),
            "cached": out["usage"]["kvstore"]["cached_tokens"]}


async def push_down(session, admin: str, prefixes: list[list[int]], tier: str) -> None:
    """Evict every prefix down to `tier` (cold: out of hot and warm), then check that the lookup
    finds all of it there and nowhere else."""
    for prefix in prefixes:
        for _ in range(50):
            if tier != "hot":
                await post(session, admin + "/v1/evict", {"tokens": prefix, "to": tier})
            found = await post(session, admin + "/v1/lookup", {"tokens": prefix})
            if found["cached_prefix_tokens"] == len(prefix) and {k for k, v in found["tiers"].items() if v} == {tier}:
                break
            await asyncio.sleep(0.1)
        else:
            raise BenchError(f"a prefix is not in {tier} only: {found}")


def summary(samples: list[float]) -> dict:
    s = sorted(samples)

    def pct(q: float) -> float:
        return s[min(len(s) - 1, int(q * len(s)))] * 1000 if s else float("nan")
    return {"n": len(s), "p50_ms": round(pct(0.50), 3), "p99_ms": round(pct(0.99), 3),
            "mean_ms": round(sum(s) / len(s) * 1000, 3) if s else None, "max_ms": round(s[-1] * 1000, 3) if s else None}


async def bench(args, server: Server) -> dict:
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(256) for _ in range(n)]

    prefixes = [[BOS] + tokens(args.prefix_tokens - 1) for _ in range(args.arrivals)]
    itl = {"baseline": [], "with_arrivals": []}
    arrivals: list[dict] = []
    rounds = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t = time.perf_counter()
        for prefix in prefixes:
            await post(session, server.url + "/v1/completions", {"prompt": prefix, "max_tokens": 1, "temperature": 0})
        compute_s = time.perf_counter() - t
        log(f"computed {len(prefixes)} prefixes of {args.prefix_tokens} tokens in {compute_s:.1f} s")
        await push_down(session, server.admin, prefixes, args.prefix_tier)
        stats = await (await session.get(server.admin + "/v1/stats")).json()
        log("pages: " + ", ".join(f"{t} {stats['tiers'][t]['pages']}" for t in ("hot", "warm", "cold")))

        for r in range(2 * args.rounds):
            kind = "with_arrivals" if r % 2 else "baseline"
            await push_down(session, server.admin, prefixes, args.prefix_tier)
            streams = [Stream(session, server.url, [BOS] + tokens(STREAM_PROMPT_TOKENS - 1), args.stream_max_tokens)
                       for _ in range(args.streams)]
            while not all(len(s.chunks) >= 3 for s in streams):
                for s in streams:
                    if s.task.done():
                        s.task.result()   # its error, if it failed
                        raise BenchError("a stream ended before the window")
                await asyncio.sleep(0.01)
            t0 = time.perf_counter()
            t1 = t0 + args.window_s
            jobs = []
            if kind == "with_arrivals":
                spacing = args.window_s / 2 / args.arrivals
                jobs = [asyncio.create_task(arrive(session, server.url, prefix + tokens(QUESTION_TOKENS),
                                                   t0 + i * spacing)) for i, prefix in enumerate(prefixes)]
            await asyncio.sleep(args.window_s)
            done = await asyncio.gather(*jobs)
            t1 = max([t1] + [d["done"] for d in done])
            if any(s.task.done() for s in streams):
                raise BenchError("a stream ended inside the window: raise --stream-max-tokens")
            for s in streams:
                itl[kind] += s.itl(t0, t1)
            arrivals += done
            rounds.append({"kind": kind, "window_s": round(t1 - t0, 3),
                           "stream_tokens": sum(len(s.itl(t0, t1)) for s in streams),
                           "itl": summary([x for s in streams for x in s.itl(t0, t1)])})
            log(f"round {r}: {kind}: {rounds[-1]}")
            for s in streams:
                await s.stop()
            await asyncio.sleep(0.3)   # the aborted streams leave the engine
        final = await (await session.get(server.admin + "/v1/stats")).json()
        gc_pauses = collector_pauses(await (await session.get(server.admin + "/metrics")).text())

    base, with_ = summary(itl["baseline"]), summary(itl["with_arrivals"])
    ratio = with_["p99_ms"] / base["p99_ms"]
    cached = {tier: sum(a["cached"].get(tier, 0) for a in arrivals) for tier in CACHE_TIERS}
    lat = sorted(a["latency_s"] for a in arrivals)
    return {
        "benchmark": "cold_admission", "model": args.model_name, "streams": args.streams,
        "arrivals_per_round": args.arrivals, "prefix_tokens": args.prefix_tokens, "prefix_tier": args.prefix_tier,
        "rounds": args.rounds,
        "window_s": args.window_s, "threads": args.threads,
        "itl_baseline": base, "itl_with_arrivals": with_,
        "p99_ratio": round(ratio, 3), "goal_p99_ratio": GOAL_P99_RATIO, "goal_met": ratio <= GOAL_P99_RATIO,
        "arrivals": {"count": len(arrivals), "cached_tokens": cached,
                     "latency_p50_s": round(lat[len(lat) // 2], 3) if lat else None,
                     "latency_max_s": round(lat[-1], 3) if lat else None},
        "prefix_compute_s": round(compute_s, 2), "per_round": rounds,
        "engine": final.get("engine"), "gc": gc_pauses, "settings": args.settings,
    }


def collector_pauses(metrics: str) -> dict:
    """The server's garbage collections (its /metrics kvstore_gc_*): by generation, how many, the
    longest pause in ms; and the objects it froze at startup."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict = {"collections": {}, "longest_pause_ms": {}, "frozen_objects": None}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == "kvstore_gc_collections_total":
                out["collections"][sample.labels["generation"]] = int(sample.value)
            elif sample.name == "kvstore_gc_longest_pause_seconds":
                out["longest_pause_ms"][sample.labels["generation"]] = round(sample.value * 1e3, 1)
            elif sample.name == "kvstore_gc_frozen_objects":
                out["frozen_objects"] = int(sample.value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-16k", help="tiny-16k (written to a temporary directory), a preset "
                    "or a model directory")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--arrivals", type=int, default=6, help="requests with a cold prefix per W round")
    ap.add_argument("--prefix-tokens", type=int, default=8192)
    ap.add_argument("--prefix-tier", choices=("cold", "warm", "hot"), default="cold",
                    help="where the arrivals find their prefixes (warm and hot: controls)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each kind")
    ap.add_argument("--window-s", type=float, default=3.0)
    ap.add_argument("--stream-max-tokens", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the server")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more server settings")
    args = ap.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-cold-admission-") as tmp:
        tmp = Path(tmp)
        model = str(write_tiny_16k(tmp / "tiny-16k")) if args.model == "tiny-16k" else args.model
        args.model_name = args.model
        per_token = kv_bytes_per_token(model)
        tokens = args.arrivals * (args.prefix_tokens + 64) + args.streams * (STREAM_PROMPT_TOKENS + args.stream_max_tokens)
        pool = max(64 << 20, 2 * per_token * tokens)
        args.settings = {"max_seq_len": str(max(8448, args.prefix_tokens + 256)), "hot.pool": f"{pool >> 20}MiB",
                         "warm.bytes": f"{pool >> 20}MiB", "hot.device": "cpu",
                         **dict(kv.split("=", 1) for kv in args.set)}
        server = Server(model, tmp / "data", args.settings, args.threads)
        try:
            server.wait_ready()
            log(f"serving {args.model} with {args.settings}")
            result = asyncio.run(bench(args, server))
        except BenchError as exc:
            log(f"bench_cold_admission: {exc}")
            log(server.log.read_text(errors="replace")[-2000:])
            sys.exit(1)
        finally:
            server.stop()
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
