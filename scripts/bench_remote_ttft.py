#!/usr/bin/env python3
"""Time to first token (TTFT) of a fresh `kvstore serve` instance for a long document whose KV
another instance computed: recomputed, read from the remote tier, or fetched from a live peer.

    scripts/bench_remote_ttft.py [--model DIR|tiny] [--tokens 4096] [--repeat 3]

Prints one JSON object on stdout (progress goes to stderr).

The benchmark starts its own redis-server (a free loopback port, no persistence, in a temporary
directory; redis-server must be installed) and `kvstore serve` child processes (free loopback
ports, each its own data directory under a temporary directory), and stops them all with
SIGTERM at the end, also on an error or when it is interrupted.

Setup: instance A runs with the remote tier (--set remote.url=redis://...) and the peer settings
(--redis-url on the same redis-server, cluster.token, cluster.fetch_policy=always). It computes
the document once (max_tokens=1; its answer is the reference), then the benchmark waits until
A's write-behind has copied the document's full pages to the remote store (admin /v1/stats:
tiers.remote written_pages + already_present_pages grew by the document's full pages, and
queued_pages is 0).

Ways, interleaved (repetition r starts r places further along recompute, remote, peer):
    recompute  a fresh instance with no remote tier and no peers computes the whole document
    remote     a fresh instance with remote.url (the same redis-server) reads the document's
               pages from the remote tier before computing the last tokens
    peer       a fresh instance with the peer settings fetches the pages from A (before timing,
               the benchmark waits until the fresh instance's /v1/lookup names A)
Every repetition of every way starts a new instance (a new data directory); its start-up and
its warm-up are not timed. The document is sent once, POST /v1/completions with a prompt of
token ids, max_tokens=1, temperature 0, "stream": false. TTFT is the time from sending the
request (on a connection opened beforehand) to having read the whole response: with one new
token, the response is the first token. Checks, each sample: the answer's token ids equal A's,
and the cached tokens came from where they should (usage.kvstore.cached_tokens): remote and peer
>= 95% of the reusable tokens (the document's full pages, its last token excluded: a prompt's
last token is always computed) from that source; recompute: none cached anywhere.

Reported: the medians of TTFT per way, the ratios recompute / remote and peer / remote (how many
times faster the remote tier is), every sample (cached and computed tokens, bytes the remote
tier read, pages fetched from the peer), the KV bytes of the document (full pages x page bytes)
and whether every check passed. Exit status 1 when a check failed (the JSON is still printed) or
the benchmark could not go on.

Document: seeded and deterministic. For a model directory with a tokenizer.json, English-like
text of random common words, tokenized (no special tokens) and cut to --tokens ids; for a preset
(`tiny`: ids < 256 are bytes) seeded random ids < 256.

Model: by default the real model directory ~/.cache/kvstore/models/SmolLM2-135M-Instruct
(scripts/real_model builds it); the benchmark refuses to run when it is missing and --model is not
given. `--model tiny` (the tiny preset, float32 KV and engine: quick, for tests) or any preset or
model directory may be given instead.
"""

from __future__ import annotations

import remote_harness  # the standard library only

remote_harness.enter_venv(__file__)

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from remote_harness import (SERVED_NAME, BenchError, Fleet, Instance, Stopped, get, log,  # noqa: E402
                            missing_executable, post, server_url, start_servers, stop_on_signals)

DEFAULT_MODEL = Path.home() / ".cache" / "kvstore" / "models" / "SmolLM2-135M-Instruct"
WAYS = ("recompute", "remote", "peer")
SOURCE = {"remote": "remote", "peer": "peer"}   # the cached_tokens key each way must be served from
MIN_SOURCE_SHARE = 0.95
REQUEST_TIMEOUT_S = 1800
WRITTEN_TIMEOUT_S = 600
PEER_VISIBLE_TIMEOUT_S = 60
CLUSTER_TOKEN = "bench-remote-ttft"
WORDS = ("the of and to in is was for that on as with by at from his her an were which this be are or "
         "had not but it first one their its new after who they have two been has also more other than "
         "time into during only over all would when most such city made about between while through "
         "some under world school where there later three years many both second these river state "
         "university team north south national people since may early known war season final before "
         "music group film series family against house including album public government around water "
         "history local church until being village against number station game place called general "
         "because island century original however children near long each county small district "
         "company several based released played home four work well back high part former member "
         "named left until following street record built song took could last large east west life").split()


# the document
def document(model: str, n: int, seed: int) -> tuple[list[int], str]:
    rng = random.Random(seed)
    tok_file = Path(model) / "tokenizer.json"
    if not tok_file.is_file():
        return [rng.randrange(256) for _ in range(n)], "seeded random ids < 256"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_file))
    ids: list[int] = []
    words = max(64, n)
    while len(ids) < n:
        sentences, left = [], words
        while left > 0:
            k = min(left, rng.randint(6, 20))
            s = " ".join(rng.choice(WORDS) for _ in range(k))
            sentences.append(s[0].upper() + s[1:] + ".")
            left -= k
        ids = tok.encode(" ".join(sentences), add_special_tokens=False).ids
        words *= 2
    return ids[:n], "seeded text of common English words, tokenized (no special tokens)"


# measuring
def completion(inst: Instance, doc: list[int]) -> tuple[dict, float]:
    body = {"model": SERVED_NAME, "prompt": doc, "max_tokens": 1, "temperature": 0, "stream": False,
            "return_token_ids": True}
    out, elapsed = post(inst.api + "/v1/completions", body, timeout=REQUEST_TIMEOUT_S)
    return out, elapsed


def remote_stats(inst: Instance) -> dict:
    return get(inst.admin + "/v1/stats")["tiers"]["remote"]


def wait_written(a: Instance, before: int, pages: int) -> dict:
    """Until A's remote tier has written (or found present) `pages` more pages, none queued."""
    deadline = time.monotonic() + WRITTEN_TIMEOUT_S
    while True:
        r = remote_stats(a)
        done = r["written_pages"] + r["already_present_pages"] - before
        if done >= pages and r["queued_pages"] == 0:
            return r
        if r["state"] != "up" and r.get("last_error"):
            log(f"A's remote tier: {r['state']}: {r['last_error']}")
        if time.monotonic() > deadline:
            raise BenchError(f"A's remote tier wrote {done} of the document's {pages} pages in "
                             f"{WRITTEN_TIMEOUT_S} s: {r}")
        time.sleep(0.1)


def wait_peer_visible(inst: Instance, doc: list[int], owner: str, tokens: int) -> dict:
    """Until the fresh instance's lookup names `owner` holding at least `tokens` of the document."""
    deadline = time.monotonic() + PEER_VISIBLE_TIMEOUT_S
    while True:
        found = post(inst.admin + "/v1/lookup", {"tokens": doc})[0]
        mine = [p for p in found["peers"] if p["instance"] == owner]
        if mine and mine[0]["tokens"] >= tokens:
            return mine[0]
        if time.monotonic() > deadline:
            raise BenchError(f"instance {inst.name} does not see {owner} holding the document: {found['peers']}")
        time.sleep(0.1)


def check(way: str, out: dict, expected: list[int], reusable: int) -> list[str]:
    """What is wrong with one sample's answer (empty: nothing)."""
    problems = []
    tokens = out["choices"][0].get("token_ids")
    if tokens != expected:
        problems.append(f"token ids {tokens} != A's {expected}")
    cached = out["usage"]["kvstore"]["cached_tokens"]
    if way == "recompute":
        if any(cached.values()):
            problems.append(f"recompute found cached tokens: {cached}")
    else:
        src = SOURCE[way]
        if cached.get(src, 0) < MIN_SOURCE_SHARE * reusable:
            problems.append(f"cached_tokens.{src} = {cached.get(src, 0)} < {MIN_SOURCE_SHARE:.0%} of the "
                            f"{reusable} reusable tokens: {cached}")
    return problems


def counters(stats: dict) -> dict[str, int]:
    """The counters a sample reports, as differences across its request."""
    r = stats["tiers"].get("remote") or {}
    fetch = (stats.get("cluster") or {}).get("fetch") or {}
    return {"remote_read_bytes": r.get("read_bytes", 0), "remote_hit_pages": r.get("hits", 0),
            "remote_miss_pages": r.get("misses", 0), "corrupt_pages": stats.get("corrupt_pages", 0),
            "peer_fetched_pages": fetch.get("fetched_pages", 0), "peer_failed": fetch.get("failed", 0)}


def median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def bench(args, fleet: Fleet, redis_url: str) -> dict:
    doc, doc_kind = document(fleet.model, args.tokens, args.seed)
    if len(doc) != args.tokens:
        raise BenchError(f"the document has {len(doc)} tokens, not {args.tokens}")
    peer_flags = ["--redis-url", redis_url, "--set", f"cluster.token={CLUSTER_TOKEN}",
                  "--set", "cluster.fetch_policy=always"]
    remote_flags = ["--set", f"remote.url={redis_url}"]

    log("starting instance A (remote tier and peers)")
    a = fleet.start("A", *remote_flags, *peer_flags, "--set", "cluster.instance_id=A")
    stats = get(a.admin + "/v1/stats")
    page_size = int(re.search(r"(\d+) tokens/page", stats["spec"]).group(1))
    page_bytes = stats["page_bytes"]
    full_pages = len(doc) // page_size
    reusable = (len(doc) - 1) // page_size * page_size
    before = stats["tiers"]["remote"]["written_pages"] + stats["tiers"]["remote"]["already_present_pages"]
    log(f"A computes the document: {len(doc)} tokens, {full_pages} full pages of {page_bytes} bytes "
        f"({full_pages * page_bytes / 2**20:.1f} MiB of KV)")
    out, a_compute_s = completion(a, doc)
    expected = out["choices"][0]["token_ids"]
    t = time.perf_counter()
    written = wait_written(a, before, full_pages)
    a_written_s = time.perf_counter() - t
    log(f"A: computed in {a_compute_s:.2f} s; its pages reached the remote {a_written_s:.2f} s later "
        f"({written['written_pages']} written, {written['already_present_pages']} already present)")

    samples: list[dict] = []
    for rep in range(args.repeat):
        order = WAYS[rep % len(WAYS):] + WAYS[:rep % len(WAYS)]
        for way in order:
            name = f"{way}-{rep}"
            extra = {"recompute": [], "remote": remote_flags,
                     "peer": [*peer_flags, "--set", f"cluster.instance_id={name}"]}[way]
            t = time.perf_counter()
            inst = fleet.start(name, *extra)
            sample: dict = {"way": way, "rep": rep, "startup_s": round(time.perf_counter() - t, 2)}
            if way == "peer":
                sample["peer_tier"] = wait_peer_visible(inst, doc, "A", reusable)["tier"]
            before = counters(get(inst.admin + "/v1/stats"))   # its warm-up may have read some already
            out, ttft = completion(inst, doc)
            usage = out["usage"]["kvstore"]
            sample.update(ttft_s=round(ttft, 4), cached_tokens=usage["cached_tokens"],
                          prefill_tokens=usage["prefill_tokens"])
            after = counters(get(inst.admin + "/v1/stats"))
            sample.update({k: after[k] - before[k] for k in after
                           if k.startswith(way) or (way == "remote" and k == "corrupt_pages")})
            sample["problems"] = check(way, out, expected, reusable)
            samples.append(sample)
            log(f"rep {rep} {way}: TTFT {ttft:.3f} s, cached {usage['cached_tokens']}, "
                f"computed {usage['prefill_tokens']}" + (f"; PROBLEMS: {sample['problems']}" if sample["problems"]
                                                         else ""))
            t = time.perf_counter()
            fleet.stop(inst)
            log(f"  ({name}: start-up {sample['startup_s']:.1f} s, stop {time.perf_counter() - t:.1f} s)")

    a_final = get(a.admin + "/v1/stats")
    ttft = {w: [s["ttft_s"] for s in samples if s["way"] == w] for w in WAYS}
    med = {w: median(ttft[w]) for w in WAYS}
    problems = [f"{s['way']}-{s['rep']}: {p}" for s in samples for p in s["problems"]]
    return {
        "benchmark": "remote_ttft", "model": args.model_name, "tokens": len(doc), "document": doc_kind,
        "seed": args.seed, "repeat": args.repeat,
        "ttft_measure": "seconds from sending POST /v1/completions (max_tokens=1, stream false, connection "
                        "already open) to having read the whole response",
        "page_size": page_size, "page_bytes": page_bytes, "kv_spec": stats["spec"],
        "full_pages": full_pages, "reusable_tokens": reusable,
        "kv_bytes": full_pages * page_bytes, "kv_bytes_per_token": page_bytes // page_size,
        "median_ttft_s": med,
        "ttft_s": ttft,
        "speedup": {"recompute_over_remote": ratio(med["recompute"], med["remote"]),
                    "peer_over_remote": ratio(med["peer"], med["remote"])},
        "checks_passed": not problems, "problems": problems,
        "min_source_share": MIN_SOURCE_SHARE,
        "a": {"compute_s": round(a_compute_s, 4), "remote_written_after_s": round(a_written_s, 3),
              "remote": {k: a_final["tiers"]["remote"][k] for k in
                         ("written_pages", "already_present_pages", "queued_pages", "skipped_pages", "used_bytes")},
              "peer_fetch_served": a_final.get("cluster", {}).get("fetch")},
        "samples": samples,
        "settings": fleet.settings,
    }


def main() -> None:
    doc = __doc__.split("\n\n")
    ap = argparse.ArgumentParser(description="\n\n".join(doc[:1] + doc[2:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help=f"a model directory or a preset (`tiny`: float32 KV and engine); default: {DEFAULT_MODEL} "
                         "(scripts/real_model builds it), refused when missing")
    ap.add_argument("--tokens", type=int, default=4096, help="document length in tokens (default 4096)")
    ap.add_argument("--repeat", type=int, default=3, help="repetitions of each way, interleaved (default 3)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the document (default 0)")
    ap.add_argument("--threads", type=int, default=0,
                    help="OMP_NUM_THREADS of every instance (default 0: not set, torch's own choice)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config key for every instance (repeatable), e.g. hot.device=cpu")
    args = ap.parse_args()
    if args.tokens < 2:
        ap.error("--tokens must be at least 2")
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    if args.model is None:
        if not (DEFAULT_MODEL / "config.json").is_file():
            print(f"bench_remote_ttft: the default model {DEFAULT_MODEL} does not exist: build it with "
                  "`.venv/bin/python scripts/real_model`, or pass --model (e.g. --model tiny)", file=sys.stderr)
            sys.exit(2)
        args.model = str(DEFAULT_MODEL)
    elif Path(args.model).expanduser().is_dir():
        args.model = str(Path(args.model).expanduser().resolve())
    args.model_name = Path(args.model).name if Path(args.model).is_dir() else args.model
    why = missing_executable("redis-server")
    if why:
        print(f"bench_remote_ttft: {why}", file=sys.stderr)
        sys.exit(2)

    from kvstore.pages.shapes import load_shape

    tiny = args.model == "tiny"
    bytes_per_token = load_shape(args.model).kv_spec("float32", 16).page_bytes // 16   # sizing: the widest KV
    kv = bytes_per_token * (args.tokens + 64)
    settings = {"hot.pool": f"{max(256 << 20, 2 * kv) >> 20}MiB", "warm.bytes": f"{max(1 << 30, 2 * kv) >> 20}MiB"}
    if args.tokens + 1 > 8192:
        settings["max_seq_len"] = str(args.tokens + 16)
    if tiny:
        settings.update({"kv_dtype": "float32", "engine.dtype": "float32"})
    for kv_pair in args.set:
        if "=" not in kv_pair:
            ap.error(f"--set {kv_pair}: expected KEY=VALUE")
        k, v = kv_pair.split("=", 1)
        settings[k] = v

    started = time.perf_counter()
    stop_on_signals()
    status, result = 0, None
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-remote-ttft-") as tmp:
        tmp = Path(tmp)
        fleet = Fleet(tmp, args.model, settings, args.threads)
        servers: list = []
        try:
            servers = start_servers("single", tmp)
            log(f"redis-server on port {servers[0].port}; model {args.model}; settings {settings}")
            result = bench(args, fleet, server_url("single", servers))
        except BenchError as exc:
            log(f"bench_remote_ttft: {exc}")
            for inst in fleet.live:
                log(f"--- {inst.name} log tail ---\n{inst.tail(1500)}")
            status = 1
        except (KeyboardInterrupt, Stopped) as exc:
            log(f"bench_remote_ttft: interrupted ({exc or 'SIGINT'}): stopping the instances")
            status = 130
        finally:
            fleet.stop_all()
            for server in servers:
                server.stop()
    if result is None:
        sys.exit(status)
    result["instance_exits"] = fleet.exits
    result["clean_exits"] = all(rc == 0 for rc in fleet.exits.values())
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))
    sys.exit(0 if result["checks_passed"] else 1)


if __name__ == "__main__":
    main()
