#!/usr/bin/env python3
"""The attention backends on the same paged batches, one layer at a time: `native` (the compiled CPU
kernel), `sdpa` (ATen's flash kernel, split-K over runs of slots) and `torch` (the reference).

    .venv/bin/python scripts/bench_attention.py [--threads 2] [--repeat 10]

Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head dim 64, pages of 16 tokens, float32):
    hit       32 query tokens after a 4,096-token cached prefix (one sequence)
    question  64 query tokens after an 8,192-token cached prefix (`long_doc_qa`'s round 2)
    chunk     a 512-token prefill chunk after 1,536 cached tokens
    late      a 512-token prefill chunk after 7,680 cached tokens
    prefill   a 2,048-token prompt, causal
    decode    8 sequences of 200 tokens, one query each
Each shape runs over --layers separate layer caches in turn (30, the model's: 190 MB of KV for the
hit, read from memory as in a forward, not from the CPU's caches), the pages of a sequence one run of
slots. Reported: the median milliseconds a layer over --repeat passes, every backend's largest
difference from the reference, and `x_vs_sdpa` = sdpa's ms / the backend's (above 1: faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine.attention import create_backend  # noqa: E402
from engine.attention.base import AttentionBatch  # noqa: E402

PS, HQ, HKV, D = 16, 9, 3, 64
SHAPES = {"hit": ([32], [4128]), "question": ([64], [8256]), "chunk": ([512], [2048]), "late": ([512], [8192]),
          "prefill": ([2048], [2048]), "decode": ([1] * 8, [200] * 8)}


def batch_for(q_lens: list[int], kv_lens: list[int]) -> tuple[AttentionBatch, int]:
    tables, at = [], 0
    for n in kv_lens:
        k = -(-n // PS)
        tables.append(list(range(at, at + k)))
        at += k
    indptr = [0]
    for q in q_lens:
        indptr.append(indptr[-1] + q)
    return AttentionBatch(indptr, tables, kv_lens, PS, HQ, HKV, D, torch.device("cpu")), at


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    out: dict = {"benchmark": "attention", "threads": args.threads, "layers": args.layers, "repeat": args.repeat,
                 "statistic": "median ms a layer", "shapes": {}}
    for name in args.shapes:
        q_lens, kv_lens = SHAPES[name]
        batch, pages = batch_for(q_lens, kv_lens)
        caches = [torch.randn((2, pages, PS, HKV, D), generator=gen) for _ in range(args.layers)]
        q = torch.randn((sum(q_lens), HQ, D), generator=gen)
        ref = create_backend("torch", batch.device)
        ref.plan(batch, torch.float32)
        expected = ref.run(q, caches[0])
        row: dict = {"sequences": len(q_lens), "q_len": q_lens[0], "kv_len": kv_lens[0]}
        for backend in ("native", "sdpa", "torch"):
            if backend == "torch" and name == "prefill":
                continue   # the reference's score matrix: minutes, not a contender
            be = create_backend(backend, batch.device, torch.float32, D)
            be.plan(batch, torch.float32)
            diff = (be.run(q, caches[0]) - expected).abs().max().item()
            passes = []
            for _ in range(args.repeat):
                t = time.perf_counter()
                for cache in caches:
                    be.run(q, cache)
                passes.append((time.perf_counter() - t) * 1e3 / len(caches))
            row[backend] = {"ms": round(statistics.median(passes), 4), "max_abs_diff": diff}
        for backend in ("native", "torch"):
            if backend in row:
                row[backend]["x_vs_sdpa"] = round(row["sdpa"]["ms"] / row[backend]["ms"], 3)
        out["shapes"][name] = row
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch (and kernel) threads (default 2)")
    ap.add_argument("--repeat", type=int, default=10, help="passes over the layers; the median is reported (default 10)")
    ap.add_argument("--layers", type=int, default=30, help="separate layer caches a pass goes through (default 30)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated shapes to run (default all: {','.join(SHAPES)})")
    args = ap.parse_args()
    args.shapes = [x for x in args.shapes.split(",") if x]
    unknown = [x for x in args.shapes if x not in SHAPES]
    if unknown or not args.shapes:
        ap.error(f"--shapes: unknown shape {', '.join(unknown) or '(none given)'}; known: {', '.join(SHAPES)}")
    for flag in ("threads", "repeat", "layers"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be an integer >= 1")
    print(json.dumps(run(args), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
