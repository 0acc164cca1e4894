"""RemoteTier: page records in a distributed store other instances share, below cold.

Reads: `fetch` (a worker thread's call) has the backend receive the records of a chain's pages
beyond what the store holds straight into reserved warm slots (landing.py: each record's head
beside the slot, its page in it), verifies each where it landed (the head must be exactly the
record expected: key, parent, namespace, tokens, geometry; and the checksum) and has the store
adopt the good ones, a chunk at a time while the next is received. The first page the remote
store does not hold ends the chain (a miss); one that fails verification is a counted corrupt
page, never indexed, so never served. Which pages the remote holds is known before asking when
the prefix index says so (`known`); else the reads find where the chain ends (a missing key
reads as nothing).

Writes: pages reach it by write-behind from cold. The store's daemon `offer`s every page it
has made durable in cold; the writer thread takes them in order, up to WRITE_BATCH_BYTES a
batch, asks which the remote already holds (one round trip), reads the others' records from
cold (the cold record is the remote value) and sends them in one pipelined batch. At most
remote.queue_pages wait; beyond that the oldest are skipped and counted (cold still holds them).

Keys: `<remote.key_prefix>page:<namespace digest hex>:<page key hex>`. A value is a page record
in kvstore.pages.record's format, so a reader checks it whatever wrote it.

Capacity: remote.max_bytes is this instance's budget: past it, the oldest records it wrote are
deleted. The remote store's own eviction (Redis `maxmemory` with `allkeys-lru`, Mooncake's)
bounds the whole; a key it evicted is a miss.

Failures are misses: a call waits at most remote.timeout_ms; a failure marks the remote down
(one log line) and calls fail fast until a retry, after a backoff that doubles up to BACKOFF_S[1];
the first call that succeeds again logs one line. Nothing here ever raises into a request.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np

from kvstore.config import RemoteConfig, redact_secret
from kvstore.errors import KVStoreError
from kvstore.pages import record
from kvstore.pages.record import RecordHeader
from kvstore.pages.spec import KVSpec
from kvstore.remote.backend import LANDED, MISSING, RemoteBackend, RemoteDown, StillLanding
from kvstore.remote.landing import WarmLanding

log = logging.getLogger("kvstore.remote")

WRITE_BATCH_BYTES = 16 << 20   # record bytes per write batch, at most
READ_CHUNK = 16                # pages per read call (16 measured faster than 32 and 64)
IN_FLIGHT = 2                  # read calls a fetch has in flight at most (on as many reader threads);
                               # a backend may ask for fewer (RemoteBackend.reads_in_flight)
BACKOFF_S = (0.5, 30.0)        # wait before retrying a remote that failed: first and longest
DRAIN_S = 10.0                 # close() writes what is queued for at most this long

Listener = Callable[[str, bytes, list[bytes]], None]   # (event "add" | "remove", namespace, keys)


class RemoteTier:
    name = "remote"

    def __init__(self, config: RemoteConfig, spec: KVSpec, connect: Callable[[], RemoteBackend]):
        """connect() builds the backend: now, and again after a start while the remote was down."""
        self.config, self.spec, self._connect = config, spec, connect
        self.url = redact_secret(config.url)
        self.backend: RemoteBackend | None = None
        self.prefix = config.key_prefix
        self._lock = threading.Condition()
        self._queue: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()   # key -> namespace
        self._written: collections.OrderedDict[bytes, tuple[bytes, int]] = collections.OrderedDict()
        self.written_bytes = 0      # bytes of the records this instance wrote and has not deleted
        self._listeners: list[Listener] = []
        self._source: Callable[[list[bytes]], list[bytes | None]] | None = None
        self._thread: threading.Thread | None = None
        self._readers: queue.SimpleQueue = queue.SimpleQueue()   # pairs of reader threads, between fetches
        self._lent: tuple[np.ndarray, int] | None = None         # warm's memory, where reads land, and its head room
        self._stopping = False
        # health
        self.state, self.last_error = "up", ""
        self.down_since = self.retry_at = 0.0
        self._backoff = BACKOFF_S[0]
        # counters
        self.hits = self.misses = self.corrupt = self.errors = 0
        self.read_bytes = self.reads = 0
        self.read_s = 0.0
        self.written_pages = self.write_batches = self.skipped_pages = self.present_pages = 0
        self.deleted_pages = 0

    # keys
    def key(self, namespace: bytes, key: bytes) -> str:
        return f"{self.prefix}page:{namespace.hex()}:{key.hex()}"

    def add_listener(self, fn: Listener) -> None:
        """fn(event, namespace, keys) when this instance stores ("add") or deletes ("remove") pages
        in the remote store (the prefix index publishes them); called on the writer thread."""
        self._listeners.append(fn)

    def _emit(self, event: str, namespace: bytes, keys: list[bytes]) -> None:
        for fn in self._listeners:
            try:
                fn(event, namespace, keys)
            except Exception:  # noqa: BLE001 - a listener's failure must not stop the writer
                log.exception("remote tier listener failed")

    # health
    def available(self) -> bool:
        """Whether a call may go to the remote store now (up, or down with its retry due)."""
        return self.state == "up" or time.monotonic() >= self.retry_at

    def _call(self, fn: str, *args):
        """The backend's method fn(*args); RemoteDown (at once while down and no retry is due) on failure."""
        if not self.available():
            raise RemoteDown(f"the remote store is down: {self.last_error}")
        try:
            if self.backend is None:
                self.backend = self._connect()
                if self._lent is not None:
                    self.backend.lend(*self._lent)
            result = getattr(self.backend, fn)(*args)
        except RemoteDown as exc:
            self.mark_down(exc)
            raise
        except KVStoreError as exc:   # e.g. the store began refusing our password: down, not an error
            self.mark_down(RemoteDown(str(exc)))
            raise RemoteDown(str(exc)) from None
        if self.state != "up":
            log.info("remote store %s is back after %.1f s", self.url, time.monotonic() - self.down_since)
            self.state, self.last_error, self._backoff = "up", "", BACKOFF_S[0]
        return result

    def mark_down(self, exc: RemoteDown) -> None:
        self.errors += 1
        now = time.monotonic()
        if self.state == "up":
            self.down_since = now
            log.warning("remote tier unavailable (%s): its pages are misses, retried with backoff", exc)
        else:
            self._backoff = min(2 * self._backoff, BACKOFF_S[1])
        self.state, self.last_error, self.retry_at = "down", str(exc), now + self._backoff

    # reads
    def lend(self, area: np.ndarray, room: int) -> None:
        """Reads will land in `area` (warm's memory; `room` bytes before each slot are its own): the
        backend is told, now and on a reconnect."""
        if not area.nbytes:
            return
        self._lent = (area, room)
        if self.backend is not None:
            try:
                self.backend.lend(area, room)
            except RemoteDown as exc:
                self.mark_down(exc)

    def fetch(self, namespace: bytes, keys: Sequence[bytes], tokens: Sequence[bytes], parent: bytes,
              landing: WarmLanding, known: int | None = None, roots: bool = False) -> int:
        """Read the leading pages of this chain that the remote store holds straight into reserved
        warm slots, verify each where it landed and have `landing` cache them, a chunk at a time
        (READ_CHUNK pages); returns the pages cached. keys[i] is the page whose tokens are
        tokens[i], parent the key before keys[0] (the namespace digest for page 0). `known`: how
        many the prefix index says it holds (None: read until a page is missing). With `roots`
        every page's parent is `parent` (named pages: kvstore.pages.keys). The next chunk is read while
        one is adopted. Blocks for network round trips: for worker threads. Never raises: failures
        are misses."""
        headers = []
        for key, toks in zip(keys, tokens):
            headers.append(RecordHeader(key, parent, namespace, toks, self.spec.fingerprint, self.spec.page_bytes))
            parent = parent if roots else key
        names = [self.key(namespace, k) for k in keys]
        known = len(names) if known is None else min(known, len(names))
        # up to IN_FLIGHT chunks are read on as many reader threads while this thread adopts the one
        # received (verified where it landed) before them
        chunks = [range(a, min(a + READ_CHUNK, known)) for a in range(0, known, READ_CHUNK)]
        total, inflight = 0, collections.deque()
        readers = self._take_readers()
        ahead = max(1, min(IN_FLIGHT, getattr(self.backend, "reads_in_flight", IN_FLIGHT)))

        def submit(i: int) -> None:
            inflight.append(readers[i % ahead].submit(self._land, names, headers, chunks[i], landing))
        try:
            for i in range(min(ahead, len(chunks))):
                submit(i)
            for i, chunk in enumerate(chunks):
                slots, good = inflight.popleft().result()
                if good == len(chunk) and i + ahead < len(chunks):
                    submit(i + ahead)
                stored = landing.adopt([headers[j] for j in chunk[:good]], slots[:good]) if good else 0
                landing.release(slots[good:])
                total += stored
                if stored < len(chunk):
                    break
        except RemoteDown:
            pass
        finally:
            self.hits += total
            self._give_readers(readers, inflight, landing)
        return total

    def _take_readers(self) -> list[ThreadPoolExecutor]:
        """A pair of reader threads for one fetch, kept between fetches (a backend's per-thread
        connections and buffers stay open, registered and touched); a new pair when every pair is in use."""
        try:
            return self._readers.get_nowait()
        except queue.Empty:
            return [ThreadPoolExecutor(1, thread_name_prefix="kvstore-remote-read") for _ in range(IN_FLIGHT)]

    def _give_readers(self, readers: list[ThreadPoolExecutor], inflight, landing: WarmLanding) -> None:
        """Back to the pool once the reads still in flight have ended and their slots are freed."""
        for pending in inflight:
            try:
                landing.release(pending.result()[0])
            except RemoteDown:
                pass
        self._readers.put(readers)

    def _land(self, names: list[str], headers: list[RecordHeader], chunk: range,
              landing: WarmLanding) -> tuple[list[int], int]:
        """Receive chunk's pages into reserved warm slots (as many as warm has room for) and verify
        them in order: (the slots, how many lead the chunk verified). The first missing page is a
        miss and one that fails verification a counted corrupt page; either ends the good run."""
        reserved = landing.reserve(len(chunk))
        if not reserved:
            return [], 0
        idx = chunk[:len(reserved)]
        heads = [np.empty(record.head_size(headers[j]), np.uint8) for j in idx]
        t0 = time.monotonic()
        targets = [t for _, t in reserved]
        slots = [s for s, _ in reserved]
        try:   # each page is checked as soon as it has landed, while its bytes are in cache
            codes = self._call("get_into", [names[j] for j in idx], heads, targets,
                               lambda k: record.check_landed(heads[k], headers[idx[k]], targets[k]))
        except StillLanding as exc:   # the slots may still be written: free only once the read ends
            exc.when_done(lambda: landing.release(slots))
            raise
        except BaseException:
            landing.release(slots)
            raise
        self.read_s += time.monotonic() - t0
        self.reads += 1
        good = 0
        for j, code, head, target in zip(idx, codes, heads, targets):
            if code == MISSING:
                self.misses += 1
                break
            if code != LANDED:
                self.count_corrupt(headers[j].key)
                break
            self.read_bytes += len(head) + len(target)
            good += 1
        return slots, good

    def count_corrupt(self, key: bytes) -> None:
        """A value that failed verification: counted, and logged without its contents."""
        self.corrupt += 1
        log.warning("remote page %s failed verification: a miss, not served", key.hex()[:12])

    # writes
    def start(self, source: Callable[[list[bytes]], list[bytes | None]]) -> None:
        """Start writing offered pages; source(keys) gives their records (from cold)."""
        if not self.config.write:
            return
        self._source = source
        self._thread = threading.Thread(target=self._write_loop, name="kvstore-remote-writer", daemon=True)
        self._thread.start()

    def offer(self, pages: Sequence[tuple[bytes, bytes]]) -> None:
        """Queue (namespace, key) pages now durable in cold for the remote store (any thread; never waits)."""
        if self._thread is None or not pages:
            return
        with self._lock:
            for ns, key in pages:
                self._queue[key] = ns
            while len(self._queue) > self.config.queue_pages:
                self._queue.popitem(last=False)
                self.skipped_pages += 1
            self._lock.notify()

    @property
    def queued_pages(self) -> int:
        return len(self._queue)

    def _take(self) -> list[tuple[bytes, bytes]]:
        """The oldest queued pages, up to a batch (under the lock); they stay queued until written."""
        limit = max(1, WRITE_BATCH_BYTES // (self.spec.page_bytes + 512))
        return [(ns, key) for key, ns in itertools.islice(self._queue.items(), limit)]

    def _write_loop(self) -> None:
        deadline = None
        while True:
            with self._lock:
                while not self._queue and not self._stopping:
                    self._lock.wait(1.0)
                if self._stopping:
                    deadline = deadline or time.monotonic() + DRAIN_S
                    if not self._queue or time.monotonic() > deadline:
                        return
                batch = self._take()
            if not self.available():
                time.sleep(min(0.05 if self._stopping else 0.5, max(0.0, self.retry_at - time.monotonic())))
                if self._stopping:
                    return
                continue
            try:
                self._write(batch)
            except RemoteDown:
                continue
            except Exception:  # noqa: BLE001 - a bug must not stop the writer; the batch is skipped
                log.exception("remote write batch failed")
            with self._lock:
                for _, key in batch:
                    self._queue.pop(key, None)

    def _write(self, batch: list[tuple[bytes, bytes]]) -> None:
        names = [self.key(ns, key) for ns, key in batch]
        held = self._call("exists_many", names)
        todo = [i for i, h in enumerate(held) if not h]
        self.present_pages += len(batch) - len(todo)
        records = self._source([batch[i][1] for i in todo]) if todo else []
        items = [(names[i], rec) for i, rec in zip(todo, records) if rec is not None]
        if items:
            self._call("put_many", items)
            self.write_batches += 1
        stored = [batch[i] for i, rec in zip(todo, records) if rec is not None]
        self.written_pages += len(stored)
        for (ns, key), (_, rec) in zip(stored, items):
            self._written[key] = (ns, len(rec))
            self.written_bytes += len(rec)
        for ns, keys in _by_namespace(stored).items():
            self._emit("add", ns, keys)
        self._trim()

    def _trim(self) -> None:
        """Delete the oldest records this instance wrote while they pass remote.max_bytes."""
        budget = self.config.max_bytes
        gone: list[tuple[bytes, bytes]] = []
        while budget and self.written_bytes > budget and self._written:
            key, (ns, size) = self._written.popitem(last=False)
            self.written_bytes -= size
            gone.append((ns, key))
        if gone:
            self._call("delete_many", [self.key(ns, key) for ns, key in gone])
            self.deleted_pages += len(gone)
            for ns, keys in _by_namespace(gone).items():
                self._emit("remove", ns, keys)

    def wait_written(self, timeout: float) -> bool:
        """Block until nothing waits to be written (tests, tools); False after `timeout`."""
        deadline = time.monotonic() + timeout
        while self._queue and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self._queue

    def close(self) -> None:
        """Write what is queued (for at most DRAIN_S while the remote answers), then disconnect."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
        while not self._readers.empty():
            for r in self._readers.get_nowait():
                r.shutdown(wait=True)
        if self.backend is not None:
            self.backend.close()

    # observability
    def stats(self) -> dict:
        return {"url": self.url, "state": self.state, "last_error": self.last_error,
                "write": self.config.write, "capacity_bytes": self.config.max_bytes,
                "used_bytes": self.written_bytes, "pages": len(self._written),
                "hits": self.hits, "misses": self.misses, "corrupt_pages": self.corrupt, "errors": self.errors,
                "read_bytes": self.read_bytes,
                "read_latency_ms": round(1000 * self.read_s / self.reads, 3) if self.reads else 0.0,
                "queued_pages": len(self._queue), "written_pages": self.written_pages,
                "write_batches": self.write_batches, "skipped_pages": self.skipped_pages,
                "already_present_pages": self.present_pages, "deleted_pages": self.deleted_pages}


def _by_namespace(pages: Sequence[tuple[bytes, bytes]]) -> dict[bytes, list[bytes]]:
    out: dict[bytes, list[bytes]] = {}
    for ns, key in pages:
        out.setdefault(ns, []).append(key)
    return out
