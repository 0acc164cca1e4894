"""Long-document QA through vLLM CPU, with and without the kvstore connector (LMCache's benchmark
shape): D documents of L tokens, Q questions each. Round 1 asks each document's first question
(with the connector, that computes and saves the document); round 2 asks the other questions, and
its mean TTFT is what is compared. vLLM's own KV cache holds about one document, so its prefix
cache cannot keep the documents between rounds; it keeps only the first block of the document
asked before (it evicts a finished request's blocks tail first), so with --docs 2 each question
finds its first block there and the other ones (31 of 32) in kvstore.

Modes, each in its own process, in one run: `baseline` (vLLM alone, prefix caching on), `warm`
(the connector; round 2 finds the documents in the sidecar's warm tier), `cold` (the sidecar is
restarted between the rounds, so round 2 loads them from its cold tier). Prints JSON.

    python -m kvstore_vllm.bench [--docs 4] [--doc-tokens 4096] [--questions 3] [--model small|tiny|DIR]

--model takes a random Llama's size or a Hugging Face model directory (a real model, e.g. the one
scripts/real_model builds); the prompts are random token ids of its vocabulary either way.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BLOCK = 128


def _prompts(docs: int, doc_tokens: int, questions: int, vocab: int) -> list[list[list[int]]]:
    rng = random.Random(1)
    out = []
    for _ in range(docs):
        doc = [rng.randrange(3, vocab) for _ in range(doc_tokens)]
        out.append([doc + [rng.randrange(3, vocab) for _ in range(32)] for _ in range(questions)])
    return out


def run_mode(args: argparse.Namespace) -> dict:
    """One engine through both rounds; the TTFT of each question (max_tokens=1, one at a time)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvstore_vllm.testing import Sidecar, connector_config, model_shape

    work = Path(args.work)
    vocab = model_shape(args.model_dir)["vocab_size"]
    prompts = _prompts(args.docs, args.doc_tokens, args.questions, vocab)
    per_seq = -(-(args.doc_tokens + 64) // BLOCK)
    kwargs = dict(dtype="float32", block_size=BLOCK, max_model_len=per_seq * BLOCK, enable_prefix_caching=True,
                  num_gpu_blocks_override=per_seq + 2, max_num_seqs=1, seed=0)
    sidecar = None
    if args.mode != "baseline":
        sock = work / "kv.sock"
        sidecar = Sidecar(args.model_dir, work / "data", sock, block_size=BLOCK, warm_bytes=args.warm_bytes,
                          cold_bytes="16GiB")
        kwargs["kv_transfer_config"] = connector_config(sock)
    llm = LLM(str(args.model_dir), **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def ask(tokens: list[int]) -> float:
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
        return time.perf_counter() - t

    ask(prompts[0][0][-200:])   # warm-up: first-call costs out of the measurement
    round1 = [ask(doc[0]) for doc in prompts]
    if args.mode == "cold":
        assert sidecar.stop() == 0
        sidecar = Sidecar(args.model_dir, work / "data", work / "kv.sock", block_size=BLOCK,
                          warm_bytes=args.warm_bytes, cold_bytes="16GiB")
    # interleaved (question 2 of every document, then question 3, ...): vLLM's own cache holds one document
    round2 = [ask(prompts[d][q]) for q in range(1, args.questions) for d in range(args.docs)]
    out = {"mode": args.mode, "round1_ttft_s": round1, "round2_ttft_s": round2}
    if sidecar is not None:
        tiers = sidecar.stats()["tiers"]
        out["sidecar_hits"] = {t: tiers[t]["hits"] for t in ("warm", "cold")}
        sidecar.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvstore_vllm.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=4, help="documents (default 4)")
    p.add_argument("--doc-tokens", type=int, default=4096, help="tokens per document (default 4096)")
    p.add_argument("--questions", type=int, default=3, help="questions per document (default 3)")
    p.add_argument("--model", default="small",
                   help="size of a random Llama (tiny, or small: ~100M parameters, the default), or a Hugging "
                        "Face model directory")
    p.add_argument("--warm-bytes", default="2GiB", help="the sidecar's warm tier (default 2GiB)")
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.mode:
        print(json.dumps(run_mode(args)))
        return 0
    from kvstore_vllm.testing import MODELS, make_model
    root = Path(tempfile.mkdtemp(prefix="kvb-"))
    if args.model in MODELS:
        model = make_model(root / f"model-{args.model}", args.model)
    elif (Path(args.model) / "config.json").is_file():
        model = Path(args.model).resolve()
    else:
        p.error(f"--model {args.model!r}: not one of {', '.join(MODELS)} nor a model directory (no config.json)")
    results = {}
    for mode in ("baseline", "warm", "cold"):
        cmd = [sys.executable, "-m", "kvstore_vllm.bench", "--mode", mode, "--work", str(root / mode),
               "--model-dir", str(model), "--docs", str(args.docs), "--doc-tokens", str(args.doc_tokens),
               "--questions", str(args.questions), "--warm-bytes", args.warm_bytes]
        (root / mode).mkdir()
        print(f"bench: {mode} ...", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            return 1
        results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    base = statistics.mean(results["baseline"]["round2_ttft_s"])
    summary = {"model": args.model, "docs": args.docs, "doc_tokens": args.doc_tokens,
               "questions": args.questions, "block_size": BLOCK,
               "round2_mean_ttft_s": {m: statistics.mean(r["round2_ttft_s"]) for m, r in results.items()},
               "speedup_vs_vllm_alone": {m: base / statistics.mean(results[m]["round2_ttft_s"])
                                         for m in ("warm", "cold")},
               # round 2 pass by pass (question 2 of every document, then 3, ...): in `cold` mode the
               # first pass loads from cold, the later ones find the pages promoted to warm
               "round2_pass_mean_ttft_s": {m: [statistics.mean(r["round2_ttft_s"][i:i + args.docs])
                                               for i in range(0, len(r["round2_ttft_s"]), args.docs)]
                                           for m, r in results.items()},
               "round1_mean_ttft_s": {m: statistics.mean(r["round1_ttft_s"]) for m, r in results.items()},
               "sidecar_hits": {m: results[m].get("sidecar_hits") for m in ("warm", "cold")}}
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
