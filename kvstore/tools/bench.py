"""Tier benchmark (`kvstore bench tiers`): how fast whole pages move between tiers, next to plain baselines.

Each direction moves every page once per repeat through the real tier classes and, in the same
run and on the same bytes, a baseline that does no more than the hardware must:

    hot_to_warm   DeviceTier.save_to       vs memcpy of one contiguous buffer (on CUDA: device -> pinned host)
    warm_to_hot   DeviceTier.load_from     vs memcpy the other way             (on CUDA: pinned host -> device)
    warm_to_cold  DiskTier.put_many, until its future resolves (durable commit)
                                           vs one sequential write of the same bytes to a file + fsync
    cold_to_warm  DiskTier.read_many of every page in one batch (checksum and header verified,
                  on up to `read_threads` threads)
                                           vs one sequential readinto of that file

The buffers hold random bytes, and every copy is compared byte for byte afterwards; a mismatch
stops the benchmark with exit code 1. Speeds are GB/s (1e9 bytes a second) of the fastest
repeat, for the tier and its baseline alike; the memory directions first run once untimed, and
the cold writes alternate which of the two goes first. The cold reads come from the OS page cache (the
data was just written) unless --drop-caches (root only) empties it before each read. The LMDB
map is sized up front, so map growth (a one-time cost of a new store) is not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Callable

import numpy as np
import torch

from kvstore.config import format_size
from kvstore.errors import ConfigError, KVStoreError
from kvstore.pages.keys import Namespace, page_keys, tokens_bytes
from kvstore.pages.record import PREFIX_BYTES, RecordHeader
from kvstore.pages.shapes import PRESETS, load_shape
from kvstore.pages.spec import KVSpec, canonical_dtype
from kvstore.tiers.device import DeviceTier, resolve_device
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier

MiB = 1 << 20
DIRECTIONS = ("hot_to_warm", "warm_to_hot", "warm_to_cold", "cold_to_warm")
BASELINES = {"hot_to_warm": "memcpy", "warm_to_hot": "memcpy",
             "warm_to_cold": "file_write_fsync", "cold_to_warm": "file_read"}
# Lowest acceptable tier speed as a share of its baseline's.
TARGETS = {"hot_to_warm": 0.8, "warm_to_hot": 0.8, "warm_to_cold": 0.5, "cold_to_warm": 0.7}
STATISTIC = "best"   # the fastest repeat: interference on a shared machine only ever slows a run


class VerifyError(Exception):
    """A copy did not produce the bytes it was given: the measurement is worthless."""


def _positive(flag: str, value: int) -> int:
    if value <= 0:
        raise ConfigError(flag, value, "must be a positive integer")
    return value


def drop_page_cache() -> None:
    """Write back dirty pages and empty the OS page cache (root only)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as exc:
        raise KVStoreError(f"--drop-caches: cannot write /proc/sys/vm/drop_caches ({exc})") from None


def drop_file_cache(path: str) -> None:
    """Evict one file's clean pages from the OS page cache (any user; mapped pages stay)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def chained_headers(spec: KVSpec, namespace: Namespace, pages: int, seed: int = 0) -> list[RecordHeader]:
    """Record headers of one sequence of `pages` pages over random tokens, like a real prefix."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 32000, size=pages * spec.page_size, dtype=np.int32)
    keys = page_keys(namespace, tokens, spec.page_size)
    parents = [namespace.digest] + keys[:-1]
    return [RecordHeader(key, parent, namespace.digest,
                         tokens_bytes(tokens[i * spec.page_size:(i + 1) * spec.page_size]),
                         spec.fingerprint, spec.page_bytes)
            for i, (key, parent) in enumerate(zip(keys, parents))]


def write_file(path: str, data: memoryview) -> None:
    """One sequential write of `data` to a new file, then fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def read_file(path: str, out: memoryview) -> None:
    """One sequential read of the file into `out` (which it must fill exactly)."""
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < len(out):
            n = f.readinto(out[done:])
            if not n:
                raise VerifyError(f"{path} is {done} bytes, {len(out)} were written")
            done += n


class TierBench:
    """One hot tier, one warm tier and cold stores under `workdir`, all `pages` pages big."""

    def __init__(self, spec: KVSpec, model: str, pages: int, device: torch.device, workdir: str,
                 repeat: int, drop_caches: bool, progress: Callable[[str], None]):
        self.spec, self.pages, self.device, self.workdir = spec, pages, device, workdir
        self.repeat, self.drop_caches, self.progress = repeat, drop_caches, progress
        self.nbytes = pages * spec.page_bytes
        self.on_cuda = device.type == "cuda"
        self.slots = list(range(pages))
        self.hot = DeviceTier(spec, pages, device)
        self.warm = HostTier(spec, pages)
        self.hot_bytes = self.hot.kv.view(-1).view(torch.uint8)   # [pages * page_bytes], hot (NHD, K and V apart) order
        self.warm_bytes = self.warm.raw.view(-1)                   # [pages * page_bytes], page-first order
        self.warm_view = memoryview(self.warm_bytes.numpy())

        # cold records: chained keys over random tokens, like a real prefix
        self.namespace = Namespace.for_spec(f"bench/{model}", spec)
        self.headers = chained_headers(spec, self.namespace, pages)
        self.record_bytes = sum(PREFIX_BYTES + len(h.pack()) + spec.page_bytes for h in self.headers)
        self.cold_path: str | None = None   # the store the reads use: the last one written
        self.raw_path: str | None = None

    # --- helpers ----------------------------------------------------------------

    def sync(self) -> None:
        if self.on_cuda:
            torch.cuda.synchronize(self.device)

    def timed(self, fn: Callable[[], object]) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start

    def fill_random(self) -> None:
        gen = torch.Generator(device=self.device).manual_seed(0)
        self.hot_bytes.random_(0, 256, generator=gen)
        self.sync()

    def mismatched_pages(self) -> list[int]:
        """Slots whose hot page and warm page differ (compared as bytes: random bits may be NaNs)."""
        bad = []
        for i in self.slots:
            hot_page = self.hot.kv[:, :, i].view(torch.uint8)   # [layers, 2, page_size, kv_heads, head_dim * itemsize]
            warm_page = self.warm.pages[i].view(torch.uint8).to(self.device)
            if not torch.equal(hot_page, warm_page):
                bad.append(i)
        return bad

    def verify(self, direction: str, what: str) -> None:
        bad = self.mismatched_pages()
        if bad:
            raise VerifyError(f"{direction}: {len(bad)} of {self.pages} pages differ after {what} "
                              f"(first: slot {bad[0]})")

    def open_cold(self, path: str) -> DiskTier:
        size = 2 * self.record_bytes + 64 * MiB   # room for every page, presized: no map growth
        return DiskTier(path, self.spec, max_bytes=size, map_size_max=size, map_size_initial=size)

    def drop(self) -> None:
        if self.drop_caches:
            drop_page_cache()

    # --- directions: each returns (tier seconds per repeat, baseline seconds per repeat) --------

    def hot_to_warm(self) -> tuple[list[float], list[float]]:
        tier, base = [], []
        for r in range(self.repeat + 1):   # round 0 warms up (first touch, CUDA allocator); not counted
            b = self.timed(lambda: self.warm_bytes.copy_(self.hot_bytes, non_blocking=True))
            self.warm_bytes.zero_()
            t = self.timed(lambda: self.hot.save_to(self.slots, self.warm, self.slots))
            self.verify("hot_to_warm", "DeviceTier.save_to")
            if r:
                tier.append(t)
                base.append(b)
        return tier, base

    def warm_to_hot(self) -> tuple[list[float], list[float]]:
        tier, base = [], []
        for r in range(self.repeat + 1):
            b = self.timed(lambda: self.hot_bytes.copy_(self.warm_bytes, non_blocking=True))
            self.hot.kv.zero_()
            t = self.timed(lambda: self.hot.load_from(self.slots, self.warm, self.slots))
            self.verify("warm_to_hot", "DeviceTier.load_from")
            if r:
                tier.append(t)
                base.append(b)
        return tier, base

    def warm_to_cold(self) -> tuple[list[float], list[float]]:
        tier, base = [], []
        for r in range(self.repeat):
            # A fresh file and a fresh store each round, all kept until the end: deleting them
            # between rounds makes the file system discard blocks while the next round writes.
            round_dir = tempfile.mkdtemp(prefix="round-", dir=self.workdir)
            raw_path, cold_path = os.path.join(round_dir, "pages.raw"), os.path.join(round_dir, "cold")
            cold = self.open_cold(cold_path)
            try:
                items = list(zip(self.headers, (self.warm.raw[s] for s in self.slots)))
                steps = [(base, lambda: write_file(raw_path, self.warm_view)),
                         (tier, lambda: cold.put_many(items).result())]
                for samples, step in steps[::-1] if r % 2 else steps:   # alternate who goes first
                    os.sync()   # nobody pays for the other's writeback
                    samples.append(self.timed(step))
                missing = sum(h.key not in cold for h in self.headers)
                if missing or cold.used_bytes != self.record_bytes:
                    raise VerifyError(f"warm_to_cold: {missing} of {self.pages} pages missing, "
                                      f"{cold.used_bytes} bytes stored, {self.record_bytes} written")
            finally:
                cold.close()
            self.cold_path, self.raw_path = cold_path, raw_path
        return tier, base

    def cold_to_warm(self) -> tuple[list[float], list[float]]:
        tier, base = [], []
        ns, fingerprint = self.namespace.digest, self.spec.fingerprint
        for _ in range(self.repeat):
            self.drop()
            base.append(self.timed(lambda: read_file(self.raw_path, self.warm_view)))
            self.verify("cold_to_warm", "the baseline file read")
            self.warm_bytes.zero_()
            # reopened each round: a fresh mapping of data.mdb, as after a restart
            cold = self.open_cold(self.cold_path)
            try:
                self.drop()
                requests = [(h.key, ns, h.tokens, fingerprint, self.warm.raw[s])
                            for h, s in zip(self.headers, self.slots)]
                ok: list[bool] = []
                tier.append(self.timed(lambda: ok.extend(cold.read_many(requests))))
            finally:
                cold.close()
            if len(ok) != self.pages or not all(ok):
                raise VerifyError(f"cold_to_warm: DiskTier.read_many refused {self.pages - sum(ok)} of {self.pages} "
                                  "pages (missing or failed verification)")
            self.verify("cold_to_warm", "DiskTier.read_many of the records warm_to_cold wrote")
        return tier, base

    def run(self) -> dict:
        self.progress(f"filling {format_size(self.nbytes)} of hot pages with random bytes")
        self.fill_random()
        seconds = {}
        for direction in DIRECTIONS:
            self.progress(f"{direction} ({self.repeat} repeats)")
            seconds[direction] = getattr(self, direction)()
        return seconds

    def close(self) -> None:
        self.hot.close()
        self.warm.close()


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _sig(x: float) -> float:
    """x to 4 significant digits (tiny runs measure microseconds)."""
    return float(f"{x:.4g}")


def summarize(seconds: dict, *, nbytes: int, pages: int, spec: KVSpec, model: str, device: torch.device,
              repeat: int, page_cache: str) -> dict:
    """The JSON report from the per-repeat seconds of each direction and its baseline."""
    pick = min   # STATISTIC
    tier_s = {d: pick(seconds[d][0]) for d in DIRECTIONS}
    # Each direction against the baseline timed in its own rounds, interleaved with it.
    base_s = {d: pick(seconds[d][1]) for d in DIRECTIONS}
    baselines = {"memcpy_gbps": _sig(_gbps(nbytes, base_s["hot_to_warm"]))}
    # the way back: host -> device on CUDA, the same host memcpy reversed on CPU
    way_back = "memcpy_h2d_gbps" if device.type == "cuda" else "memcpy_reverse_gbps"
    baselines[way_back] = _sig(_gbps(nbytes, base_s["warm_to_hot"]))
    baselines["file_write_fsync_gbps"] = _sig(_gbps(nbytes, base_s["warm_to_cold"]))
    baselines["file_read_gbps"] = _sig(_gbps(nbytes, base_s["cold_to_warm"]))

    out = {"benchmark": "tiers", "model": model, "dtype": spec.dtype, "page_size": spec.page_size,
           "page_bytes": spec.page_bytes, "pages": pages, "bytes": nbytes, "device": str(device),
           "repeat": repeat, "statistic": STATISTIC, "page_cache": page_cache, "cold_map": "presized",
           "verified": True}
    for d in DIRECTIONS:
        gbps, base = _gbps(nbytes, tier_s[d]), _gbps(nbytes, base_s[d])
        out[d] = {"gbps": _sig(gbps), "seconds": _sig(tier_s[d]), "ratio": _sig(gbps / base),
                  "baseline": BASELINES[d], "baseline_gbps": _sig(base),
                  "baseline_seconds": _sig(base_s[d]), "target": TARGETS[d],
                  "meets_target": gbps / base >= TARGETS[d],
                  "repeats_seconds": [_sig(x) for x in seconds[d][0]],
                  "baseline_repeats_seconds": [_sig(x) for x in seconds[d][1]]}
    out["baselines"] = baselines
    out["targets"] = dict(TARGETS)
    out["meets_targets"] = all(out[d]["meets_target"] for d in DIRECTIONS)
    return out


def format_report(r: dict) -> str:
    """The report as a readable table."""
    cache = ("from the OS page cache (just written)" if r["page_cache"] == "warm"
             else "with the OS page cache dropped first")
    lines = [f"{r['model']}, {r['dtype']}, {r['page_size']} tokens a page = {format_size(r['page_bytes'])}; "
             f"{r['pages']} pages = {format_size(r['bytes'])}; hot tier on {r['device']}",
             f"GB/s = 1e9 bytes/s, {r['statistic']} of {r['repeat']} repeats; cold reads {cache}",
             ""]
    rows = [("direction", "GB/s", "ms", "baseline", "GB/s", "ratio", "target", "met")]
    for d in DIRECTIONS:
        x = r[d]
        rows.append((d, f"{x['gbps']:.2f}", f"{x['seconds'] * 1e3:.4g}", x["baseline"], f"{x['baseline_gbps']:.2f}",
                     f"{x['ratio']:.2f}", f">= {x['target']:.1f}", "yes" if x["meets_target"] else "NO"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    left = {0, 3, 7}
    for row in rows:
        lines.append("  ".join(c.ljust(w) if i in left else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    lines += ["", f"all bytes verified; targets met: {'yes' if r['meets_targets'] else 'NO'}"]
    return "\n".join(lines)


def run_tiers(args: argparse.Namespace) -> int:
    """`kvstore bench tiers`: 0 when it ran (targets met or not), 1 when a copy was wrong."""
    pages = _positive("--pages", args.pages)
    repeat = _positive("--repeat", args.repeat)
    shape = load_shape(args.model)
    spec = shape.kv_spec(canonical_dtype(args.dtype, "--dtype"), args.page_size)
    if args.device not in ("auto", "cpu", "cuda"):
        raise ConfigError("--device", args.device, "must be auto, cpu or cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device", "cuda", "needs a CUDA GPU, and torch sees none (use auto or cpu)")
    device = resolve_device(args.device)
    drop = bool(getattr(args, "drop_caches", False))
    if drop and os.geteuid() != 0:
        raise KVStoreError("--drop-caches needs root (it writes /proc/sys/vm/drop_caches)")

    tty = sys.stderr.isatty()

    def progress(message: str) -> None:
        if tty:
            print(f"kvstore bench tiers: {message}", file=sys.stderr, flush=True)

    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="kvstore-bench-", dir=args.dir or None)
    bench = None
    try:
        bench = TierBench(spec, shape.name, pages, device, workdir, repeat, drop, progress)
        seconds = bench.run()
    except VerifyError as exc:
        print(f"kvstore bench tiers: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if bench is not None:
            bench.close()
        shutil.rmtree(workdir, ignore_errors=True)
    report = summarize(seconds, nbytes=pages * spec.page_bytes, pages=pages, spec=spec, model=shape.name,
                       device=device, repeat=repeat, page_cache="cold" if drop else "warm")
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


TIERS_EPILOG = """\
examples:
  kvstore bench tiers                          llama-3-8b pages (2 MiB), 256 of them, readable table
  kvstore bench tiers --json --pages 1024      one JSON object on stdout
  sudo kvstore bench tiers --drop-caches       cold reads from disk, not from the page cache

Memory: the hot and the warm tier hold PAGES pages each (256 x 2 MiB = 512 MiB apiece), and
LMDB holds one more copy during a cold write. Each repeat writes a raw file and a store of PAGES
pages each, all kept until the end: DIR needs room for about 2 x REPEAT x PAGES pages.
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `kvstore bench` and its benchmarks."""
    p = subparsers.add_parser("bench", help="measure the store: page throughput between tiers",
                              description="Benchmarks of the store. Run `kvstore bench BENCHMARK --help`.")
    benchmarks = p.add_subparsers(title="benchmarks", dest="benchmark", metavar="BENCHMARK", required=True)
    t = benchmarks.add_parser(
        "tiers", help="page throughput hot<->warm<->cold next to memcpy and raw file I/O baselines",
        description=__doc__, epilog=TIERS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--model", default="llama-3-8b", metavar="PRESET_OR_DIR",
                   help=f"page geometry from a preset ({', '.join(PRESETS)}) or a Hugging Face model "
                        "directory (default llama-3-8b)")
    t.add_argument("--dtype", default="bfloat16", help="KV dtype: bfloat16, float16, float32, fp8 (default bfloat16)")
    t.add_argument("--page-size", type=int, default=16, help="tokens a page, a power of two (default 16)")
    t.add_argument("--pages", type=int, default=256, help="pages moved in each direction (default 256)")
    t.add_argument("--repeat", type=int, default=3,
                   help="timed repeats of each direction; the fastest is reported (default 3)")
    t.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where the hot tier lives: auto (cuda when present), cpu or cuda (default auto)")
    t.add_argument("--dir", metavar="DIR",
                   help="put the cold LMDB and the raw baseline file in a fresh subdirectory of DIR, removed "
                        "afterwards (default: a temporary directory under the system temp dir)")
    t.add_argument("--drop-caches", action="store_true",
                   help="empty the OS page cache before each cold read and its baseline, so both read the "
                        "disk (root only)")
    t.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    t.set_defaults(func=run_tiers)
    return p
