"""Backup and prefetch through SGLang's own HiCacheController: kvstore (a sidecar) against SGLang's
`file` backend, in one run, rounds interleaved. Prints one JSON object.

    scripts/bench_sglang [--pages 64] [--rounds 5] [--layers 16] [--heads 4] [--head-dim 128] [--page-size 64]

Each round, for each backend: a new document's pages are filled in a writer controller's host pool,
backed up (write_storage until the backup thread acknowledges), then prefetched by a second
controller (prefetch until the last ack) and compared byte for byte; a second later (the backends' own writing done) the reader prefetches
it again (`prefetch_again`). GB/s = page bytes / seconds.
Both backends' pages are in memory when prefetched: kvstore's in its warm tier, the file backend's
in the OS page cache (written a moment before). After the rounds the sidecar restarts and every
document is prefetched again from kvstore's cold tier (LMDB), reported on its own.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_sglang", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", type=int, default=64, help="pages per document (default 64)")
    p.add_argument("--rounds", type=int, default=5, help="documents per backend, interleaved (default 5)")
    p.add_argument("--layers", type=int, default=16, help="layers of the KV (default 16)")
    p.add_argument("--heads", type=int, default=4, help="KV heads of one rank (default 4)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    p.add_argument("--page-size", type=int, default=64, help="tokens per page (default 64)")
    p.add_argument("--layout", default="page_first", help="host pool layout of both controllers (default page_first)")
    args = p.parse_args(argv)
    for name in ("pages", "rounds", "layers", "heads", "head_dim", "page_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def significant(x: float) -> float:
    """x to 4 significant digits (a tiny run's GB/s is not rounded to 0)."""
    return float(f"{x:.4g}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.ERROR)
    from kvstore_sglang import testing
    from kvstore_sglang.testing import Controller, Sidecar, kvstore_extra_config

    geometry = dict(layers=args.layers, heads=args.heads, head_dim=args.head_dim, page_size=args.page_size,
                    dtype=torch.bfloat16)
    testing.GEOMETRY.update(geometry)
    ps = args.page_size
    page_bytes = 2 * args.layers * ps * args.heads * args.head_dim * 2
    doc_bytes = page_bytes * args.pages
    host_tokens = 2 * args.pages * ps
    work = Path(tempfile.mkdtemp(prefix="kvsgb-"))
    sidecar = Sidecar(work / "data", work / "kv.sock", warm_bytes=str(max(64 << 20, 3 * doc_bytes)),
                      **{"cold.max_bytes": str(4 * doc_bytes * args.rounds + (1 << 30))})
    made = []
    try:
        file_extra = {"file_storage_path": str(work / "files")}
        pairs = {}
        for name, backend, extra in (("kvstore", "dynamic", kvstore_extra_config(sidecar.socket)),
                                     ("file", "file", file_extra)):
            pair = [Controller(backend, extra, layout=args.layout, model=f"bench-{name}", host_tokens=host_tokens,
                               **geometry) for _ in range(2)]
            made += pair
            pairs[name] = pair
        times = {name: {"backup": [], "prefetch": [], "prefetch_again": []} for name in pairs}
        exact = True
        docs = []
        for r in range(args.rounds):
            tokens = [(r * 104729 + i * 7) % 50000 for i in range(args.pages * ps)]
            docs.append(tokens)
            for name in (("kvstore", "file") if r % 2 == 0 else ("file", "kvstore")):
                writer, reader = pairs[name]
                idx = writer.fill(tokens, seed=r)
                start = time.perf_counter()
                stored = writer.backup(tokens, timeout=600)
                backed = time.perf_counter()
                got = reader.prefetch(tokens, timeout=600)
                done = time.perf_counter()
                if stored != len(tokens) or got != len(tokens):
                    raise SystemExit(f"bench_sglang: {name}: {stored} tokens stored, {got} prefetched of {len(tokens)}")
                exact &= torch.equal(reader.pages(tokens), writer.pages(tokens))
                times[name]["backup"].append(backed - start)
                times[name]["prefetch"].append(done - backed)
                writer.host.free(idx)
                reader.host.free(reader.where.pop(tuple(tokens)))
                time.sleep(1.0)   # the backend's own writing done (kvstore: write-behind to disk)
                start = time.perf_counter()
                if reader.prefetch(tokens, timeout=600) != len(tokens):
                    raise SystemExit(f"bench_sglang: {name}: the second prefetch missed")
                times[name]["prefetch_again"].append(time.perf_counter() - start)
                reader.host.free(reader.where.pop(tuple(tokens)))
        gbps = {name: {op: doc_bytes / statistics.median(t) / 1e9 for op, t in ops.items()} for name, ops in times.items()}

        # kvstore's cold tier: a restarted sidecar, every document prefetched again
        for c in pairs["kvstore"]:
            c.close()
        if sidecar.stop() != 0:
            raise SystemExit("bench_sglang: the sidecar did not stop cleanly")
        sidecar.start()
        cold = Controller("dynamic", kvstore_extra_config(sidecar.socket), layout=args.layout, model="bench-kvstore",
                          host_tokens=host_tokens, **geometry)
        made.append(cold)
        cold_s = []
        for tokens in docs:
            start = time.perf_counter()
            if cold.prefetch(tokens, timeout=600) != len(tokens):
                raise SystemExit("bench_sglang: kvstore's cold tier did not hold every document")
            cold_s.append(time.perf_counter() - start)
            cold.host.free(cold.where.pop(tuple(tokens)))
        result = {
            "what": "SGLang HiCacheController, backup then prefetch by a second controller, GB/s (medians)",
            "geometry": {**{k: v for k, v in geometry.items() if k != "dtype"}, "dtype": "bfloat16",
                         "layout": args.layout, "page_bytes": page_bytes},
            "pages_per_document": args.pages, "rounds": args.rounds, "exact": exact,
            "backup_gbps": {n: significant(g["backup"]) for n, g in gbps.items()},
            "prefetch_gbps": {n: significant(g["prefetch"]) for n, g in gbps.items()},
            "prefetch_again_gbps": {n: significant(g["prefetch_again"]) for n, g in gbps.items()},
            "ratio_kvstore_over_file": {op: round(gbps["kvstore"][op] / gbps["file"][op], 2)
                                        for op in ("backup", "prefetch", "prefetch_again")},
            "kvstore_cold_prefetch_gbps": significant(doc_bytes / statistics.median(cold_s) / 1e9),
            "seconds": {n: {op: [round(x, 4) for x in t] for op, t in ops.items()} for n, ops in times.items()},
        }
        print(json.dumps(result, indent=2))
        return 0 if exact else 1
    finally:
        for c in made:
            try:
                c.close()
            except Exception:  # noqa: BLE001 - closing twice after the cold phase
                pass
        sidecar.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
