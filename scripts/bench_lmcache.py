#!/usr/bin/env python3
"""kvstore's cold tier next to LMCache's storage backends, at the storage level, in one process.

    python scripts/bench_lmcache.py [--tokens 4096] [--rounds 5] [--cache both] [--rereads 0] [--dir DIR]

Run it with a Python that has both kvstore and LMCache (0.5.6) installed, e.g. a separate
venv with the CPU build of torch, `lmcache==0.5.6` and `pip install -e .` of this repository.
Where lmcache cannot be imported, the LMCache part is skipped (a message on stderr) and
kvstore's numbers still print.

The data is the KV cache of one document of `--tokens` tokens in SmolLM2-135M geometry
(30 layers, 3 KV heads, head dim 64, float32: 4096 tokens = 189 MB), as random bytes, held in
each system's own memory layout before anything is timed: kvstore pages of 16 tokens
([layers, 2, 16, kv_heads, head_dim] each, page-first), LMCache chunks of 256 tokens
(KV_2LTD, [2, layers, 256, kv_heads * head_dim], in its LocalCPUBackend's allocator).

Timed in every round, in an order that rotates from round to round:
    put          kvstore: DiskTier.put_many of every page in one batch, until its future resolves
                 (one LMDB transaction, committed with fsync: durable)
    put_lmcache  LMCache as shipped: LocalDiskBackend.batched_submit_put_task of every chunk,
                 until every chunk's completion callback ran (one file a chunk, written by its
                 4 disk threads, never fsynced: not durable)
    put_lmcache_fsync  the same with each chunk file fsynced before its callback (durable
                 contents; the directory entries are not fsynced, which favours LMCache)
    get          kvstore: DiskTier.read_many of every page into a pre-allocated buffer
                 (checksum, key derivation, namespace, tokens and geometry verified)
    get_lmcache  LocalDiskBackend.batched_get_blocking of every chunk (readinto on 4 threads,
                 into buffers from its allocator; no checksum)
Each put writes a new store / a new directory (a fresh backend), kept until the end. The gets
read what the round's puts wrote, with the page cache warm (just written), or, with --cache
cold, after the files were evicted from the page cache (posix_fadvise DONTNEED). Each is a
store's first read of those pages (kvstore's reader maps them on the way). With --rereads N,
each system then reads the same store N more times (`get_reread`, `get_lmcache_reread`): a
long-lived store reading a document again. Every get is compared byte for byte with what was
put (a mismatch exits 1).
os.sync() runs before each put, so no put pays for another's writeback.

Reported: GB/s (1e9 bytes of KV a second) of each round and their median, and
`x_vs_lmcache` = LMCache's median seconds / kvstore's (above 1: kvstore is faster).
Goal: durable put and checksummed get at least as fast as LMCache's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kvstore.pages.keys import Namespace  # noqa: E402
from kvstore.pages.record import PREFIX_BYTES  # noqa: E402
from kvstore.pages.spec import KVSpec  # noqa: E402
from kvstore.tiers.disk import DiskTier  # noqa: E402
from kvstore.tools.bench import chained_headers, drop_file_cache  # noqa: E402

SPEC = KVSpec(30, 3, 64, "float32", 16)   # SmolLM2-135M: 30 layers, 3 KV heads, head dim 64
CHUNK = 256                               # LMCache's default chunk size, in tokens
MiB = 1 << 20


class Mismatch(Exception):
    pass


def sig(x: float) -> float:
    return float(f"{x:.4g}")


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Ours:
    """kvstore's side: pages of the document and a DiskTier per round."""

    def __init__(self, kv: torch.Tensor, workdir: str):
        # kv: [layers, 2, tokens, kv_heads, head_dim]
        layers, _, tokens, heads, dim = kv.shape
        pages = tokens // SPEC.page_size
        self.pages = (kv.view(layers, 2, pages, SPEC.page_size, heads, dim)
                      .permute(2, 0, 1, 3, 4, 5).contiguous())   # [pages, layers, 2, page_size, heads, dim]
        self.out = torch.zeros_like(self.pages)                  # the warm buffer gets read into
        self.ns = Namespace.for_spec("bench/smollm2-135m", SPEC)
        self.headers = chained_headers(SPEC, self.ns, pages)
        self.items = list(zip(self.headers, self.pages))
        self.size = 2 * sum(PREFIX_BYTES + len(h.pack()) + SPEC.page_bytes for h in self.headers) + 64 * MiB
        self.requests = [(h.key, self.ns.digest, h.tokens, SPEC.fingerprint, self.out[i])
                         for i, h in enumerate(self.headers)]
        self.workdir = workdir
        self.tier: DiskTier | None = None
        self.round = 0

    def new_tier(self) -> None:
        self.close()
        self.round += 1
        path = os.path.join(self.workdir, f"kvstore-{self.round}")
        self.tier = DiskTier(path, SPEC, self.size, self.size, map_size_initial=self.size)

    def put(self) -> None:
        self.tier.put_many(self.items).result()

    def evict_cache(self) -> None:
        path = self.tier.path
        self.tier.close()
        drop_file_cache(os.path.join(path, "data.mdb"))
        self.tier = DiskTier(path, SPEC, self.size, self.size, map_size_initial=self.size)

    def get(self) -> None:
        ok = self.tier.read_many(self.requests)
        if not all(ok):
            raise Mismatch(f"kvstore get: {ok.count(False)} pages refused ({self.tier.last_error})")

    def check(self) -> None:
        if not torch.equal(self.out.view(torch.uint8), self.pages.view(torch.uint8)):
            raise Mismatch("kvstore get: the bytes read differ from the bytes put")
        self.out.zero_()

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()
            self.tier = None


class LMCacheSide:
    """LMCache's side: its LocalCPUBackend (the allocator) and a LocalDiskBackend per round."""

    def __init__(self, kv: torch.Tensor, workdir: str):
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.host_memory_allocator import HostMemoryAllocator
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        class FsyncDiskBackend(LocalDiskBackend):
            """LocalDiskBackend whose chunk files are fsynced before the put completes."""

            def write_file(self, buffer, path):
                with open(path, "wb") as f:
                    f.write(buffer)
                    f.flush()
                    os.fsync(f.fileno())

        self.classes = {"shipped": LocalDiskBackend, "fsync": FsyncDiskBackend}
        layers, _, tokens, heads, dim = kv.shape
        chunks = tokens // CHUNK
        self.shape = torch.Size([2, layers, CHUNK, heads * dim])
        self.chunk_bytes = self.shape.numel() * kv.element_size()
        self.workdir = workdir
        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(target=self.loop.run_forever, name="lmcache-loop", daemon=True)
        self.loop_thread.start()
        self.config_of = lambda path: LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=1, local_disk=path,
            max_local_disk_size=4 * tokens * layers * 2 * heads * dim * kv.element_size() / 1024**3 + 1)
        # source chunks (3x: sources, a get's results, slack)
        self.cpu = LocalCPUBackend(self.config_of(os.path.join(workdir, "lmcache-cpu")),
                                   memory_allocator=HostMemoryAllocator(3 * chunks * self.chunk_bytes + 64 * MiB))
        self.fmt = MemoryFormat.KV_2LTD
        self.keys = [CacheEngineKey("bench/smollm2-135m", 1, 0, 1000 + i, torch.float32) for i in range(chunks)]
        self.sources = []
        for i in range(chunks):
            obj = self.cpu.allocate(self.shape, torch.float32, self.fmt)
            part = kv[:, :, i * CHUNK:(i + 1) * CHUNK]             # [layers, 2, 256, heads, dim]
            obj.tensor.copy_(part.permute(1, 0, 2, 3, 4).reshape(self.shape))
            self.sources.append(obj)
        self.backends: list = []
        self.backend = None
        self.got: list = []

    def new_backend(self, kind: str) -> None:
        path = os.path.join(self.workdir, f"lmcache-{kind}-{len(self.backends)}")
        self.backend = self.classes[kind](self.config_of(path), self.loop, self.cpu)
        self.backends.append(self.backend)

    def put(self) -> None:
        done = threading.Semaphore(0)
        self.backend.batched_submit_put_task(self.keys, self.sources, on_complete_callback=lambda key: done.release())
        for _ in self.keys:
            if not done.acquire(timeout=300):
                raise Mismatch("LMCache put: a chunk did not complete within 300 s")

    def evict_cache(self) -> None:
        for name in os.listdir(self.backend.path):
            drop_file_cache(os.path.join(self.backend.path, name))

    def get(self) -> None:
        self.got = self.backend.batched_get_blocking(self.keys)

    def check(self) -> None:
        try:
            if any(obj is None for obj in self.got):
                raise Mismatch(f"LMCache get: {sum(o is None for o in self.got)} chunks missing")
            for obj, src in zip(self.got, self.sources):
                if not torch.equal(obj.tensor.view(torch.uint8), src.tensor.view(torch.uint8)):
                    raise Mismatch("LMCache get: the bytes read differ from the bytes put")
        finally:
            for obj in self.got:
                if obj is not None:
                    obj.ref_count_down()
            self.got = []

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
        for obj in self.sources:
            obj.ref_count_down()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.loop_thread.join(timeout=10)


def import_lmcache() -> str | None:
    """LMCache's version, or None (with a message) when it cannot be imported."""
    try:
        os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")   # not its per-backend start-up warnings
        import lmcache
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend  # noqa: F401
    except Exception as exc:  # not installed, or broken: measure kvstore alone
        print(f"bench_lmcache: LMCache skipped: cannot import lmcache ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return None
    from importlib.metadata import version
    return getattr(lmcache, "__version__", None) or version("lmcache")


def run(args: argparse.Namespace) -> dict:
    load_at_start = round(os.getloadavg()[0], 2)
    lmcache_version = import_lmcache()
    tokens = args.tokens - args.tokens % CHUNK
    gen = torch.Generator().manual_seed(0)
    kv = torch.randint(0, 256, (SPEC.num_layers, 2, tokens, SPEC.num_kv_heads, SPEC.head_dim * 4),
                       dtype=torch.uint8, generator=gen).view(torch.float32)   # [layers, 2, tokens, heads, dim]
    nbytes = kv.numel() * kv.element_size()
    workdir = tempfile.mkdtemp(prefix="kvstore-bench-lmcache-", dir=args.dir)
    ours = lmc = None
    try:
        ours = Ours(kv, workdir)
        lmc = LMCacheSide(kv, workdir) if lmcache_version else None
        caches = ("warm", "cold") if args.cache == "both" else (args.cache,)
        samples: dict[str, list[float]] = {}

        def record(name: str, seconds: float) -> None:
            samples.setdefault(name, []).append(seconds)

        def round_of(side, put_name: str, get_prefix: str, make) -> list:
            """Steps of one system in a round: a put into a new store, then its gets."""
            def put():
                make()
                os.sync()
                record(put_name, timed(side.put))
            steps = [put]
            if get_prefix:
                for cache in caches:
                    def get(cache=cache):
                        if cache == "cold":
                            side.evict_cache()
                        record(f"{get_prefix}_{cache}" if len(caches) > 1 else get_prefix, timed(side.get))
                        side.check()
                    steps.append(get)
                for _ in range(args.rereads):
                    def reread():
                        record(f"{get_prefix}_reread", timed(side.get))
                        side.check()
                    steps.append(reread)
            return steps

        for r in range(args.rounds + 1):   # round 0 warms up (first touch, thread pools); not counted
            groups = [round_of(ours, "put", "get", ours.new_tier)]
            if lmc is not None:
                groups.append(round_of(lmc, "put_lmcache", "get_lmcache", lambda: lmc.new_backend("shipped")))
                groups.append(round_of(lmc, "put_lmcache_fsync", "", lambda: lmc.new_backend("fsync")))
            k = r % len(groups)
            for steps in groups[k:] + groups[:k]:
                for step in steps:
                    step()
            if r == 0:
                samples.clear()
        med = {name: statistics.median(v) for name, v in samples.items()}
        out = {"benchmark": "lmcache_storage", "geometry": "SmolLM2-135M: 30 layers, 3 KV heads, head dim 64, float32",
               "tokens": tokens, "bytes": nbytes, "kvstore_page_tokens": SPEC.page_size, "kvstore_pages": tokens // 16,
               "lmcache_chunk_tokens": CHUNK, "lmcache_chunks": tokens // CHUNK, "lmcache_version": lmcache_version,
               "read_threads": ours.tier.read_threads, "rounds": args.rounds, "statistic": "median",
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                           "python": platform.python_version(), "torch": torch.__version__,
                           "load_avg_1m_at_start": load_at_start},
               "gbps": {name: sig(nbytes / s / 1e9) for name, s in med.items()},
               "rounds_gbps": {name: [sig(nbytes / s / 1e9) for s in v] for name, v in samples.items()}}
        if lmc is not None:
            gets = [n for n in med if n.startswith("get") and not n.startswith("get_lmcache")]
            ratios = {"put_vs_lmcache_fsync": med["put_lmcache_fsync"] / med["put"],
                      "put_vs_lmcache_shipped": med["put_lmcache"] / med["put"]}
            for g in gets:
                ratios[f"{g}_vs_lmcache"] = med[g.replace("get", "get_lmcache", 1)] / med[g]
            out["ratios"] = {k: sig(v) for k, v in ratios.items()}
            out["meets_goal"] = ratios["put_vs_lmcache_fsync"] >= 1 and all(
                ratios[f"{g}_vs_lmcache"] >= 1 for g in gets)
        else:
            out["lmcache"] = "skipped: lmcache cannot be imported"
        return out
    finally:
        if ours is not None:
            ours.close()
        if lmc is not None:
            lmc.close()
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(prog="bench_lmcache.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="document length (a multiple of 256)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds, after one warm-up round")
    parser.add_argument("--cache", choices=("warm", "cold", "both"), default="both",
                        help="page cache state of the gets")
    parser.add_argument("--rereads", type=int, default=0,
                        help="reads of the same store after the first, each round (default 0)")
    parser.add_argument("--dir", help="work in a fresh subdirectory of DIR (removed afterwards)")
    args = parser.parse_args()
    if args.tokens < CHUNK or args.rounds < 1 or args.rereads < 0:
        parser.error("--tokens must be at least 256, --rounds at least 1 and --rereads at least 0")
    try:
        report = run(args)
    except Mismatch as exc:
        print(f"bench_lmcache: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
