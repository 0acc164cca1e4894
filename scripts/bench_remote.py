#!/usr/bin/env python3
"""Read throughput of the remote tier: a fresh store fetching a document's pages from Redis (one
server, and a 3-master Redis Cluster) and from Mooncake Store, next to the backend's own client
reading the same bytes.

    scripts/bench_remote.py [--backend single|cluster|mooncake|both|all] [--pages 256] [--repeat 7] [--known] [--busy N]

Prints one JSON object on stdout (progress goes to stderr).

The benchmark starts its own servers on free loopback ports, in a temporary directory, and stops
them at the end: redis-server processes (no persistence; redis-server and redis-cli must be
installed) and a mooncake_master with its HTTP metadata server (tests/mooncakeutil.py; the package
mooncake-transfer-engine-non-cuda and libibverbs1, which scripts/bootstrap installs). `all` (the
default) runs single, cluster and mooncake in turn, and skips mooncake, with a note in the JSON
("skipped"), where Mooncake is not installed; `--backend mooncake` then exits 2. `both`: single
and cluster.
Pages have SmolLM2-135M's geometry: 30 layers, 3 KV heads of 64, 16 tokens a page, float32 KV,
737,280 bytes a page (the remote value is the page's cold record: the page and a header).

Per backend:
    setup     store A (hot on the CPU, warm and cold in a temporary data directory) computes the
              `--pages` pages of one document (seeded random token ids; page content: seeded
              random numbers) and its write-behind puts them into the remote store (from cold).
              Redis: store A is closed once the pages are written, before any measurement.
              Mooncake keeps values in memory its clients lend: store A lends the store a segment
              (max(1 GiB, 2 x the document's records), segment=SIZE in its URL) and stays open, in
              this process, until the backend's measurements are done (B's reads and the client's
              are served from A's segment over loopback TCP, by A's transfer engine).
    kvstore   store B (its own data directory, empty; warm holds the whole chain; no cold tier:
              it only reads; for Mooncake it lends no memory, segment=0) calls fetch_remote for
              the document: the records land straight in reserved warm slots, READ_CHUNK (16)
              pages a call, two calls in flight (one for one redis-server; Redis: pipelined GETs
              received into warm; Mooncake: one batch_get_into into registered warm memory, each
              record landing whole, its head in the room warm leaves before each page, the call
              made from a helper thread), each is verified where it landed and adopted
              into warm. Only that call is timed; B then evicts the pages again. Every
              page must arrive. A first fetch, into warm memory never written before (its page
              faults: a fresh instance's first fetch), checks each page's bytes against what A
              wrote and is reported apart (kvstore_first_touch_gbps); the repetitions reuse B's
              warm slots, as a running instance does.
    client    redis-py alone (redis.Redis or redis.RedisCluster, the same socket_read_size as
              kvstore's backend, hiredis when installed) reading the same keys, READ_CHUNK per pipeline,
              the values kept as bytes: what the backend's client can do. Mooncake: the library's
              own MooncakeDistributedStore, a pure client (lending no memory, set up as kvstore's
              backend is), reading the same keys with batch_get_into, READ_CHUNK a call, into one
              registered buffer of READ_CHUNK slots (reused by each call, as kvstore's backend reuses its
              area); each call's byte counts are checked against the record sizes.
    client_kept  (Mooncake) the same client reading each record into a slot of its own, in one
              registered buffer as large as the document: what the client does when it keeps the
              pages, as kvstore must (reported beside the goal's ratio, which stays vs `client`).
The ways alternate for `--repeat` repetitions (each first in turn). Reported per backend: the median GB/s of each (record bytes / seconds), their ratio
kvstore / client (goal >= 0.8; and ratio_paired, the median over repetitions of the ratio within
each, which a machine whose speed drifts between repetitions moves less), the page and byte counts, and for reference the machine's memory
copy speed for the same bytes (numpy, into memory already touched) and the client's throughput
followed by one such copy (client_then_copy_gbps).

--busy N keeps N more cores busy (N processes, each a Python loop) while store B and the client
read (from the first fetch to the last repetition): a machine whose cores an engine's inference
holds. The JSON says how many ("busy"); 0, the default, is an idle machine.

--ttft (time to first token of a request whose prefix comes from the remote) is not built: the
option is refused.
"""

from __future__ import annotations

import remote_harness  # the standard library only

remote_harness.enter_venv(__file__)

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import redis  # noqa: E402
from importlib import metadata as importlib_metadata  # noqa: E402
import torch  # noqa: E402
import xxhash  # noqa: E402

from kvstore.config import load_config  # noqa: E402
from kvstore.pages.keys import page_keys  # noqa: E402
from kvstore.pages.record import PREFIX_BYTES  # noqa: E402
from kvstore.pages.spec import KVSpec  # noqa: E402
from kvstore.remote.redis_backend import READ_BUFFER  # noqa: E402
from kvstore.remote.tier import READ_CHUNK  # noqa: E402
from kvstore.store.tiered import TieredStore  # noqa: E402
import mooncakeutil  # noqa: E402   (imports mooncake only when asked whether it is installed)
from remote_clients import MooncakeClient, RedisClient, client_fetch  # noqa: E402
from remote_harness import BenchError, BusyCores, log, missing_executable, server_url, start_servers  # noqa: E402
from storeutil import grow  # noqa: E402

SPEC = KVSpec(30, 3, 64, "float32", 16)   # SmolLM2-135M: 737,280 bytes a page
MODEL_ID = "SmolLM2-135M"
RECORD_BYTES = SPEC.page_bytes + PREFIX_BYTES + 256   # a cold record, header included (upper bound)
KEY_PREFIX = "bench:"
GOAL_RATIO = 0.8
WRITE_TIMEOUT_S = 300
REDIS_KINDS = ("single", "cluster")
KINDS = {"single": ("single",), "cluster": ("cluster",), "mooncake": ("mooncake",),
         "both": REDIS_KINDS, "all": (*REDIS_KINDS, "mooncake")}
MIN_SEGMENT = 1 << 30   # what store A lends Mooncake at least (1 GiB)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


# stores
def store_config(data_dir: Path, url: str, hot: int, warm: int, cold: int):
    """A store on the CPU: tier sizes in pages (cold 0: none, and the remote read only), the remote at url."""
    return load_config(env={}, overrides={
        "data_dir": str(data_dir), "model": "tiny", "kv_dtype": "float32", "hot.device": "cpu",
        "hot.pool": str(hot * SPEC.page_bytes), "warm.bytes": str(warm * SPEC.page_bytes),
        "cold.enabled": str(cold > 0), "cold.max_bytes": str(max(1, cold) * RECORD_BYTES), "remote.url": url,
        "remote.write": str(cold > 0), "remote.key_prefix": KEY_PREFIX, "remote.timeout_ms": "10000"})


def open_store(data_dir: Path, url: str, hot: int, warm: int, cold: int) -> TieredStore:
    store = TieredStore(store_config(data_dir, url, hot, warm, cold), spec=SPEC, model_id=MODEL_ID)
    store.wait_indexed()
    return store


def page_content(seed: int) -> torch.Tensor:
    return torch.randn(SPEC.page_shape, generator=torch.Generator().manual_seed(seed))


def write_document(tmp: Path, url: str, pages: int, seed: int):
    """Store A computes the document's pages (through a request's handle, as the engine does) and
    writes them to the remote. Returns (store A, still open: the caller closes it, namespace,
    tokens, keys, xxh3 of each page's bytes); store A is closed here only when this fails."""
    a = open_store(tmp / "a", url, hot=pages + 4, warm=pages + 4, cold=2 * pages + 8)
    try:
        ns = a.namespace()
        tokens = np.random.default_rng(seed).integers(0, 49152, pages * SPEC.page_size).tolist()
        keys = page_keys(ns, tokens, SPEC.page_size)
        h = a.handle(ns)
        grow(h, pages)
        digests = []
        for i, slot in enumerate(h.slots):
            page = page_content(seed * 1_000_003 + i)
            digests.append(xxhash.xxh3_64_intdigest(page.numpy().tobytes()))
            a.hot.write_page(slot, page)
        h.commit(tokens, pages)
        h.release()
        with a.core.lock:
            dirty = list(a.index.dirty.values())
        if not a.daemon.wait_clean(dirty, WRITE_TIMEOUT_S):
            raise BenchError("store A's write-behind did not write the pages to cold")
        # a page is offered to the remote just after it stops being dirty: wait for the count too
        deadline = time.monotonic() + WRITE_TIMEOUT_S
        while a.remote.written_pages < pages and time.monotonic() < deadline:
            a.remote.wait_written(max(0.0, deadline - time.monotonic()))
            time.sleep(0.02)
        stats = a.remote.stats()
        if stats["written_pages"] != pages:
            raise BenchError(f"store A wrote {stats['written_pages']} of {pages} pages to the remote: {stats}")
        return a, ns, tokens, keys, digests
    except BaseException:
        a.close()
        raise


def open_reader(tmp: Path, url: str, pages: int) -> TieredStore:
    """Store B: its own data directory, warm for the whole chain, no cold tier (it only reads the remote)."""
    shutil.rmtree(tmp / "b", ignore_errors=True)
    return open_store(tmp / "b", url, hot=4, warm=math.ceil(pages / 0.8) + 4, cold=0)


def kvstore_fetch(b: TieredStore, ns, tokens, keys, known: int | None, digests: list[int] | None) -> float:
    """Seconds store B's fetch_remote of the document took; B holds none of it before, and none after."""
    pages = len(keys)
    try:
        gc.collect()
        t0 = time.perf_counter()
        local, added = b.fetch_remote(tokens, ns, known)
        seconds = time.perf_counter() - t0
        if (local, added) != (0, pages):
            raise BenchError(f"store B's fetch_remote gave (local, added) = {(local, added)}, not (0, {pages}): "
                             f"{b.stats()['tiers']['remote']}")
        if digests is not None:
            for i, key in enumerate(keys):
                e = b.index.get(key)
                if e is None or e.tier != "warm":
                    raise BenchError(f"page {i} is not in store B's warm tier")
                if xxhash.xxh3_64_intdigest(bytes(b.warm.payloads([e.warm])[0])) != digests[i]:
                    raise BenchError(f"page {i} in store B's warm tier is not what store A wrote")
        return seconds
    finally:
        b.evict(keys)


# the floor
def memcpy_gbps(nbytes: int, repeat: int) -> float:
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)   # touch every page of dst first
    times = []
    for _ in range(max(3, repeat)):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return gbps(nbytes, statistics.median(times))


# one backend
def segment_bytes(pages: int) -> int:
    """What store A lends Mooncake: room for the document's records twice over, 1 GiB at least."""
    return max(MIN_SEGMENT, 2 * pages * RECORD_BYTES)


def bench_backend(kind: str, args, tmp: Path) -> dict:
    tmp.mkdir(parents=True)
    started = time.perf_counter()
    a = b = client = None
    segment = segment_bytes(args.pages) if kind == "mooncake" else None
    servers = start_servers(kind, tmp)
    url, url_b = server_url(kind, servers, segment), server_url(kind, servers)
    try:
        if kind == "mooncake":
            log(f"{kind}: mooncake_master {servers[0].rpc_port} (metadata {servers[0].http_port}) up; store A lends "
                f"{segment / 2**20:.0f} MiB and writes {args.pages} pages")
        else:
            log(f"{kind}: redis-server {', '.join(str(s.port) for s in servers)} up; store A writes {args.pages} pages")
        t = time.perf_counter()
        a, ns, tokens, keys, digests = write_document(tmp, url, args.pages, args.seed)
        write_s = time.perf_counter() - t
        if kind != "mooncake":   # Redis holds the values itself: A is not needed any more
            a.close()
            a = None
        names = [f"{KEY_PREFIX}page:{ns.digest.hex()}:{k.hex()}" for k in keys]
        client = MooncakeClient(url_b) if kind == "mooncake" else RedisClient(kind, url)
        if kind == "mooncake":
            sizes = client.sizes(names)
            _, got = client.timed_read(names)   # touches the client's buffer; checks the sizes
            if got != sizes:
                raise BenchError("the Mooncake client's byte counts are not the record sizes")
        else:
            _, sizes = client.timed_read(names)
        if any(n is None for n in sizes):
            missing = sum(n is None for n in sizes)
            raise BenchError(f"{missing} of {len(names)} records are not in the remote store")
        nbytes = sum(sizes)
        log(f"{kind}: {args.pages} records ({nbytes / 1e6:.1f} MB) in the remote store after {write_s:.1f} s")
        known = args.pages if args.known else None
        ways = ("kvstore", "client", "client_kept") if kind == "mooncake" else ("kvstore", "client")
        times: dict[str, list[float]] = {w: [] for w in ways}
        b = open_reader(tmp, url_b, args.pages)
        with BusyCores(args.busy):
            first_touch = kvstore_fetch(b, ns, tokens, keys, known, digests)   # into warm never written before
            for r in range(args.repeat):
                for who in ways[r % len(ways):] + ways[:r % len(ways)]:   # each way first in turn
                    if who == "kvstore":
                        s = kvstore_fetch(b, ns, tokens, keys, known, None)
                    else:
                        s = client_fetch(client, names, sizes, kept=who == "client_kept")
                    times[who].append(s)
                log(f"{kind}: repetition {r + 1}/{args.repeat}: kvstore {gbps(nbytes, times['kvstore'][-1]):.2f} "
                    f"GB/s, client {gbps(nbytes, times['client'][-1]):.2f} GB/s")
    finally:
        # readers first, then the store that lends the memory (Mooncake), then the servers
        try:
            if b is not None:
                b.close(persist=False)
        finally:
            try:
                if client is not None:
                    client.close()
            finally:
                try:
                    if a is not None:
                        a.close()
                finally:
                    for s in servers:
                        s.stop()
    kv, cl = (gbps(nbytes, statistics.median(times[w])) for w in ("kvstore", "client"))
    floor = memcpy_gbps(nbytes, args.repeat)
    ratio = round(kv / cl, 3)
    out = {
        "url": url, "servers": len(servers), "client": client.name, "store_a_open": kind == "mooncake",
        "pages": args.pages, "page_bytes": SPEC.page_bytes, "record_bytes": nbytes, "known": known,
        "kvstore_gbps": round(kv, 3), "client_gbps": round(cl, 3),
        "ratio": ratio, "goal_ratio": GOAL_RATIO, "goal_met": ratio >= GOAL_RATIO,
        "ratio_paired": round(statistics.median(c / k for k, c in zip(times["kvstore"], times["client"])), 3),
        "memcpy_gbps": round(floor, 3), "kvstore_first_touch_gbps": round(gbps(nbytes, first_touch), 3),
        # the client's read plus one copy of the bytes into warm, one after the other: where kvstore
        # lands when no core is free to overlap them (the server, or for Mooncake store A's transfer
        # engine, and the reader hold this machine's two)
        "client_then_copy_gbps": round(1 / (1 / cl + 1 / floor), 3),
        "ratio_to_client_then_copy": round(kv / (1 / (1 / cl + 1 / floor)), 3),
        "kvstore_s": [round(s, 4) for s in times["kvstore"]], "client_s": [round(s, 4) for s in times["client"]],
        "setup_write_s": round(write_s, 2), "elapsed_s": round(time.perf_counter() - started, 1),
    }
    if kind == "mooncake":
        out["reader_url"], out["segment_bytes"] = url_b, segment
        kept = gbps(nbytes, statistics.median(times["client_kept"]))
        out["client_kept_gbps"], out["ratio_to_client_kept"] = round(kept, 3), round(kv / kept, 3)
        out["client_kept_s"] = [round(s, 4) for s in times["client_kept"]]
    return out


def mooncake_version() -> str | None:
    try:
        return importlib_metadata.version("mooncake-transfer-engine-non-cuda")
    except importlib_metadata.PackageNotFoundError:
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="\n\n".join(__doc__.split("\n\n")[2:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=tuple(KINDS), default="all",
                    help="one redis-server, a 3-master Redis Cluster, Mooncake Store (one mooncake_master; "
                    "store A lends the memory and stays open until B and the client have read: for Redis "
                    "it is closed before they read), both (single and cluster) or all three in turn "
                    "(default all; mooncake is skipped, with a note in the JSON, where it is not installed)")
    ap.add_argument("--pages", type=int, default=256,
                    help=f"pages of the document (default 256: 4,096 tokens, "
                    f"{256 * SPEC.page_bytes / 1e6:.0f} MB of KV)")
    ap.add_argument("--repeat", type=int, default=7, help="repetitions of each measurement; medians are reported "
                    "(default 7)")
    ap.add_argument("--known", action="store_true", help="pass fetch_remote known=PAGES, as when the prefix index "
                    "says what the remote holds (default: the store asks the remote, one more round trip)")
    ap.add_argument("--busy", type=int, default=0, help="processes that each keep a core busy while the "
                    "reads are measured: a machine whose cores inference holds (default 0: idle)")
    ap.add_argument("--seed", type=int, default=0, help="token ids and page content (default 0)")
    ap.add_argument("--ttft", action="store_true", help="not built: refused (see the end of this help)")
    args = ap.parse_args()
    for flag in ("pages", "repeat"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be an integer >= 1")
    if args.busy < 0:
        ap.error("--busy must be an integer >= 0")
    if args.ttft:
        ap.error("--ttft is not built: this benchmark measures fetch throughput only")
    kinds = KINDS[args.backend]
    skipped: dict[str, str] = {}
    if "mooncake" in kinds:
        why = mooncakeutil.missing()
        if why and args.backend == "mooncake":
            log(f"bench_remote: Mooncake is not available: {why}")
            return 2
        if why:
            skipped["mooncake"] = f"not installed: {why}"
            kinds = tuple(k for k in kinds if k != "mooncake")
    if any(k in REDIS_KINDS for k in kinds):
        why = missing_executable("redis-server", "redis-cli")
        if why:
            log(f"bench_remote: {why}")
            return 1
    started = time.perf_counter()
    result: dict = {"benchmark": "remote", "spec": SPEC.describe(), "model": MODEL_ID, "pages": args.pages,
                    "tokens": args.pages * SPEC.page_size, "page_bytes": SPEC.page_bytes, "repeat": args.repeat,
                    "busy": args.busy, "read_chunk": READ_CHUNK, "socket_read_size": READ_BUFFER,
                    "hiredis": bool(redis.utils.HIREDIS_AVAILABLE), "redis_py": redis.__version__,
                    "mooncake": mooncake_version(),
                    "statistic": "median GB/s (record bytes / seconds)", "goal_ratio": GOAL_RATIO, "backends": {}}
    try:
        with tempfile.TemporaryDirectory(prefix="kvstore-bench-remote-") as tmp:
            for kind in kinds:
                result["backends"][kind] = bench_backend(kind, args, Path(tmp) / kind)
    except (BenchError, RuntimeError) as exc:
        log(f"bench_remote: {exc}")
        return 1
    if skipped:
        result["skipped"] = skipped
    result["goal_met"] = all(b["goal_met"] for b in result["backends"].values())
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
