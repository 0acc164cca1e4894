"""A `kvstore sidecar` killed with its whole process group (SIGKILL: no cleanup, no resource tracker):
its shared-memory segment is named after the data directory and reclaimed by the next start; a
write_through put reaches the disk at once, not at the daemon's next round; the data directory
and the segment are private."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, clean_env
from kvstore.datadir import DataDir
from kvstore.pages.spec import KVSpec
from kvstore.sidecar.client import SidecarClient

SPEC = KVSpec(2, 2, 16, "float32", 16)   # 8 KiB pages, the tiny preset's geometry
MODEL = "crash-test"
BASE = {"model": "tiny", "kv_dtype": "float32", "hot.pool": 4 * SPEC.page_bytes, "warm.bytes": 16 * SPEC.page_bytes,
        "cold.max_bytes": "16MiB"}
SHM = Path("/dev/shm")

needs = (SHM.is_dir() and hasattr(os, "killpg"), "needs /dev/shm and killpg")   # conftest.requires_part
pytestmark = pytest.mark.usefixtures("requires_part")


def tokens_for(doc: int, pages: int) -> list[int]:
    return [(doc * 7919 + i * 31) % 500 for i in range(pages * SPEC.page_size)]


def pages_for(doc: int, pages: int) -> torch.Tensor:
    return torch.randn((pages, *SPEC.page_shape), generator=torch.Generator().manual_seed(doc))


class Sidecar:
    """A sidecar in a process group of its own; its log goes outside the data dir."""

    def __init__(self, data_dir: Path, log: Path, **overrides):
        self.data_dir, self.socket, self.log_path = data_dir, data_dir / "kvstore.sock", log
        args = [sys.executable, "-m", "kvstore", "sidecar", "--data-dir", str(data_dir), "--admin-port", "0"]
        for key, value in {**BASE, **overrides}.items():
            args += ["--set", f"{key}={value}"]
        with open(log, "a") as err:
            self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True, env=clean_env(),
                                         cwd=REPO, start_new_session=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout] + [lines.put(None)],
                         daemon=True).start()
        deadline = time.monotonic() + 60
        while True:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, f"sidecar exited with {self.proc.wait()}: {self.log()}"
            if line.startswith("kvstore sidecar: ready on "):
                return

    def log(self) -> str:
        return self.log_path.read_text()

    def client(self) -> SidecarClient:
        return SidecarClient(self.socket, SPEC, MODEL)

    def kill_group(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)   # the sidecar and its resource tracker together
        self.proc.wait(30)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


@pytest.fixture
def dirs(tmp_path):
    """(data dir, log file, sidecars started); whatever is left running is killed, the segment removed."""
    short = Path(tempfile.mkdtemp(prefix="kvs-"))   # the socket, DATA/kvstore.sock, must stay under 108 bytes
    started: list[Sidecar] = []
    data = short / "data"
    yield data, tmp_path / "sidecar.log", started
    for sc in started:
        if sc.proc.poll() is None:
            sc.kill_group()
    (SHM / DataDir(data).shm_name).unlink(missing_ok=True)
    shutil.rmtree(short, ignore_errors=True)


def test_a_segment_left_by_a_killed_group_is_reclaimed_at_restart(dirs):
    data, log, started = dirs
    old = os.umask(0o022)   # a permissive umask: the data directory is private anyway
    try:
        started.append(Sidecar(data, log))
    finally:
        os.umask(old)
    segment = SHM / DataDir(data).shm_name
    assert segment.exists() and stat.S_IMODE(segment.stat().st_mode) == 0o600
    modes = {str(p.relative_to(data)): stat.S_IMODE(p.lstat().st_mode) for p in data.rglob("*")}
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert {"kvstore.sock", "kvstore.lock", "cold", "cold/data.mdb"} <= set(modes)
    assert all(m == (0o700 if (data / p).is_dir() else 0o600) for p, m in modes.items()), modes
    with started[0].client() as kv:
        kv.put(tokens_for(1, 2), pages_for(1, 2))

    started[0].kill_group()
    stale = segment.stat().st_ino
    assert segment.exists()           # nobody was left to unlink it

    started.append(Sidecar(data, log))
    assert "removed the shared-memory segment" in started[1].log()
    assert segment.exists() and segment.stat().st_ino != stale   # a new segment under the same name
    with started[1].client() as kv:
        kv.put(tokens_for(2, 2), pages_for(2, 2))
        assert torch.equal(kv.get(tokens_for(2, 2)), pages_for(2, 2))
    assert started[1].stop() == 0
    assert not segment.exists() and "Traceback" not in started[1].log()


def test_a_write_through_put_is_on_disk_before_the_daemon_round(dirs):
    data, log, started = dirs
    slow = {"write_policy": "write_through", "daemon.interval_s": 600}
    started.append(Sidecar(data, log, **slow))
    with started[0].client() as kv:
        time.sleep(0.5)               # the daemon's first round is over; the next is 10 minutes away
        kv.put(tokens_for(3, 3), pages_for(3, 3))
        deadline = time.monotonic() + 5
        while kv.stats()["tiers"]["cold"]["pages"] < 3:
            assert time.monotonic() < deadline, "the put was not written to cold within 5 s"
            time.sleep(0.05)
    started[0].kill_group()          # durable once cold-resident: a kill loses none of it
    started.append(Sidecar(data, log, **slow))
    with started[1].client() as kv:
        assert torch.equal(kv.get(tokens_for(3, 3)), pages_for(3, 3))
    assert started[1].stop() == 0
