"""Engine benchmarks (`scripts/bench_engine`): prefix reuse in long-document QA, and decoding throughput.

long-doc-qa  Many questions over the same long document. Time to first token (the engine's own
             RequestOutput.ttft_s, and the wall time of generate()) when the document prefix is
             recomputed (the first question before anything is cached, the others each in a
             tenant of its own), promoted from cold (LMDB), from warm (host memory), or already in
             hot; and Hugging Face transformers on the same weights with no cache reuse (generate
             with max_new_tokens=1 on the whole prompt). The modes run question by question, so a
             busy spell of the machine slows all of them. The greedy tokens of every cached run
             must equal the recomputed run's (or the hot run's, for questions not recomputed).
decode       Batched greedy decoding throughput (generated tokens a second, prefill included) of
             the engine against transformers' generate on the same weights, batch and lengths
             (equal-length prompts, no padding). The first tokens of every sequence must agree.
compare      Prefill TTFT, batched decode and cached-prefix TTFT of the engine, transformers and vLLM
             (its CPU build, in its own venv) in interleaved rounds: engine/bench_compare.py.

Documents, questions and prompts are deterministic synthetic token ids. Model weights are a
preset's seeded random weights or a Hugging Face directory's; transformers gets the engine's
own state dict. Exit status: 0 when the benchmark ran (goals met or not), 1 when tokens
disagree, 2 on bad options.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import pstats
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import torch

from engine.llm import LLM
from engine.sampler import SamplingParams
from kvstore.config import format_size, parse_set
from kvstore.errors import ConfigError, KVStoreError
from kvstore.keys import page_keys
from kvstore.shapes import PRESETS, load_shape

QA_GOALS = {"warm_speedup": 10.0, "cold_speedup": 5.0}   # recompute TTFT / cached TTFT
DECODE_GOAL = 1.5                                          # engine tokens/s / transformers tokens/s
MiB, GiB = 1 << 20, 1 << 30


class Mismatch(KVStoreError):
    """Tokens that must agree do not: the timings compare different computations."""


# inputs
def token_pool(llm) -> list[int]:
    """Ids a synthetic prompt draws from: what the tokenizer can produce, minus its special ids."""
    tok = llm.tokenizer
    special = {tok.bos_token_id, *tok.eos_token_ids, getattr(tok, "pad_token_id", None)}
    return [i for i in range(llm.runner.vocab_limit) if i not in special]


def synthetic(pool: list[int], n: int, seed: int, bos: int | None = None) -> list[int]:
    rng = random.Random(seed)
    head = [bos] if bos is not None and n > 0 else []
    return head + [pool[rng.randrange(len(pool))] for _ in range(n - len(head))]


# transformers on the engine's weights
def hf_model(llm):
    """The transformers model of llm's weights (same config, the engine's state dict), eval mode."""
    try:
        import transformers
    except ImportError:
        raise KVStoreError("the comparison with Hugging Face transformers needs the transformers package "
                           "(pip install transformers), or pass --skip-hf") from None
    loaded = llm.loaded
    if loaded.path is not None:
        config = transformers.AutoConfig.from_pretrained(loaded.path)
    else:
        s = loaded.shape
        kind = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
        config = transformers.AutoConfig.for_model(
            kind[s.architecture], vocab_size=s.vocab_size, hidden_size=s.hidden_size,
            num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
            head_dim=s.head_dim, intermediate_size=s.intermediate_size, max_position_embeddings=s.max_position,
            rms_norm_eps=s.rms_norm_eps, rope_theta=s.rope_theta, rope_scaling=s.rope_scaling,
            tie_word_embeddings=s.tie_embeddings)
    with torch.device(llm.store.hot.device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=llm.dtype)
    model.load_state_dict(loaded.model.state_dict(), strict=True)
    model.eval()
    gen = model.generation_config
    gen.eos_token_id = gen.bos_token_id = None   # exactly the tokens asked for, as the engine's ignore_eos
    gen.pad_token_id = 0
    return model


def hf_generate(model, prompts: list[list[int]], new_tokens: int, vocab_limit: int) -> list[list[int]]:
    """Greedy continuations of equal-length prompts in one batch; ids at or past vocab_limit are never
    chosen, as in the engine (they are beyond what the tokenizer can decode)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class VocabLimit(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[:, vocab_limit:] = float("-inf")
            return scores

    device = next(model.parameters()).device
    ids = torch.tensor(prompts, device=device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, logits_processor=LogitsProcessorList([VocabLimit()]))
    return out[:, ids.shape[1]:].tolist()


# the engine
def make_llm(args: argparse.Namespace, workdir: str, **options) -> LLM:
    opts = dict(dtype=args.dtype, attention_backend=args.attention_backend, data_dir=workdir)
    opts.update(options)
    opts.update({k.replace(".", "__"): v for k, v in parse_set(args.set).items()})
    return LLM(args.model, **opts)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Run:
    tokens: list[int]
    ttft_s: float
    wall_s: float
    prefill_tokens: int
    cached_tokens: dict[str, int]


def timed_generate(llm, prompt: list[int], params, tenant: str) -> Run:
    _sync(llm.store.hot.device)
    t = time.perf_counter()
    [out] = llm.generate([prompt], params, tenant=tenant)
    _sync(llm.store.hot.device)
    return Run(out.token_ids, out.ttft_s, time.perf_counter() - t, out.prefill_tokens, out.cached_tokens)


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}") if x and math.isfinite(x) else x


def _ratio(a: float | None, b: float | None) -> float | None:
    return _sig(a / b) if a and b else None


def _progress(name: str) -> Callable[[str], None]:
    tty = sys.stderr.isatty()

    def say(message: str) -> None:
        if tty:
            print(f"bench_engine {name}: {message}", file=sys.stderr, flush=True)
    return say


def _backend_name(llm: LLM) -> str:
    return type(llm.backend).__name__.removesuffix("Backend").lower()


def _spec(args: argparse.Namespace):
    """The KV geometry the engine will have, to size its tiers before building it (auto dtype: the larger)."""
    page_size = int(parse_set(args.set).get("page_size", 16))
    return load_shape(args.model).kv_spec(args.dtype if args.dtype != "auto" else "float32", page_size)


def _positive(flag: str, value: int, minimum: int = 1) -> int:
    if value < minimum:
        raise ConfigError(flag, value, f"must be an integer >= {minimum}")
    return value


# long-doc-qa
MODES = ("recompute", "hot", "warm", "cold")


def _mode_summary(runs: list[Run]) -> dict:
    return {"runs": len(runs),
            "mean_ttft_s": _sig(statistics.fmean(r.ttft_s for r in runs)),
            "median_ttft_s": _sig(statistics.median(r.ttft_s for r in runs)),
            "ttfts": [_sig(r.ttft_s) for r in runs],
            "mean_wall_s": _sig(statistics.fmean(r.wall_s for r in runs)),
            "wall_s": [_sig(r.wall_s) for r in runs],
            "mean_prefill_tokens": _sig(statistics.fmean(r.prefill_tokens for r in runs)),
            "mean_cached_tokens": {t: _sig(statistics.fmean(r.cached_tokens[t] for r in runs))
                                   for t in ("hot", "warm", "cold")}}


def run_long_doc_qa(args: argparse.Namespace) -> dict:
    doc_tokens = _positive("--doc-tokens", args.doc_tokens)
    questions = _positive("--questions", args.questions)
    docs = _positive("--docs", args.docs)
    q_tokens = _positive("--question-tokens", args.question_tokens)
    max_tokens = _positive("--max-tokens", args.max_tokens)
    n_recompute = min(questions, _positive("--recompute-questions", args.recompute_questions))
    n_hf = min(questions, _positive("--hf-questions", args.hf_questions, 0))
    chunk = _positive("--prefill-chunk", args.prefill_chunk)
    say = _progress("long-doc-qa")
    started = time.perf_counter()

    # pools: every prompt a recompute leaves behind stays in hot, so nothing is evicted while timing
    spec = _spec(args)
    prompt_pages = spec.pages_for(doc_tokens + q_tokens + max_tokens)
    question_pages = prompt_pages - doc_tokens // spec.page_size + 1
    hot_pages = docs * (n_recompute * prompt_pages + questions * question_pages) + prompt_pages
    doc_bytes = docs * prompt_pages * spec.page_bytes
    workdir = tempfile.mkdtemp(prefix="kvstore-bench-engine-", dir=args.dir)
    llm = None
    try:
        llm = make_llm(args, workdir, max_seq_len=max(8192, doc_tokens + q_tokens + max_tokens + 1),
                       hot__pool=max(GiB, -(-hot_pages * spec.page_bytes * 10 // 8) // MiB * MiB),
                       warm__bytes=max(GiB, 2 * doc_bytes), cold__max_bytes=max(2 * GiB, 3 * doc_bytes),
                       engine__prefill_chunk_tokens=chunk, engine__max_batch_tokens=max(8192, chunk))
        store, ps = llm.store, llm.store.spec.page_size
        pool, bos = token_pool(llm), llm.tokenizer.bos_token_id
        doc_ids = [synthetic(pool, doc_tokens, 1000 + d, bos) for d in range(docs)]
        q_ids = [[synthetic(pool, q_tokens, 2000 + 100 * d + q) for q in range(questions)] for d in range(docs)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        ns = store.namespace("qa")
        doc_pages = doc_tokens // ps
        say(f"{args.model}: {docs} document(s) of {doc_tokens} tokens, {questions} questions each; "
            f"hot {format_size(store.hot.capacity_bytes)}, warm {format_size(store.warm.capacity_bytes)}")
        llm.generate([synthetic(pool, 40, 7, bos)], SamplingParams(max_tokens=2), tenant="warmup")

        def drop_question_pages(run: Run, prompt: list[int]) -> None:
            """Past the document, a run's pages leave the store: the next run computes its whole question."""
            store.evict(page_keys(ns, prompt + run.tokens, ps)[doc_pages:])

        model = None
        if not args.skip_hf and n_hf:
            say("transformers: building the model from the engine's weights")
            model = hf_model(llm)
            hf_generate(model, [synthetic(pool, 40, 7, bos)], 2, llm.runner.vocab_limit)   # warm-up

        def recompute(d: int, q: int) -> Run:
            # the first in the shared tenant (nothing of it cached yet): it also caches the document
            tenant = "qa" if q == 0 else f"recompute-{d}-{q}"
            run = timed_generate(llm, doc_ids[d] + q_ids[d][q], params, tenant)
            if tenant == "qa":
                drop_question_pages(run, doc_ids[d] + q_ids[d][q])
            if sum(run.cached_tokens.values()):
                raise KVStoreError(f"recompute run of document {d} question {q} found cached tokens "
                                   f"{run.cached_tokens}: the benchmark's setup is wrong")
            return run

        def cached(d: int, q: int, mode: str) -> Run:
            prompt = doc_ids[d] + q_ids[d][q]
            doc_keys = page_keys(ns, doc_ids[d], ps)[:doc_pages]
            if mode != "hot":
                store.evict(doc_keys, to=mode)
            if mode == "warm":
                store.promote(doc_keys, to="warm")   # pages with a cold copy left hot for cold only
            m = store.match(prompt[:-1], ns)
            if m.tiers != [mode] * doc_pages:
                raise KVStoreError(f"before the {mode} run of document {d} question {q}, the cached prefix is "
                                   f"{m.counts()} pages, not {doc_pages} in {mode}")
            run = timed_generate(llm, prompt, params, "qa")
            drop_question_pages(run, prompt)
            return run

        def transformers_ttft(d: int, q: int) -> tuple[float, int]:
            _sync(store.hot.device)
            t = time.perf_counter()
            [first] = hf_generate(model, [doc_ids[d] + q_ids[d][q]], 1, llm.runner.vocab_limit)
            _sync(store.hot.device)
            return time.perf_counter() - t, first[0]

        # interleaved, question by question, and the cached modes in a rotating order: a slow spell of a
        # shared machine slows every mode alike instead of one of them
        runs: dict[str, dict[tuple[int, int], Run]] = {m: {} for m in MODES}
        hf_runs: list[tuple[float, bool | None]] = []
        cached_modes = ("hot", "warm", "cold")
        for d in range(docs):
            for q in range(questions):
                if q < n_recompute:
                    run = runs["recompute"][d, q] = recompute(d, q)
                    say(f"doc {d} question {q}: recompute ttft {run.ttft_s:.3f} s")
                if model is not None and q < n_hf:
                    ttft, first = transformers_ttft(d, q)
                    ref = runs["recompute"].get((d, q))
                    hf_runs.append((ttft, first == ref.tokens[0] if ref else None))
                    say(f"doc {d} question {q}: transformers ttft {ttft:.3f} s")
                for i in range(3):
                    mode = cached_modes[(q + i) % 3]
                    run = runs[mode][d, q] = cached(d, q, mode)
                    say(f"doc {d} question {q}: {mode} ttft {run.ttft_s:.4f} s, cached {run.cached_tokens}")

        # exactness: cached runs against the recomputed one, else (no recompute run) against hot
        mismatches, vs_recompute, vs_hot = [], 0, 0
        for (d, q), hot in runs["hot"].items():
            ref = runs["recompute"].get((d, q))
            for mode in ("hot", "warm", "cold") if ref else ("warm", "cold"):
                against = ref or hot
                if runs[mode][d, q].tokens != against.tokens:
                    mismatches.append({"doc": d, "question": q, "mode": mode,
                                       "against": "recompute" if ref else "hot",
                                       "tokens": runs[mode][d, q].tokens, "expected": against.tokens})
            vs_recompute += 3 if ref else 0
            vs_hot += 0 if ref else 2

        report = {"benchmark": "long-doc-qa", "model": args.model, "dtype": str(llm.dtype).removeprefix("torch."),
                  "device": str(store.hot.device), "attention_backend": _backend_name(llm),
                  "page_size": ps, "doc_tokens": doc_tokens, "docs": docs, "questions": questions,
                  "question_tokens": q_tokens, "max_tokens": max_tokens, "prefill_chunk_tokens": chunk,
                  "hot_bytes": store.hot.capacity_bytes, "warm_bytes": store.warm.capacity_bytes,
                  "cold_max_bytes": store.config.cold.max_bytes, "document_bytes": doc_pages * spec.page_bytes}
        for mode in MODES:
            report[mode] = _mode_summary(list(runs[mode].values()))
        rec = report["recompute"]["mean_ttft_s"]
        hf_ttft = _sig(statistics.fmean(t for t, _ in hf_runs)) if hf_runs else None
        report["transformers"] = None if not hf_runs else {
            "runs": len(hf_runs), "mean_ttft_s": hf_ttft, "ttfts": [_sig(t) for t, _ in hf_runs],
            "first_token_matches": sum(1 for _, ok in hf_runs if ok), "first_token_checked":
                sum(1 for _, ok in hf_runs if ok is not None)}
        report.update({
            "statistic": "mean",   # of every run's TTFT; the medians are in each mode's median_ttft_s
            "warm_speedup": _ratio(rec, report["warm"]["mean_ttft_s"]),
            "cold_speedup": _ratio(rec, report["cold"]["mean_ttft_s"]),
            "hot_speedup": _ratio(rec, report["hot"]["mean_ttft_s"]),
            "hf_ttft_s": hf_ttft,
            "warm_vs_hf": _ratio(hf_ttft, report["warm"]["mean_ttft_s"]),
            "cold_vs_hf": _ratio(hf_ttft, report["cold"]["mean_ttft_s"]),
            "recompute_vs_hf": _ratio(hf_ttft, rec),
            "exact": not mismatches,
            "exact_checked": {"against_recompute": vs_recompute, "against_hot": vs_hot},
            "mismatches": mismatches,
            "goals": dict(QA_GOALS),
        })
        report["meets_goals"] = all(report[k] is not None and report[k] >= v for k, v in QA_GOALS.items())
        report["seconds_total"] = _sig(time.perf_counter() - started)
        return report
    finally:
        if llm is not None:
            llm.store.close(persist=False)
        shutil.rmtree(workdir, ignore_errors=True)


def format_long_doc_qa(r: dict) -> str:
    lines = [f"{r['model']} ({r['dtype']}, {r['device']}): {r['docs']} document(s) x {r['doc_tokens']} tokens, "
             f"{r['questions']} questions of {r['question_tokens']} tokens, {r['max_tokens']} new tokens each", "",
             f"{'mode':<13}{'runs':>5}{'mean TTFT s':>13}{'wall s':>10}{'speedup':>9}"]
    for mode in MODES:
        m = r[mode]
        speed = "1" if mode == "recompute" else f"{r[mode + '_speedup']:.4g}"
        lines.append(f"{mode:<13}{m['runs']:>5}{m['mean_ttft_s']:>13.4g}{m['mean_wall_s']:>10.4g}{speed:>9}")
    if r["transformers"]:
        t = r["transformers"]
        lines.append(f"{'transformers':<13}{t['runs']:>5}{t['mean_ttft_s']:>13.4g}{'':>10}"
                     f"{_ratio(r['recompute']['mean_ttft_s'], t['mean_ttft_s']):>9.4g}")
    goals = ", ".join(f"{k} >= {v:g}" for k, v in r["goals"].items())
    checked = r["exact_checked"]
    lines += ["", f"tokens exact: {'yes' if r['exact'] else 'NO'} ({checked['against_recompute']} runs checked "
                  f"against the recomputed run, {checked['against_hot']} against the hot run); "
                  f"goals ({goals}) met: {'yes' if r['meets_goals'] else 'NO'}"]
    return "\n".join(lines)


# decode
def _profile_rows(prof: cProfile.Profile, limit: int) -> list[dict]:
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:limit]   # by own time
    return [{"function": f"{file.rsplit('/', 1)[-1]}:{line}({name})" if line else name,
             "calls": calls, "own_s": _sig(own), "cumulative_s": _sig(cum)}
            for (file, line, name), (_, calls, own, cum, _) in rows]


def run_decode(args: argparse.Namespace) -> dict:
    batch = _positive("--batch", args.batch)
    prompt_tokens = _positive("--prompt-tokens", args.prompt_tokens)
    new_tokens = _positive("--new-tokens", args.new_tokens)
    repeat = _positive("--repeat", args.repeat)
    check = min(new_tokens, _positive("--check-tokens", args.check_tokens))
    say = _progress("decode")
    started = time.perf_counter()

    spec = _spec(args)
    pages = batch * spec.pages_for(prompt_tokens + new_tokens + 1)
    workdir = tempfile.mkdtemp(prefix="kvstore-bench-engine-", dir=args.dir)
    llm = None
    try:
        llm = make_llm(args, workdir, max_seq_len=max(8192, prompt_tokens + new_tokens + 1),
                       hot__pool=max(256 * MiB, -(-2 * pages * spec.page_bytes // MiB) * MiB))
        device = llm.store.hot.device
        pool, bos = token_pool(llm), llm.tokenizer.bos_token_id
        prompts = [synthetic(pool, prompt_tokens, 3000 + i, bos) for i in range(batch)]
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        model = None if args.skip_hf else hf_model(llm)
        say(f"{args.model}: batch {batch}, {prompt_tokens} prompt tokens, {new_tokens} new tokens, "
            f"{repeat} rounds of engine{'' if args.skip_hf else ' then transformers'}")
        warmup = [synthetic(pool, prompt_tokens, 7, bos)] * 2
        llm.generate(warmup, SamplingParams(max_tokens=4, ignore_eos=True), tenant="warmup")
        if model is not None:
            hf_generate(model, warmup, 4, llm.runner.vocab_limit)

        engine_s, hf_s, engine_tokens, hf_tokens = [], [], [], None
        for r in range(repeat):
            tenant = f"decode-{r}"   # a fresh namespace: no prompt is served from the previous round's cache
            _sync(device)
            t = time.perf_counter()
            outs = llm.generate(prompts, params, tenant=tenant)
            _sync(device)
            engine_s.append(time.perf_counter() - t)
            if any(sum(o.cached_tokens.values()) for o in outs) or any(len(o.token_ids) != new_tokens for o in outs):
                raise KVStoreError("an engine run reused cached prompt pages or stopped early: the setup is wrong")
            engine_tokens.append([o.token_ids for o in outs])
            say(f"round {r + 1}: engine {batch * new_tokens / engine_s[-1]:.1f} tokens/s")
            if model is not None:
                _sync(device)
                t = time.perf_counter()
                out = hf_generate(model, prompts, new_tokens, llm.runner.vocab_limit)
                _sync(device)
                hf_s.append(time.perf_counter() - t)
                hf_tokens = hf_tokens or out
                say(f"round {r + 1}: transformers {batch * new_tokens / hf_s[-1]:.1f} tokens/s")

        profile = None
        if args.profile:
            say("profiling one more engine run (cProfile)")
            prof = cProfile.Profile()
            prof.enable()
            llm.generate(prompts, params, tenant="profile")
            prof.disable()
            profile = _profile_rows(prof, args.profile)

        generated = batch * new_tokens
        best_engine = min(engine_s)
        report = {"benchmark": "decode", "model": args.model, "dtype": str(llm.dtype).removeprefix("torch."),
                  "device": str(device), "attention_backend": _backend_name(llm), "batch": batch,
                  "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "repeat": repeat,
                  "statistic": "best", "includes_prefill": True,
                  "engine": {"tokens_per_s": _sig(generated / best_engine), "seconds": _sig(best_engine),
                             "repeats_seconds": [_sig(s) for s in engine_s]}}
        if model is None:
            report.update({"transformers": None, "ratio": None, "tokens_checked": 0, "tokens_match": None})
        else:
            best_hf = min(hf_s)
            first = [all(e[i][:check] == hf_tokens[i][:check] for i in range(batch)) for e in engine_tokens]
            report.update({
                "transformers": {"tokens_per_s": _sig(generated / best_hf), "seconds": _sig(best_hf),
                                 "repeats_seconds": [_sig(s) for s in hf_s]},
                "ratio": _sig(best_hf / best_engine),
                "tokens_checked": check, "tokens_match": all(first),
                "sequences_fully_equal": sum(1 for a, b in zip(engine_tokens[0], hf_tokens) if a == b)})
        report["engine_repeats_identical"] = all(e == engine_tokens[0] for e in engine_tokens)
        report["goal"] = DECODE_GOAL
        report["meets_goal"] = report["ratio"] is not None and report["ratio"] >= DECODE_GOAL
        if profile is not None:
            report["profile"] = profile
        report["seconds_total"] = _sig(time.perf_counter() - started)
        return report
    finally:
        if llm is not None:
            llm.store.close(persist=False)
        shutil.rmtree(workdir, ignore_errors=True)


def format_decode(r: dict) -> str:
    lines = [f"{r['model']} ({r['dtype']}, {r['device']}): batch {r['batch']}, {r['prompt_tokens']} prompt tokens, "
             f"{r['new_tokens']} new tokens; best of {r['repeat']}, prefill included", "",
             f"engine        {r['engine']['tokens_per_s']:>9.4g} tokens/s  ({r['engine']['seconds']:.4g} s)"]
    if r["transformers"]:
        t = r["transformers"]
        lines += [f"transformers  {t['tokens_per_s']:>9.4g} tokens/s  ({t['seconds']:.4g} s)", "",
                  f"ratio {r['ratio']:.3g} (goal {r['goal']:g}): {'met' if r['meets_goal'] else 'NOT met'}; "
                  f"first {r['tokens_checked']} tokens of every sequence equal: "
                  f"{'yes' if r['tokens_match'] else 'NO'} ({r['sequences_fully_equal']}/{r['batch']} fully equal)"]
    for row in r.get("profile") or []:
        lines.append(f"  {row['own_s']:>8.4g} s own {row['cumulative_s']:>8.4g} s cum {row['calls']:>7}  "
                     f"{row['function']}")
    return "\n".join(lines)


# command line
EPILOG = """\
examples:
  scripts/bench_engine long-doc-qa --json                  8K-token document, 8 questions (8-12 min on 2 cores)
  scripts/bench_engine long-doc-qa --doc-tokens 2048 --skip-hf
  scripts/bench_engine decode --json                       batch 16, 64 + 256 tokens, against transformers
  scripts/bench_engine decode --profile 25                 also where the engine's time goes (cProfile)
  scripts/bench_engine compare --model DIR --json          prefill, decode, cached-prefix TTFT against
                                                           transformers and vLLM (engine/bench_compare.py)
"""


def _common(p: argparse.ArgumentParser, model: str = "small") -> None:
    p.add_argument("--model", default=model,
                   help=f"a preset ({', '.join(PRESETS)}) or a Hugging Face model directory (default {model})")
    p.add_argument("--dtype", default="float32", help="engine and transformers dtype (default float32)")
    p.add_argument("--attention-backend", default="auto", help="auto, sdpa, torch or flashinfer (default auto: flashinfer on CUDA, else sdpa)")
    p.add_argument("--skip-hf", action="store_true", help="do not run Hugging Face transformers")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other config key for the engine, e.g. --set engine.decode_concurrency=32")
    p.add_argument("--dir", help="parent of the temporary data directory (default: the system temp dir)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench_engine", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    qa = sub.add_parser("long-doc-qa", help="TTFT with the document prefix recomputed, in hot, warm or cold")
    _common(qa)
    qa.add_argument("--doc-tokens", type=int, default=8192, help="tokens a document (default 8192)")
    qa.add_argument("--docs", type=int, default=1, help="documents (default 1)")
    qa.add_argument("--questions", type=int, default=8, help="questions a document (default 8)")
    qa.add_argument("--question-tokens", type=int, default=32, help="tokens a question (default 32)")
    qa.add_argument("--max-tokens", type=int, default=8, help="greedy tokens an answer (default 8)")
    qa.add_argument("--recompute-questions", type=int, default=3,
                    help="questions a document timed with the whole prompt recomputed (default 3)")
    qa.add_argument("--hf-questions", type=int, default=2,
                    help="questions a document timed with transformers (default 2)")
    qa.add_argument("--prefill-chunk", type=int, default=1024,
                    help="engine.prefill_chunk_tokens (default 1024)")
    qa.set_defaults(func=run_long_doc_qa, fmt=format_long_doc_qa, ok=lambda r: r["exact"])
    dec = sub.add_parser("decode", help="batched greedy decoding throughput, engine against transformers")
    _common(dec)
    dec.add_argument("--batch", type=int, default=16, help="sequences decoded together (default 16)")
    dec.add_argument("--prompt-tokens", type=int, default=64, help="tokens a prompt (default 64)")
    dec.add_argument("--new-tokens", type=int, default=256, help="tokens generated a sequence (default 256)")
    dec.add_argument("--repeat", type=int, default=3,
                     help="rounds, each one engine run then one transformers run; the fastest of each "
                          "is reported (default 3)")
    dec.add_argument("--check-tokens", type=int, default=8,
                     help="leading tokens of each sequence that must equal transformers' (default 8)")
    dec.add_argument("--profile", type=int, default=0, metavar="N",
                     help="profile one more engine run with cProfile and report its top N functions")
    dec.set_defaults(func=run_decode, fmt=format_decode,
                     ok=lambda r: r["tokens_match"] is not False or r["dtype"] != "float32")
    from engine.bench_compare import add_parser   # it imports this module's helpers
    add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    try:
        report = args.func(args)
    except KVStoreError as exc:
        print(f"bench_engine: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else args.fmt(report))
    if not args.ok(report):
        print("bench_engine: error: the engine's tokens differ from the reference's (see the report)",
              file=sys.stderr)
        return 1
    return 0
