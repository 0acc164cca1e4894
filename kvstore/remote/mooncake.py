"""Mooncake Store backend of the remote tier (package mooncake-transfer-engine-non-cuda, optional):
mooncake://MASTER_HOST:PORT?metadata=URL[&segment=SIZE&buffer=SIZE&protocol=tcp|rdma&device=NAMES&local=HOST]

- metadata: `http://HOST:PORT/metadata` (the master's own with --enable_http_metadata_server) or
  P2PHANDSHAKE. segment: memory this process lends the store (default 0: the store holds what
  other clients lend; what is lent is touched as written and lost to the store at exit). buffer:
  the library's staging buffer (default 0: batches here use areas this backend registers).
  device: RDMA devices. local: where other clients reach us (default: our address toward the master).
- A read into the caller's memory (get_into, the tier's read path) lands in memory the tier lends
  (registered once). Where the tier leaves room before each target (warm's head_room, asked for
  by `lands_records`), it is one batch_get_into: each value lands whole, its head in that room,
  and the head is copied out; else one batch_get_into_multi_buffers: each value in two parts, its
  head in the calling thread's registered area. A value of another size fails its transfer or
  lands short; its size is then asked for, to tell a foreign or damaged value (WRONG_SIZE) from a
  failed transfer (RemoteDown). What landed is checked on the helper thread before its next read
  starts: in cache, and not beside a transfer, which it slowed on two cores (BENCHMARKS.md).
- A read of whole values (get_many) is one batch_get_into into the calling thread's registered area, a slot per key as large
  as the largest value seen (1 MiB at first; a larger value is measured and the batch read again);
  values are read-only views, valid until the thread's next get_many. A write copies into a
  registered area and is one batch_upsert_from (overwriting, as Redis does). Missing keys: None.
- The library waits up to 30 s for a hung master (~4 s for a gone one), so each call runs on a
  helper thread (one, kept: the library keeps state per thread; at the process's priority, as the
  next read starts only once it has seen the last one end) waited for at most timeout_s; then
  RemoteDown (StillLanding for a read: its targets stay the call's), while the call goes on in
  the background and calls fail at once until it ends. Calls are serialized; a read is queued in
  the caller's turn and waited for after it, so the next caller's is queued behind it. setup and
  close hold the GIL (setup: ~90 s with no master; close: ~1 s, ~9 s with it gone, ~90 s with it
  hung): the master and metadata server must accept a connection within timeout_s before setup,
  and close leaves open a store whose master does not answer.
- The master evicts (eviction_high_watermark_ratio, eviction_ratio) keys not read within
  default_kv_lease_ttl; a write the full store cannot place raises RemoteDown.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
import weakref
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Sequence
from urllib.parse import parse_qs, urlsplit

import numpy as np

from kvstore.config import parse_size, redact_secret
from kvstore.errors import ConfigError
from kvstore.remote.backend import (MISSING, REMOTE_BACKENDS, WRONG_SIZE, Check, RemoteBackend, RemoteDown,
                                    StillLanding, checked)

try:
    from mooncake.store import MooncakeDistributedStore
    _MISSING = ""
except ImportError as exc:
    MooncakeDistributedStore = None
    _MISSING = " ".join(str(exc).split())[:160]

_ALLOWED = ("mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata|P2PHANDSHAKE"
            "[&segment=SIZE&buffer=SIZE&protocol=tcp|rdma&device=NAMES&local=HOST]")
_OPTIONS = ("metadata", "segment", "buffer", "protocol", "device", "local")
_FIRST_SLOT = 1 << 20
_NOT_FOUND, _TOO_SMALL, _NO_ROOM, _TRANSFER_FAIL = -704, -600, -200, -800
log = logging.getLogger("kvstore.remote")
_LEFT_OPEN: list = []   # backends whose store was not closed: collecting it would close it, holding the GIL


def parse_url(url: str) -> dict:
    """The setup arguments a mooncake:// URL names; ConfigError naming remote.url when it is not one."""
    def bad(why: str):
        return ConfigError("remote.url", redact_secret(url), f"{why}; allowed: {_ALLOWED}")
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "mooncake" or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise bad("not mooncake://MASTER_HOST:PORT")
    query = parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(set(query) - set(_OPTIONS))
    if unknown or any(len(v) > 1 for v in query.values()):
        raise bad(f"unknown or repeated option {', '.join(unknown) or 'given twice'}")
    opts = {k: v[0] for k, v in query.items()}
    metadata = opts.get("metadata", "")
    if not (metadata.startswith(("http://", "https://")) or metadata == "P2PHANDSHAKE"):
        raise bad("metadata must be the metadata server's http:// URL or P2PHANDSHAKE")
    protocol = opts.get("protocol", "tcp")
    if protocol not in ("tcp", "rdma"):
        raise bad("protocol must be tcp or rdma")
    try:
        segment, buffer = parse_size(opts.get("segment", 0)), parse_size(opts.get("buffer", 0))
    except ValueError:
        raise bad("segment and buffer must be byte sizes such as 4GiB") from None
    return {"local": opts.get("local") or _route_to(parts.hostname, port), "metadata": metadata,
            "segment": segment, "buffer": buffer, "protocol": protocol,
            "device": opts.get("device", ""), "master": f"{parts.hostname}:{port}"}


def _route_to(host: str, port: int) -> str:
    """This host's address on the route to host (no packet is sent); 127.0.0.1 when there is none."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class _Registrations:
    """Unregisters an outgrown area once nothing reads it, never after close (a closed store crashes)."""

    def __init__(self, store):
        self.store, self.lock, self.open = store, threading.RLock(), True

    def forget(self, address: int) -> None:
        with self.lock:
            if self.open:
                self.store.unregister_buffer(address)


class _Call:
    def __init__(self, fn, args, worker: "_Worker"):
        self.fn, self.args, self.worker, self.done, self.outcome = fn, args, worker, threading.Event(), None
        self._lock, self._after = threading.Lock(), []

    def when_done(self, fn) -> None:
        """fn() once the call has ended (now, if it has), on the thread that ends it."""
        with self._lock:
            if not self.done.is_set():
                self._after.append(fn)
                return
        fn()

    def finish(self, outcome: tuple) -> None:
        with self._lock:
            self.outcome = outcome
            self.done.set()
            after, self._after = self._after, []
        for fn in after:
            try:
                fn()
            except Exception:  # noqa: BLE001 - the helper thread must go on
                log.exception("a callback after an abandoned Mooncake call failed")


class _Worker:
    """The daemon thread the library's calls run on, one after another. It is kept: the library
    keeps state per calling thread, and a fresh thread per call cost a fifth of a read's speed. A
    call that hangs keeps its thread; the backend then starts another for later calls.

    The library waits for a transfer by spinning on the calling thread (lock, status, unlock, clock),
    and the next read (queued behind it) starts only once that spin has seen this one end. So the
    thread keeps the process's priority: at nice 19 the spin starved on a machine whose cores were
    busy (inference beside it) and a fetch took 11-18x the client's time; idle, nice 19 was a few
    per cent faster (BENCHMARKS.md)."""

    def __init__(self):
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="kvstore-mooncake", daemon=True)
        self.thread.start()

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def submit(self, fn, args) -> _Call:
        call = _Call(fn, args, self)
        self.calls.put(call)
        return call

    def stop(self) -> None:
        self.calls.put(None)

    def _loop(self) -> None:
        while (call := self.calls.get()) is not None:
            try:
                outcome = (True, call.fn(*call.args))
            except Exception as exc:
                outcome = (False, exc)
            call.finish(outcome)


class _PerThread(threading.local):
    def __init__(self):
        self.area = SimpleNamespace()   # the thread's receive area: a value stays valid until its next read
        self.heads = SimpleNamespace()  # where get_into's heads land, before they are copied out


class MooncakeBackend(RemoteBackend):
    scheme = "mooncake"

    def __init__(self, url: str, timeout_s: float):
        super().__init__(url, timeout_s)
        cfg = parse_url(url)
        if MooncakeDistributedStore is None:
            raise ConfigError("remote.url", self.describe(), "mooncake:// needs the package mooncake-transfer-engine-"
                              "non-cuda (pip install mooncake-transfer-engine-non-cuda) and libibverbs1 (apt-get "
                              f"install libibverbs1): {_MISSING}")
        self.master, self.store = cfg["master"], MooncakeDistributedStore()
        self._lock, self._stuck, self._slot = threading.Lock(), None, _FIRST_SLOT
        self._worker: _Worker | None = None
        self._local, self._send, self._registrations = _PerThread(), SimpleNamespace(), _Registrations(self.store)
        self._lent: tuple[np.ndarray, int] | None = None   # the memory targets lie in, and the room before each
        host, _, port = self.master.rpartition(":")
        self._reachable(host, int(port), "master")
        if cfg["metadata"] != "P2PHANDSHAKE":
            meta = urlsplit(cfg["metadata"])
            self._reachable(meta.hostname, meta.port or (443 if meta.scheme == "https" else 80), "metadata server")
        rc = self.store.setup(cfg["local"], cfg["metadata"], cfg["segment"], cfg["buffer"], cfg["protocol"],
                              cfg["device"], cfg["master"])
        if rc != 0:
            raise RemoteDown(f"cannot join the Mooncake store at {self.describe()} (setup returned {rc}): "
                             "is the master running and the metadata server reachable?")

    def _reachable(self, host: str, port: int, what: str) -> None:
        try:
            socket.create_connection((host, port), timeout=self.timeout_s).close()
        except OSError as exc:
            raise RemoteDown(f"the Mooncake {what} at {host}:{port} cannot be reached: {type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:120]}") from None

    def _down(self, what: str) -> RemoteDown:
        return RemoteDown(f"the Mooncake store at {self.describe()} {what}")

    def _submit(self, fn, *args) -> _Call:
        """fn(*args) queued on the helper thread (in the caller's turn)."""
        if self._worker is None or not self._worker.is_alive():
            self._worker = _Worker()
        return self._worker.submit(fn, args)

    def _run(self, what: str, deadline: float, fn, *args):
        """fn(*args) on the helper thread, waited for until deadline; RemoteDown when it is late or raises."""
        return self._wait(self._submit(fn, *args), what, deadline)

    def _wait(self, call: _Call, what: str, deadline: float):
        if not call.done.wait(max(0.0, deadline - time.monotonic())):
            self._stuck = (call, what)
            if self._worker is call.worker:
                self._worker = None   # the next call gets a new thread
            raise self._down(f"did not answer {what} in time (master {self.master} down or hung?)")
        ok, value = call.outcome
        if not ok:
            raise self._down(f"failed {what}: {type(value).__name__}: {' '.join(str(value).split())[:200]}")
        return value

    @contextmanager
    def _turn(self):
        """The deadline of one serialized call; RemoteDown while an abandoned call still runs."""
        deadline = time.monotonic() + self.timeout_s
        if not self._lock.acquire(timeout=self.timeout_s):
            raise self._down(f"is busy: no turn within {self.timeout_s:g} s")
        try:
            if self._stuck and not self._stuck[0].done.is_set():
                raise self._down(f"has not answered an earlier {self._stuck[1]} yet (master {self.master} down or hung?)")
            yield deadline
        finally:
            self._lock.release()

    def _errors(self, what: str, codes: list, fine: tuple = ()) -> list:
        """The error codes among codes, but fine ones; RemoteDown when the master was not reached."""
        bad = [c for c in codes if c < 0 and c not in fine]
        if any(-999 <= c <= -900 for c in bad):
            raise RemoteDown(f"the Mooncake master at {self.master} cannot be reached ({what}: error {min(bad)})")
        return bad

    def _fit(self, place, nbytes: int, deadline: float) -> int:
        """The address of place.array, grown to hold nbytes and registered. A try given up on still
        records its outcome; a failed one is undone before the next (the store refuses overlaps)."""
        old = getattr(place, "array", None)
        if old is None or old.nbytes < nbytes:
            place.array = np.empty(max(nbytes, 2 * (0 if old is None else old.nbytes)), np.uint8)
            place.registered = place.tried = False
            weakref.finalize(place.array, self._registrations.forget, place.array.ctypes.data).atexit = False
        if not place.registered:
            array, retry = place.array, place.tried

            def register():
                if retry:
                    self.store.unregister_buffer(array.ctypes.data)
                place.registered = self.store.register_buffer(array.ctypes.data, array.nbytes) == 0
            place.tried = True
            self._run("register", deadline, register)
            if not place.registered:
                raise self._down(f"did not register a buffer of {array.nbytes} bytes")
        return place.array.ctypes.data

    def _read(self, keys: list, deadline: float) -> list:
        slot = self._slot
        base = self._fit(self._local.area, slot * len(keys), deadline)
        return self._run("get", deadline, self.store.batch_get_into, keys,
                         [base + i * slot for i in range(len(keys))], [slot] * len(keys))

    def get_many(self, keys: Sequence[str]) -> list:
        keys = list(keys)
        if not keys:
            return []
        with self._turn() as deadline:
            codes = self._read(keys, deadline)
            if _TOO_SMALL in codes:
                large = [k for k, c in zip(keys, codes) if c == _TOO_SMALL]
                sizes = self._run("get_size", deadline, lambda: [self.store.get_size(k) for k in large])
                self._slot = max(self._slot, *sizes)
                codes = self._read(keys, deadline)
            view, slot = memoryview(self._local.area.array).toreadonly(), self._slot
        failed = self._errors("get", codes, (_NOT_FOUND,))
        if len(failed) == len(keys):
            raise self._down(f"answered no key (error {failed[0]})")
        return [view[i * slot:i * slot + c] if c > 0 else None for i, c in enumerate(codes)]

    def lend(self, area: np.ndarray, room: int = 0) -> None:
        with self._turn() as deadline:
            rc = self._run("register", deadline, self.store.register_buffer, area.ctypes.data, area.nbytes)
        if rc != 0:
            raise self._down(f"did not register {area.nbytes} bytes of warm memory (error {rc})")
        self._lent = (area, room)

    def _whole(self, sizes: list[int], targets: Sequence[np.ndarray]) -> list[int] | None:
        """Where in the lent area each value lands whole (its head in the room before its target), or
        None when a head does not fit its room or a target lies elsewhere (then values land in two parts)."""
        if self._lent is None:
            return None
        area, room = self._lent
        base, end = area.ctypes.data, area.ctypes.data + area.nbytes
        starts = [t.ctypes.data - n for n, t in zip(sizes, targets)]
        if all(n <= room and base <= a and a + n + t.nbytes <= end for a, n, t in zip(starts, sizes, targets)):
            return [a - base for a in starts]
        return None

    def get_into(self, keys: Sequence[str], heads: Sequence[np.ndarray], targets: Sequence[np.ndarray],
                 check: Check | None = None) -> list[int]:
        """Values land whole (one transfer slice each: measured 1.3x the speed of two) where the lent
        area has room before every target for its head; else in two parts, the heads in this thread's area."""
        keys = list(keys)
        if not keys:
            return []
        sizes = [len(h) for h in heads]
        whole = self._whole(sizes, targets)
        offsets = whole or np.cumsum([0, *sizes[:-1]]).tolist()
        expect = [n + t.nbytes for n, t in zip(sizes, targets)]
        with self._turn() as deadline:   # the read is queued in the turn and waited for after it: the
            if whole is not None:        # next caller's read is then queued behind it, with no gap
                area = self._lent[0]
                read = (self.store.batch_get_into, keys, [area.ctypes.data + o for o in whole], expect)
            else:
                base = self._fit(self._local.heads, sum(sizes), deadline)
                area = self._local.heads.array
                read = (self.store.batch_get_into_multi_buffers, keys,
                        [[base + o, t.ctypes.data] for o, t in zip(offsets, targets)],
                        [[n, t.nbytes] for n, t in zip(sizes, targets)])
            call = self._submit(_read_checked, read, expect, list(zip(sizes, offsets)), heads, area, check)
        try:
            codes, verdicts = self._wait(call, "get", deadline)
        except RemoteDown as exc:
            if not call.done.is_set():
                raise StillLanding(str(exc), call.when_done) from None
            raise
        odd = [i for i, c in enumerate(codes) if c < 0 and c != _NOT_FOUND]
        held = []
        if odd:
            with self._turn() as deadline:
                held = self._run("get_size", deadline, lambda: [self.store.get_size(keys[i]) for i in odd])
        self._errors("get", codes, (_NOT_FOUND, _TOO_SMALL, _TRANSFER_FAIL))
        out, held = [], dict(zip(odd, held))
        for i, code in enumerate(codes):
            if code == expect[i]:
                out.append(verdicts[i])
            elif code == _NOT_FOUND or held.get(i, 0) < 0:
                out.append(MISSING)
            elif held.get(i) != expect[i]:
                out.append(WRONG_SIZE)
            else:
                raise self._down(f"failed to transfer a value (error {code})")
        return out

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        items = list(items)
        if not items:
            return
        sizes = [memoryview(v).nbytes for _, v in items]
        if 0 in sizes:
            raise ValueError("the Mooncake store cannot hold an empty value")
        offsets = np.cumsum([0, *sizes[:-1]]).tolist()
        with self._turn() as deadline:
            base = self._fit(self._send, sum(sizes), deadline)
            for off, n, (_, value) in zip(offsets, sizes, items):
                self._send.array[off:off + n] = np.frombuffer(value, np.uint8)
            codes = self._run("put", deadline, self.store.batch_upsert_from, [k for k, _ in items],
                              [base + off for off in offsets], sizes)
            self._slot = max(self._slot, *sizes)
        failed = self._errors("put", codes)
        if _NO_ROOM in failed:
            raise self._down(f"is full: {len(failed)} of {len(items)} values not stored (eviction frees room; "
                             "does any client lend memory, segment=SIZE?)")
        if failed:
            raise self._down(f"did not store {len(failed)} of {len(items)} values (error {failed[0]})")

    def _codes(self, what: str, fn, keys: list, *args) -> list:
        if not keys:
            return []
        with self._turn() as deadline:
            return self._run(what, deadline, fn, keys, *args)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        codes = self._codes("exists", self.store.batch_is_exist, list(keys))
        if self._errors("exists", codes):
            raise self._down(f"failed exists (error {min(codes)})")
        return [c == 1 for c in codes]

    def delete_many(self, keys: Sequence[str]) -> None:
        codes = self._codes("delete", self.store.batch_remove, list(keys), True)
        failed = self._errors("delete", codes, (_NOT_FOUND,))
        if failed:
            raise self._down(f"did not delete {len(failed)} keys (error {failed[0]})")

    def close(self) -> None:
        """Leave the store if its master answers now (it takes about 1 s); else leave it open."""
        try:
            self.ping()
        except RemoteDown:
            _LEFT_OPEN.append(self)
            return
        with self._lock, self._registrations.lock:
            self._registrations.open = False
            self.store.close()
            if self._worker is not None:
                self._worker.stop()


def _read_checked(read: tuple, expect: list[int], heads_at: list[tuple[int, int]], heads: Sequence[np.ndarray],
                  area: np.ndarray, check: Check | None) -> tuple[list[int], list[int | None]]:
    """The library's batch read read[0](*read[1:]); then each value that landed whole has its head copied
    out of area (heads_at: length, offset) and is checked: (codes, LANDED/FAILED_CHECK or None each)."""
    codes = read[0](*read[1:])
    verdicts: list[int | None] = [None] * len(codes)
    for i, (code, (n, off)) in enumerate(zip(codes, heads_at)):
        if code == expect[i]:
            heads[i][:] = area[off:off + n]
            verdicts[i] = checked(check, i)
    return codes, verdicts


@REMOTE_BACKENDS.register("mooncake")
def build(url: str, timeout_s: float, password: str = "") -> RemoteBackend:
    """password: Mooncake has none; taken for the factory signature the remote tier calls."""
    return MooncakeBackend(url, timeout_s)


build.lands_records = True   # warm leaves room for a record's head before each page: one slice per value
