#!/usr/bin/env python3
"""Eviction at scale: choosing victims and trimming the index, the policy queues against the scan
they replaced, in the same run. Prints one JSON object.

    .venv/bin/python scripts/bench_victims.py [--sizes 10000,100000,1000000] [--policy lru]

Each size builds a PageIndex directly (no LMDB): chains of 8 pages, every page in cold and in hot;
a quarter of the chains is referenced (taken by commit, without a touch), so they are the oldest
hot pages, ahead of every victim in LRU order. Timed: victims(tier, 8) in cold and hot, and the
prefix_cache_max_entries trim of the 1000 oldest leaves, each checked to choose what the scan chooses.
"""

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvstore.movement.mover import PageMover  # noqa: E402
from kvstore.placement.index import PageEntry, PageIndex  # noqa: E402
from kvstore.placement.policy import pick  # noqa: E402

CHAIN = 8
TRIM = 1000


def build(n: int, policy: str) -> tuple[PageIndex, PageMover]:
    index = PageIndex(policy)
    mover = PageMover(None, None, None, None, index, policy, lambda *a: None)
    parent = b"root"
    for i in range(n):
        if i % CHAIN == 0:
            parent = b"root"
        e = index.add(PageEntry(i.to_bytes(8, "little"), parent, b"ns", b"", depth=i % CHAIN))
        index.set_cold(e, True)
        index.set_hot(e, i)
        if (i // CHAIN) % 4 == 0:
            e.refcount += 1
        parent = e.key
    return index, mover


def scan_victims(mover: PageMover, tier: str, n: int) -> list[PageEntry]:
    """PageMover.victims before the queues: filter the whole tier, then nsmallest."""
    index, now = mover.index, mover.index.now()
    members = index.hot_slots.values() if tier == "hot" else (e for e in index.entries.values() if e.cold)
    return pick(mover.policy, (e for e in members if mover.evictable(e, tier, now)), n)


def scan_trim(index: PageIndex, over: int) -> list[PageEntry]:
    """TieredStore's trim before the queues: every leaf, sorted by last access."""
    now = index.now()
    leaves = [e for e in index.entries.values() if not e.kids and not e.refcount and not e.pinned(now)]
    return sorted(leaves, key=lambda e: e.last_access)[:over]


def timed(fn, reps: int) -> tuple[float, object]:
    """Median seconds of `reps` calls, and the last result."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def queue_bytes(index: PageIndex) -> int:
    """The queues' heaps, items and key tuples (ints shared with the entries are not counted), the
    cold set, and the two fields each entry gained (seq, stamp)."""
    total = sys.getsizeof(index.cold_entries)
    for queues in index._orders.values():
        for q in queues.values():
            total += sys.getsizeof(q.heap) + sum(sys.getsizeof(it) + sys.getsizeof(it[0]) for it in q.heap)
    return total + len(index) * (2 * 8 + 2 * sys.getsizeof(1 << 40))


def measure(n: int, policy: str) -> dict:
    t = time.perf_counter()
    index, mover = build(n, policy)
    build_s = time.perf_counter() - t
    first_s, _ = timed(lambda: mover.victims("cold", 8), 1)   # takes in every addition: a rebuild
    out = {"build_s": round(build_s, 3), "first_read_s": round(first_s, 3),
           "bytes_per_entry": round(queue_bytes(index) / n, 1)}
    scan_reps = 3 if n >= 1_000_000 else 5
    for tier in ("cold", "hot"):
        new_s, got = timed(lambda: mover.victims(tier, 8), 200)
        old_s, want = timed(lambda: scan_victims(mover, tier, 8), scan_reps)
        out[f"victims_{tier}"] = {"queue_us": round(new_s * 1e6, 1), "scan_ms": round(old_s * 1e3, 2),
                                  "ratio": round(old_s / new_s, 1), "same": [e.key for e in got] == [e.key for e in want]}
    ok = (lambda now: lambda e: not e.refcount and not e.pinned(now))(index.now())
    new_s, got = timed(lambda: index.oldest_leaves(TRIM, ok), 20)
    old_s, want = timed(lambda: scan_trim(index, TRIM), scan_reps)
    out["trim"] = {"queue_ms": round(new_s * 1e3, 3), "scan_ms": round(old_s * 1e3, 2), "ratio": round(old_s / new_s, 1),
                   "same": [e.key for e in got] == [e.key for e in want]}
    rng = random.Random(0)
    entries = list(index.entries.values())

    def churn():   # requests touch pages, then the store picks victims in both tiers
        for e in rng.sample(entries, 8):
            index.touch(e)
        mover.victims("hot", 8)
        mover.victims("cold", 8)
    churn_s, _ = timed(churn, 2000)
    out["touch8_then_victims_hot_and_cold_us"] = round(churn_s * 1e6, 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10000,100000,1000000", help="entries per index, comma-separated")
    ap.add_argument("--policy", default="lru", help="eviction policy (lru, lfu, refcount, prefix_aware, ...)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    result = {"policy": args.policy, "chain_pages": CHAIN, "trim_leaves": TRIM, "victims_n": 8,
              "sizes": {str(n): measure(n, args.policy) for n in sizes}}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
