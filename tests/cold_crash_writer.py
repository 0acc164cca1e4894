"""Child process of test_cold_crash.py: writes an endless chain of pages to a cold store.

usage: cold_crash_writer.py STORE_DIR START

Page i of the chain has deterministic tokens and payload (see `page`), so the parent can
check any page it was told about. Pages from START on are written in puts of a few pages,
several puts in flight; after each put's future resolves (durable commit) its pages are
printed as "INDEX KEYHEX" lines, flushed. The parent kills this process at a random moment.
"""

from __future__ import annotations

import sys
from collections import deque

import numpy as np

from kvstore.pages.keys import Namespace, chain_key, tokens_bytes
from kvstore.pages.record import RecordHeader
from kvstore.pages.spec import KVSpec
from kvstore.tiers.disk import DiskTier

SPEC = KVSpec(4, 2, 64, "float32", 16)   # 64 KiB pages
NS = Namespace.for_spec("crash-test", SPEC)
MiB = 1 << 20
PER_PUT, IN_FLIGHT = 4, 6


def page(i: int) -> tuple[list[int], np.ndarray]:
    """Tokens and payload of page i."""
    rng = np.random.default_rng(i)
    return rng.integers(0, 32000, SPEC.page_size).tolist(), rng.integers(0, 256, SPEC.page_bytes, dtype=np.uint8)


def key_of(i: int, parent: bytes) -> bytes:
    return chain_key(NS.digest, parent, page(i)[0])


def open_store(path: str) -> DiskTier:
    # a tiny first map, so the map also grows while the writer may be killed
    return DiskTier(path, SPEC, max_bytes=1 << 30, map_size_max=2 << 30, write_batch=4, map_size_initial=MiB)


def main(path: str, start: int) -> None:
    parent = NS.digest
    for i in range(start):
        parent = key_of(i, parent)
    tier = open_store(path)
    in_flight: deque = deque()
    i = start
    while True:
        items, done = [], []
        for _ in range(PER_PUT):
            tokens, payload = page(i)
            key = chain_key(NS.digest, parent, tokens)
            items.append((RecordHeader(key, parent, NS.digest, tokens_bytes(tokens), SPEC.fingerprint,
                                       SPEC.page_bytes), payload))
            done.append(f"{i} {key.hex()}")
            parent, i = key, i + 1
        in_flight.append((tier.put_many(items), done))
        if len(in_flight) >= IN_FLIGHT:
            future, lines = in_flight.popleft()
            future.result()
            print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
