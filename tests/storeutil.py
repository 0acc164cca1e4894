"""Helpers shared by the store tests: a small real store on the tiny geometry."""

from __future__ import annotations

import os
import threading

import numpy as np
import torch

from kvstore.config import load_config
from kvstore.errors import OutOfCapacity
from kvstore.pages.keys import Namespace, page_keys, tokens_bytes
from kvstore.pages.record import PREFIX_BYTES, RecordHeader
from kvstore.pages.spec import KVSpec
from kvstore.store.tiered import TieredStore

# TEST_HOT_DEVICE=cuda runs the store tests with the hot tier on the GPU.
HOT_DEVICE = os.environ.get("TEST_HOT_DEVICE", "cpu")
SPEC = KVSpec(2, 2, 16, "float32", 16)  # 8 KiB pages
RECORD_BYTES = SPEC.page_bytes + PREFIX_BYTES + 256  # a cold record, header included (upper bound)


# No watermark demotion in the background (the daemon's round, kicked by an allocation past the
# high watermark): for tests that count each move the test itself makes.
QUIET = {"hot.high_watermark": "1.0", "warm.high_watermark": "1.0"}


def make_config(data_dir, hot=8, warm=8, cold=32, **overrides):
    """Tier sizes in pages. The daemon's watermark round waits for a kick (daemon.interval_s of an
    hour), so that tiers change only when a test makes them; write-behind runs as ever. A producer
    waits 0.2 s for write-behind (daemon.backpressure_timeout_s), not 5."""
    values = {"data_dir": str(data_dir), "model": "tiny", "kv_dtype": "float32", "hot.device": HOT_DEVICE,
              "hot.pool": str(hot * SPEC.page_bytes), "warm.bytes": str(warm * SPEC.page_bytes),
              "cold.max_bytes": str(cold * RECORD_BYTES), "daemon.interval_s": "3600",
              "daemon.backpressure_timeout_s": "0.2"}
    values.update({k: str(v) for k, v in overrides.items()})
    return load_config(env={}, overrides=values)


def make_store(data_dir, **kw) -> TieredStore:
    """A store whose cold tier is indexed (opening indexes it in the background)."""
    s = TieredStore(make_config(data_dir, **kw))
    s.wait_indexed()
    return s


def reserved_warm_slots(store: TieredStore) -> int:
    """Warm slots in use that hold no indexed page and no caller's allocation: a fetch's reservations."""
    with store.core.lock:
        used = store.warm.pool.num_slots - store.warm.pool.num_free
        return used - len(store.index.warm_slots) - len(store.core.warm_owned)


def hold(store: TieredStore, keys) -> list[int]:
    """Hot slots of a cached chain, loading its cold pages first (acquire alone never reads the disk)."""
    store.promote(keys, "warm")
    return store.acquire(keys)


def page_content(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SPEC.page_shape, generator=g)


def tokens_for(doc: int, pages: int) -> list[int]:
    """Deterministic token ids: document `doc`, `pages` full pages."""
    return [(doc * 7919 + i * 31) % 500 for i in range(pages * SPEC.page_size)]


def grow(handle, pages: int) -> None:
    """handle.grow, waiting for write-behind when dirty pages hold the room (as the engine waits a step)."""
    while True:
        try:
            return handle.grow(pages)
        except OutOfCapacity as exc:
            if not exc.pending:
                raise
            handle.daemon.wait_progress(1.0)


def fill_and_commit(store: TieredStore, ns, tokens: list[int], start: int = 0):
    """Compute (here: write deterministic content for) the pages after the cached prefix, through a
    request's handle as the engine does; returns (all hot slots held, keys). Content of page i
    depends only on its key, as real KV would. The caller releases the slots (store.release)."""
    h = store.handle(ns)
    m = h.match(tokens)
    store.promote(m.keys, "warm")   # cold pages up first (attach never reads the disk)
    h.attach(m)
    held = h.num_pages
    grow(h, len(tokens) // SPEC.page_size)
    keys = page_keys(ns, tokens, SPEC.page_size)
    for i, slot in enumerate(h.slots[held:], start=held):
        store.hot.write_page(slot, page_content(int.from_bytes(keys[i][:4], "little")))
    h.commit(tokens, len(tokens) // SPEC.page_size)
    return h.slots, keys


def stall_writes(store: TieredStore, up_to_s: float = 30.0) -> threading.Event:
    """A disk that stalls: each write-behind batch waits until the returned event is set (or up_to_s
    passes) before it goes to the real cold tier. Set the event before closing the store."""
    gate = threading.Event()
    start_write = store.io.start_write
    store.io.start_write = lambda entries: (gate.wait(up_to_s), start_write(entries))[1]
    return gate


def settle(store: TieredStore, timeout: float = 30.0) -> None:
    """Wait until write-behind has written every dirty page (tests that count tiers)."""
    with store.core.lock:
        dirty = list(store.index.dirty.values())
    assert store.daemon.wait_clean(dirty, timeout), "write-behind did not catch up"


def expected_page(key: bytes) -> torch.Tensor:
    return page_content(int.from_bytes(key[:4], "little"))


def record_chain(n: int, spec: KVSpec, seed: int = 0, model: str = "m") -> list[tuple[RecordHeader, torch.Tensor]]:
    """n cold records of one prompt's page chain (random tokens and page bytes from `seed`), parent first."""
    ns = Namespace.for_spec(model, spec)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 32000, n * spec.page_size).tolist()
    items, parent = [], ns.digest
    for i, key in enumerate(page_keys(ns, tokens, spec.page_size)):
        toks = tokens_bytes(tokens[i * spec.page_size:(i + 1) * spec.page_size])
        items.append((RecordHeader(key, parent, ns.digest, toks, spec.fingerprint, spec.page_bytes),
                      torch.from_numpy(rng.integers(0, 256, spec.page_bytes, dtype=np.uint8))))
        parent = key
    return items
