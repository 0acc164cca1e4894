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
             (its CPU build, in its own venv) in interleaved rounds: app/bench/compare.py.

Documents, questions and prompts are deterministic synthetic token ids. Model weights are a
preset's seeded random weights or a Hugging Face directory's; transformers gets the engine's
own state dict. Exit status: 0 when the benchmark ran (goals met or not), 1 when tokens
disagree, 2 on bad options.
"""

from __future__ import annotations

import argparse
import json
import sys

from app.bench.common import _common
from app.bench.decode import format_decode, run_decode
from app.bench.long_doc_qa import format_long_doc_qa, run_long_doc_qa
from kvstore.errors import KVStoreError


# command line
EPILOG = """\
examples:
  scripts/bench_engine long-doc-qa --json                  8K-token document, 8 questions (8-12 min on 2 cores)
  scripts/bench_engine long-doc-qa --doc-tokens 2048 --skip-hf
  scripts/bench_engine decode --json                       batch 16, 64 + 256 tokens, against transformers
  scripts/bench_engine decode --profile 25                 also where the engine's time goes (cProfile)
  scripts/bench_engine compare --model DIR --json          prefill, decode, cached-prefix TTFT against
                                                           transformers and vLLM (app/bench/compare.py)
"""


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
    dec.add_argument("--engine-thread", action="store_true",
                     help="run the engine on a thread of its own, built on the main thread, as kvstore serve does")
    dec.set_defaults(func=run_decode, fmt=format_decode,
                     ok=lambda r: r["tokens_match"] is not False or r["dtype"] != "float32")
    from app.bench.compare import add_parser
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
