"""`scripts/bench_engine decode`: batched greedy decoding throughput (generated tokens a second,
prefill included) of the engine against transformers' generate on the same weights; the leading
tokens of every sequence must agree. --profile adds where the engine's time goes (cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from app.bench.common import (MiB, _backend_name, discard, hf_generate, hf_model, make_llm, _positive, _progress,
                              _sig, _spec, _sync, synthetic, token_pool)
from engine.sampler import SamplingParams
from kvstore.errors import KVStoreError

DECODE_GOAL = 1.5   # engine tokens/s / transformers tokens/s


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
    llm = engine_thread = None
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
        engine_thread = ThreadPoolExecutor(1, thread_name_prefix="bench-engine") if args.engine_thread else None

        def on_engine(fn):   # on the engine's own thread with --engine-thread (as AsyncLLM runs it)
            return engine_thread.submit(fn).result() if engine_thread else fn()

        def generate(*a, **kw):
            return on_engine(lambda: llm.generate(*a, **kw))

        warmup = [synthetic(pool, prompt_tokens, 7, bos)] * 2
        generate(warmup, SamplingParams(max_tokens=4, ignore_eos=True), tenant="warmup")
        if model is not None:
            hf_generate(model, warmup, 4, llm.runner.vocab_limit)

        engine_s, hf_s, engine_tokens, hf_tokens = [], [], [], None
        for r in range(repeat):
            tenant = f"decode-{r}"   # a fresh namespace: no prompt is served from the previous round's cache
            _sync(device)
            t = time.perf_counter()
            outs = generate(prompts, params, tenant=tenant)
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
            prof = cProfile.Profile()   # it profiles the thread that enables it: the engine's

            def profiled():
                prof.enable()
                llm.generate(prompts, params, tenant="profile")
                prof.disable()
            on_engine(profiled)
            profile = _profile_rows(prof, args.profile)

        generated = batch * new_tokens
        best_engine = min(engine_s)
        report = {"benchmark": "decode", "model": args.model, "dtype": str(llm.dtype).removeprefix("torch."),
                  "device": str(device), "attention_backend": _backend_name(llm), "batch": batch,
                  "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "repeat": repeat,
                  "statistic": "best", "includes_prefill": True, "engine_thread": bool(args.engine_thread),
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
        if engine_thread is not None:
            engine_thread.shutdown()
        discard(llm, workdir)


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

