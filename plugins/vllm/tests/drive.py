"""One vLLM engine (CPU) through the phases the tests check, results as JSON on the last line:

    python drive.py MODEL_DIR WORK_DIR baseline     vLLM alone
    python drive.py MODEL_DIR WORK_DIR connector    vLLM with the kvstore connector and a sidecar
    python drive.py MODEL_DIR WORK_DIR connector-sync   the same, loading cold pages synchronously

Phases (the same prompts, in the same order, in both modes):
    down     the sidecar is not running yet: vLLM serves, no hits
    warm     the sidecar runs: the first prompt saves the shared prefix, the later ones load it from warm
    cold     the sidecar restarts (its pages go to cold): the prefix loads from cold
    corrupt  a byte of one stored page is flipped on disk: that load fails and vLLM recomputes
Between prompts a filler prompt takes all of vLLM's own small KV cache, so its own prefix cache
cannot keep the shared prefix: every hit comes from kvstore.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

BLOCK = 128
PREFIX = 512          # 4 blocks shared by every question prompt
VOCAB = (3, 380)


def flip_a_page_byte(cold_dir: Path, page: int, tokens: list[int]) -> int:
    """Flip one byte in the payload of every stored record holding page `page` of `tokens`; the count."""
    import lmdb
    want = tokens[page * BLOCK:(page + 1) * BLOCK]
    env = lmdb.open(str(cold_dir), max_dbs=2, subdir=True, lock=True)
    flipped = 0
    try:
        db = env.open_db(b"pages")
        with env.begin(write=True, db=db) as txn:
            for key, value in list(txn.cursor()):
                if _holds(value, want):
                    b = bytearray(value)
                    b[-100] ^= 0x5A   # in the page bytes, past the header
                    txn.put(key, bytes(b))
                    flipped += 1
    finally:
        env.close()
    return flipped


def _holds(record: bytes, tokens: list[int]) -> bool:
    import numpy as np
    return np.asarray(tokens, dtype="<i4").tobytes() in record[:8192]


def main() -> None:
    model_dir, work, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvstore_vllm.testing import Sidecar, connector_config

    rng = random.Random(7)
    prefix = [rng.randrange(*VOCAB) for _ in range(PREFIX)]
    question = lambda: prefix + [rng.randrange(*VOCAB) for _ in range(24)]   # noqa: E731
    filler = lambda: [rng.randrange(*VOCAB) for _ in range(740)]             # noqa: E731
    # a question whose own suffix fills a block past the prefix: in the corrupt phase that block is
    # computed in the same step as the failed load, and must not be cached
    long_question = prefix + [rng.randrange(*VOCAB) for _ in range(150)]
    phases = [("down", [question(), filler(), question()]),
              ("warm", [question(), filler(), question(), filler(), question()]),
              ("cold", [filler(), question()]),
              ("corrupt", [filler(), long_question, filler(), long_question, filler(), long_question])]
    sock = work / "kv.sock"
    kwargs = dict(dtype="float32", block_size=BLOCK, max_model_len=768, enable_prefix_caching=True,
                  num_gpu_blocks_override=7, max_num_seqs=4, seed=0)
    if mode.startswith("connector"):
        # connector-sync: cold pages load synchronously too, so a failed load is found in the step
        # that computes on top of it
        kwargs["kv_transfer_config"] = connector_config(sock, load_cold_async=mode != "connector-sync")
    llm = LLM(str(model_dir), **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3)
    sidecar = None
    results: list[dict] = []
    for phase, prompts in phases:
        if mode.startswith("connector"):
            if phase == "warm":
                sidecar = Sidecar(model_dir, work / "data", sock, block_size=BLOCK)
                time.sleep(1.0)   # the connector retries every 0.5 s
            elif phase == "cold":
                assert sidecar.stop() == 0
                sidecar = Sidecar(model_dir, work / "data", sock, block_size=BLOCK)
            elif phase == "corrupt":
                assert sidecar.stop() == 0
                flipped = flip_a_page_byte(work / "data" / "cold", 2, prompts[1])
                results.append({"phase": phase, "flipped_records": flipped})
                sidecar = Sidecar(model_dir, work / "data", sock, block_size=BLOCK)
        for i, tokens in enumerate(prompts):
            before = dict(sidecar.stats()["tiers"]) if sidecar else None
            out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]
            c = out.outputs[0]
            row = {"phase": phase, "i": i, "is_question": tokens[:PREFIX] == prefix,
                   "tokens": list(c.token_ids), "cached": out.num_cached_tokens,
                   "logprobs": [{str(k): v.logprob for k, v in step.items()} for step in c.logprobs]}
            if sidecar is not None:
                after = sidecar.stats()["tiers"]
                row["hits"] = {t: after[t]["hits"] - before[t]["hits"] for t in ("hot", "warm", "cold")}
                row["pages"] = {t: after[t]["pages"] for t in ("hot", "warm", "cold")}
            results.append(row)
    if mode.startswith("connector"):
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        results.append({"phase": "end", "worker_counters": get_kv_transfer_group().counters,
                        "sidecar_log_tracebacks": sidecar.log().count("Traceback")})
        assert sidecar.stop() == 0
    print(json.dumps(results))


if __name__ == "__main__":
    main()
