"""The sidecar data plane against a real `kvstore sidecar` process (tiny geometry, temp dirs): page
bytes through shared memory and through the socket fallback, between separate client processes;
leases of killed and hung clients; protocol errors; tenants (SIGTERM under load: test_sidecar_retention.py)."""

from __future__ import annotations

import asyncio
import inspect
import os
import queue
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import astuple
from pathlib import Path

import msgpack
import pytest
import torch

from conftest import REPO, clean_env
from kvstore.pages.spec import KVSpec
from kvstore.sidecar.client import AsyncSidecarClient, SidecarClient, SidecarError, SidecarUnavailable

SPEC = KVSpec(2, 2, 16, "float32", 16)   # 8 KiB pages
PS = SPEC.page_size
MODEL = "tiny-test"


def tokens_for(doc: int, pages: int) -> list[int]:
    return [(doc * 7919 + i * 31) % 500 for i in range(pages * PS)]


def pages_for(doc: int, pages: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(doc)
    return torch.randn((pages, *SPEC.page_shape), generator=g)


# What the client processes this module starts share with it.
COMMON = "\n".join(["import sys", "import torch", "from kvstore.sidecar.client import SidecarClient",
                    "from kvstore.pages.spec import KVSpec", f"SPEC = KVSpec{astuple(SPEC)!r}", "PS = SPEC.page_size",
                    f"MODEL = {MODEL!r}", inspect.getsource(tokens_for), inspect.getsource(pages_for)])

WARM_PAGES = 16
BASE = {"model": "tiny", "kv_dtype": "float32", "hot.pool": 4 * SPEC.page_bytes,
        "warm.bytes": WARM_PAGES * SPEC.page_bytes, "cold.max_bytes": "32MiB", "sidecar.lease_s": 60}
HEADER = struct.Struct(">I")


class SidecarProcess:
    """`python -m kvstore sidecar` on a data dir, ready once it prints its ready line."""

    def __init__(self, data_dir: Path, sock_dir: Path, command: tuple[str, ...] = ("-m", "kvstore"),
                 env: dict | None = None, **overrides):
        """`command`: what runs after the interpreter (a launcher that registers a test backend);
        `env`: extra environment variables."""
        self.data_dir, self.socket = data_dir, sock_dir / "kv.sock"
        self.log_path = data_dir / "sidecar.log"
        args = [sys.executable, *command, "sidecar", "--data-dir", str(data_dir),
                "--socket", str(self.socket), "--admin-port", "0"]
        for key, value in {**BASE, **overrides}.items():
            args += ["--set", f"{key}={value}"]
        data_dir.mkdir(parents=True, exist_ok=True)
        self.stderr = open(self.log_path, "a")
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                     env=clean_env(**(env or {})), cwd=REPO)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        deadline = time.monotonic() + 60
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                raise AssertionError(f"sidecar not ready within 60 s; log:\n{self.log()}") from None
            if line is None:
                raise AssertionError(f"sidecar exited with {self.proc.wait()}; log:\n{self.log()}")
            if line.startswith("kvstore sidecar: ready on "):
                assert line.strip().endswith(str(self.socket))
                break

    def _read_stdout(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def log(self) -> str:
        self.stderr.flush()
        return self.log_path.read_text()

    def client(self, **kw) -> SidecarClient:
        return SidecarClient(self.socket, SPEC, MODEL, **kw)

    def stop(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.stderr.close()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


@pytest.fixture
def sock_dir():
    """A short directory for sockets (a Unix socket path must stay under 108 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="kvs-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def spawn(tmp_path, sock_dir):
    """Start sidecars on one data dir and socket; whatever a test leaves running is killed."""
    started = []

    def start(**overrides) -> SidecarProcess:
        started.append(SidecarProcess(tmp_path / "data", sock_dir, **overrides))
        return started[-1]
    yield start
    for sc in started:
        sc.kill()


@pytest.fixture
def sidecar(spawn):
    sc = spawn()
    yield sc
    if sc.proc.poll() is None:
        assert sc.stop() == 0
    log = sc.log_path.read_text()
    assert "Traceback" not in log, log


def run_client(script: str, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a client script in a separate process; fails the test if it fails."""
    done = subprocess.run([sys.executable, "-c", COMMON + script, *map(str, args)], capture_output=True,
                          text=True, env=clean_env(), cwd=REPO, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return done


PUT = """
path, mode, doc, pages = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with SidecarClient(path, SPEC, MODEL, use_shm=(mode == "shm")) as kv:
    keys = kv.put(tokens_for(doc, pages), pages_for(doc, pages))
    assert len(keys) == pages
print("put", len(keys))
"""

GET = """
path, mode, doc, pages, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
with SidecarClient(path, SPEC, MODEL, use_shm=(mode == "shm")) as kv:
    got = kv.get(tokens_for(doc, pages))
torch.save(got, out)
print("got", len(got))
"""


# data plane
def test_pages_move_between_processes_byte_exactly(sidecar, tmp_path):
    for doc, put_mode, get_mode in ((1, "shm", "shm"), (2, "bytes", "bytes"), (3, "shm", "bytes"), (4, "bytes", "shm")):
        run_client(PUT, sidecar.socket, put_mode, doc, 5)
        out = tmp_path / f"doc{doc}.pt"
        run_client(GET, sidecar.socket, get_mode, doc, 5, out)
        got = torch.load(out)
        assert got.shape == (5, *SPEC.page_shape) and got.dtype == torch.float32
        assert torch.equal(got, pages_for(doc, 5)), (put_mode, get_mode)
    with sidecar.client() as kv:
        st = kv.stats()
    assert st["sidecar"]["leased_slots"] == 0 and st["tiers"]["warm"]["allocated_pages"] == 0


def test_lookup_put_suffix_and_zero_copy_leases(sidecar):
    tokens = tokens_for(10, 6) + [1, 2, 3]   # 6 full pages and a partial one
    pages = pages_for(10, 6)
    with sidecar.client() as kv:
        assert kv.lookup(tokens).pages == 0
        assert len(kv.get(tokens)) == 0
        kv.put(tokens, pages[:2])
        with pytest.raises(SidecarError, match="parent of page 4"):
            kv.put(tokens, pages[4:], start_page=4)  # page 3 is not cached
        keys = kv.put(tokens, pages[2:], start_page=2)
        hit = kv.lookup(tokens)
        assert hit.pages == 6 and hit.tokens == 6 * PS and hit.tiers == ["warm"] * 6 and hit.keys[2:] == keys
        lease = kv.get_slots(tokens, max_pages=4)
        assert lease.keys == hit.keys[:4] and len(lease.slots) == 4
        assert all(torch.equal(kv.view(s), pages[i]) for i, s in enumerate(lease.slots))
        assert kv.stats()["sidecar"]["this_client"]["leased_slots"] == 4
        by_key = kv.get_slots(keys=hit.keys[4:])
        assert torch.equal(kv.view(by_key.slots[1]), pages[5])
        kv.release(lease.slots + by_key.slots)
        with pytest.raises(SidecarError, match="not held by this client"):
            kv.release(lease.slots[:1])
        assert kv.stats()["sidecar"]["leased_slots"] == 0
        assert torch.equal(kv.get(tokens, max_pages=3), pages[:3])


async def test_async_client(sidecar):
    async with AsyncSidecarClient(sidecar.socket, SPEC, MODEL) as kv:
        docs = range(20, 24)
        await asyncio.gather(*(kv.put(tokens_for(d, 3), pages_for(d, 3)) for d in docs))
        got = await asyncio.gather(*(kv.get(tokens_for(d, 3)) for d in docs))
        assert all(torch.equal(g, pages_for(d, 3)) for g, d in zip(got, docs))
        assert (await kv.lookup(tokens_for(20, 3))).pages == 3
    async with AsyncSidecarClient(sidecar.socket, SPEC, MODEL, use_shm=False) as kv:
        assert torch.equal(await kv.get(tokens_for(21, 3)), pages_for(21, 3))


def test_tenants_and_layouts_do_not_see_each_other(sidecar):
    tokens, pages = tokens_for(30, 3), pages_for(30, 3)
    with sidecar.client(tenant="a") as a, sidecar.client(tenant="b") as b, sidecar.client(tenant="a", salt="s") as c, \
            sidecar.client(tenant="a", layout="other-engine-blocks-v1") as d:
        keys = a.put(tokens, pages)
        assert a.lookup(tokens).pages == 3
        for other in (b, c, d):
            assert other.lookup(tokens).pages == 0
            assert len(other.get(tokens)) == 0
            assert other.get_slots(keys=keys).slots == []   # a known key of another tenant is not served
        b.put(tokens, pages_for(31, 3))                    # the same tokens, b's own pages
        assert torch.equal(a.get(tokens), pages) and torch.equal(b.get(tokens), pages_for(31, 3))


# leases
HOLD = """
path = sys.argv[1]
kv = SidecarClient(path, SPEC, MODEL)
kv.put(tokens_for(40, 4), pages_for(40, 4))
lease = kv.get_slots(tokens_for(40, 4))
extra = kv.alloc(3)
print("holding", len(lease.slots), len(extra), flush=True)
import time
time.sleep(600)
"""


def _stats_until(kv, check, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        st = kv.stats()
        if check(st) or time.monotonic() > deadline:
            return st
        time.sleep(0.1)


def test_killed_client_keeps_its_pages_and_loses_its_leases(sidecar):
    holder = subprocess.Popen([sys.executable, "-c", COMMON + HOLD, str(sidecar.socket)], stdout=subprocess.PIPE,
                              text=True, env=clean_env(), cwd=REPO)
    try:
        assert holder.stdout.readline().split() == ["holding", "4", "3"]
        with sidecar.client() as kv:
            st = kv.stats()
            assert st["sidecar"]["leased_slots"] == 4 and st["sidecar"]["allocated_slots"] == 3
            assert st["tiers"]["warm"]["leased_pages"] == 4
            holder.kill()   # long before sidecar.lease_s (60 s) could end its leases
            holder.wait()
            st = _stats_until(kv, lambda s: s["tiers"]["warm"]["leased_pages"] == 0
                              and s["tiers"]["warm"]["allocated_pages"] == 0)
            assert st["tiers"]["warm"]["leased_pages"] == 0 and st["tiers"]["warm"]["allocated_pages"] == 0
            assert st["sidecar"]["clients"] == 1 and st["sidecar"]["leased_slots"] == 0
            assert torch.equal(kv.get(tokens_for(40, 4)), pages_for(40, 4))
            # no slot is held any more: the whole warm tier can be taken (its pages go to cold)
            everything = kv.alloc(WARM_PAGES)
            assert sorted(everything) == list(range(WARM_PAGES))
            kv.release(everything)
            assert torch.equal(kv.get(tokens_for(40, 4)), pages_for(40, 4))   # back from cold
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_hung_client_leases_expire(spawn):
    sidecar = spawn(**{"sidecar.lease_s": 2})
    with sidecar.client() as hung, sidecar.client() as watcher:
        hung.put(tokens_for(50, 3), pages_for(50, 3))
        lease = hung.get_slots(tokens_for(50, 3))
        spare = hung.alloc(2)
        assert watcher.stats()["sidecar"]["leased_slots"] == 3
        time.sleep(1.0)
        hung.ping()   # any request renews the lease
        time.sleep(1.5)
        assert watcher.stats()["sidecar"]["leased_slots"] == 3   # 2.5 s held, never 2 s quiet
        st = _stats_until(watcher, lambda s: s["sidecar"]["leased_slots"] == 0, timeout=5)
        assert st["sidecar"]["leased_slots"] == 0 and st["sidecar"]["allocated_slots"] == 0
        with pytest.raises(SidecarError, match="not held by this client"):
            hung.release(lease.slots)
        with pytest.raises(SidecarError, match="not this client's"):
            hung.put_slots(tokens_for(51, 2), spare)
        assert torch.equal(hung.get(tokens_for(50, 3)), pages_for(50, 3))   # committed pages stay
    assert sidecar.stop() == 0
    assert "leases expired" in sidecar.log_path.read_text()


# protocol errors
def raw_connect(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(path))
    return s


def send(s: socket.socket, message) -> None:
    body = message if isinstance(message, bytes) else msgpack.packb(message, use_bin_type=True)
    s.sendall(HEADER.pack(len(body)) + body)


def recv(s: socket.socket) -> dict | None:
    """The next reply, or None when the sidecar closed the connection."""
    data = b""
    while len(data) < HEADER.size:
        chunk = s.recv(HEADER.size - len(data))
        if not chunk:
            return None
        data += chunk
    (n,) = HEADER.unpack(data)
    body = b""
    while len(body) < n:
        chunk = s.recv(n - len(body))
        assert chunk, "connection closed inside a frame"
        body += chunk
    return msgpack.unpackb(body, raw=False)


HELLO = {"op": "hello", "id": 1, "model": MODEL,
         "spec": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32", "page_size": 16}}


def test_hello_checks_the_spec_and_comes_first(sidecar):
    with pytest.raises(SidecarError, match=r"spec differs.*num_layers 3 \(sidecar: 2\).*dtype 'bfloat16'"):
        SidecarClient(sidecar.socket, SPEC.replace(num_layers=3, dtype="bf16"), MODEL)
    with pytest.raises(SidecarError, match="page_size"):
        SidecarClient(sidecar.socket, SPEC.replace(page_size=32), MODEL)
    s = raw_connect(sidecar.socket)
    try:
        for op in ("lookup", "put", "get", "stats", "ping", "alloc", "release"):
            send(s, {"op": op, "id": 7})
            reply = recv(s)
            assert reply == {"id": 7, "ok": False, "error": f"{op}: say hello first (spec and namespace)"}
        send(s, {**HELLO, "spec": {**HELLO["spec"], "head_dim": 64}})
        assert "head_dim 64 (sidecar: 16)" in recv(s)["error"]
        send(s, HELLO)
        reply = recv(s)
        assert reply["ok"] and reply["page_bytes"] == SPEC.page_bytes and reply["slots"] == WARM_PAGES
        assert reply["lease_s"] == 60 and isinstance(reply["shm"], str)
        send(s, {"op": "lookup", "id": 8, "tokens": tokens_for(1, 1)})
        assert recv(s)["ok"]
    finally:
        s.close()


MALFORMED = {
    "oversized": HEADER.pack(1 << 30),
    "empty frame": HEADER.pack(0),
    "not msgpack": HEADER.pack(3) + b"\xc1\xc1\xc1",
    "trailing bytes": HEADER.pack(2) + b"\x90\x90",
    "not a map": None,
    "no op": None,
    "unknown op": None,
    "tokens not ints": None,
    "slots not a list": None,
    "page not bytes": None,
    "wait not a number": None,
    "wait negative": None,
}
MALFORMED_MESSAGES = {
    "not a map": [1, 2, 3],
    "no op": {"id": 3},
    "unknown op": {"op": "format_disk", "id": 3},
    "tokens not ints": {"op": "lookup", "id": 3, "tokens": ["a", "b"]},
    "slots not a list": {"op": "put", "id": 3, "tokens": [1] * 16, "slots": 5},
    "page not bytes": {"op": "put", "id": 3, "tokens": [1] * 16, "pages": ["text"]},
    "wait not a number": {"op": "alloc", "id": 3, "n": 1, "wait_s": "1"},
    "wait negative": {"op": "alloc", "id": 3, "n": 1, "wait_s": -1.0},
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_frame_gets_an_error_and_a_clean_close(sidecar, case):
    with sidecar.client() as bystander:
        bystander.put(tokens_for(60, 2), pages_for(60, 2))
        s = raw_connect(sidecar.socket)
        try:
            if case in MALFORMED_MESSAGES:
                send(s, HELLO)
                assert recv(s)["ok"]
                send(s, MALFORMED_MESSAGES[case])
            else:
                s.sendall(MALFORMED[case])
            reply = recv(s)
            assert reply is not None and reply["ok"] is False and reply["error"] and "\n" not in reply["error"]
            assert recv(s) is None, "the connection stays open after a malformed frame"
        finally:
            s.close()
        assert torch.equal(bystander.get(tokens_for(60, 2)), pages_for(60, 2))   # others are served on
        assert bystander.stats()["sidecar"]["clients"] == 1
    assert "malformed frame" in sidecar.log() and "Traceback" not in sidecar.log()


def test_frame_over_max_frame_bytes_and_bytes_fallback_chunks(spawn):
    """A small sidecar.max_frame_bytes: the bytes fallback splits its frames to fit; a bigger frame is refused."""
    sc = spawn(**{"sidecar.max_frame_bytes": 3 * SPEC.page_bytes})
    with sc.client(use_shm=False) as kv:
        assert kv.info["frame_pages"] == 2
        kv.put(tokens_for(70, 7), pages_for(70, 7))     # 4 frames of at most 2 pages
        assert torch.equal(kv.get(tokens_for(70, 7)), pages_for(70, 7))
        with pytest.raises(SidecarError, match="over sidecar.max_frame_bytes"):
            kv._call({"op": "put", "tokens": tokens_for(71, 4), "pages": [b"\0" * SPEC.page_bytes] * 4})
        with pytest.raises(SidecarUnavailable, match="closed the connection"):
            kv.ping()
    assert sc.stop() == 0


# lifecycle
def test_not_running_sidecar_is_a_clear_error(sock_dir):
    with pytest.raises(SidecarUnavailable, match=f"cannot connect to kvstore sidecar at {sock_dir}/none.sock: "):
        SidecarClient(sock_dir / "none.sock", SPEC, MODEL)


def test_socket_file_stale_live_and_private(spawn, tmp_path, sock_dir):
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock_dir / "kv.sock"))   # bound, never listening: what a crashed sidecar leaves
    stale.close()
    sc = spawn()
    assert stat.S_IMODE(os.stat(sc.socket).st_mode) == 0o600
    second = subprocess.run([sys.executable, "-m", "kvstore", "sidecar", "--data-dir", str(tmp_path / "other"),
                             "--socket", str(sc.socket), "--admin-port", "0"],
                            capture_output=True, text=True, env=clean_env(), cwd=REPO, timeout=60)
    assert second.returncode == 2
    assert second.stderr.strip() == (f"kvstore: error: another process is serving {sc.socket} "
                                     "(a kvstore sidecar already running?)")
    assert sc.stop() == 0
    assert not sc.socket.exists()
    assert "removed a stale socket file" in sc.log_path.read_text()
