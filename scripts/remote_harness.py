"""What the remote-tier benchmarks (scripts/bench_remote.py, scripts/bench_remote_ttft.py) share:
the repository's virtual environment, their error and progress output, and the servers they start
on free loopback ports and stop at the end: redis-server processes and a mooncake_master
(tests/redisutil.py, tests/mooncakeutil.py) and `kvstore serve` instances. Standard library only:
a script imports it before anything the environment provides.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
READY = re.compile(r"kvstore serve: \S+ ready on (http://[\d.:]+) .*admin API on (http://[\d.:]+)\n")
READY_TIMEOUT_S = 300
SERVED_NAME = "bench"


def enter_venv(script: str) -> None:
    """Run `script` again with the repository's .venv python, where there is one and this is not it;
    then the repository and tests/ (redisutil, mooncakeutil: servers on free ports, no pytest) are
    importable."""
    if (VENV / "bin" / "python").exists() and Path(sys.prefix).resolve() != VENV.resolve():
        os.execv(str(VENV / "bin" / "python"), [str(VENV / "bin" / "python"), script, *sys.argv[1:]])
    sys.path.insert(0, str(ROOT))
    sys.path.insert(1, str(ROOT / "tests"))


class BenchError(Exception):
    """The benchmark cannot go on: printed on stderr, exit 1."""


class Stopped(BaseException):
    """SIGTERM or SIGHUP: unwinds like KeyboardInterrupt, so every child process is stopped."""


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def missing_executable(*names: str) -> str | None:
    """What to say of the first of `names` not installed (None: all are)."""
    for exe in names:
        if shutil.which(exe) is None:
            return f"{exe} is not installed (scripts/bootstrap installs it)"
    return None


# redis-server and mooncake_master
def start_servers(kind: str, tmp: Path) -> list:
    """One redis-server (`single`), a 3-master Redis Cluster (`cluster`) or a mooncake_master with its
    HTTP metadata server (`mooncake`), in tmp."""
    from redisutil import RedisServer, make_cluster   # tests/: importable once enter_venv has run
    if kind == "single":
        return [RedisServer(tmp / "redis")]
    if kind == "cluster":
        return make_cluster(tmp / "cluster", 3)
    import mooncakeutil
    return [mooncakeutil.MooncakeMaster(tmp / "mooncake")]


def server_url(kind: str, servers: list, segment: int | None = 0) -> str:
    """The remote.url of the servers (Mooncake: a client lending `segment` bytes)."""
    if kind == "single":
        return servers[0].url
    if kind == "cluster":
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in servers)
    return servers[0].url_with(str(segment))


# `kvstore serve` instances
def stop_on_signals() -> None:
    """SIGTERM and SIGHUP raise Stopped from here on."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)


def _on_signal(signum, frame) -> None:
    raise Stopped(signal.Signals(signum).name)


def _die_with_parent() -> None:
    """In the child (Linux): SIGTERM when this script dies, even by SIGKILL."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except Exception:
        pass


class BusyCores:
    """`n` processes that each keep a core busy (a Python loop at the process's priority): a
    machine whose cores an engine's inference holds. A context manager; stopped on exit."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self) -> "BusyCores":
        for _ in range(self.n):
            self.procs.append(subprocess.Popen(
                [sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None))
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        self.procs = []


# HTTP (the standard library: no threads, nothing else on the timed path)
def _request(url: str, method: str = "GET", body: dict | None = None,
             timeout: float = 30) -> tuple[dict, float]:
    """(JSON answer, seconds from sending the request to having read the whole answer)."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.connect()                                # not timed
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        t0 = time.perf_counter()
        conn.request(method, u.path, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
        elapsed = time.perf_counter() - t0
    finally:
        conn.close()
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = {"raw": raw[:300].decode(errors="replace")}
    if resp.status != 200:
        raise BenchError(f"{method} {url}: {resp.status} {str(answer)[:300]}")
    return answer, elapsed


def get(url: str) -> dict:
    return _request(url)[0]


def post(url: str, body: dict, timeout: float = 30) -> tuple[dict, float]:
    return _request(url, "POST", body, timeout)


# instances
def terminate(proc: subprocess.Popen, grace_s: float, name: str) -> None:
    """SIGTERM a child process and wait for it; SIGKILL it, with a log line, after grace_s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            log(f"{name} ignored SIGTERM for {grace_s:g} s: killed")
            proc.kill()
            proc.wait()


class Instance:
    def __init__(self, name: str, model: str, data: Path, args: list[str], threads: int):
        self.name, self.data = name, data
        data.mkdir(parents=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        self.out, self.log = data.parent / f"{name}.out", data.parent / f"{name}.log"
        with open(self.out, "wb") as stdout, open(self.log, "wb") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "app", "serve", "--model", model, "--port", "0", "--admin-port", "0",
                 "--served-model-name", SERVED_NAME, "--data-dir", str(data), *args],
                stdout=stdout, stderr=stderr, env=env, cwd=data.parent,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        self.api = self.admin = ""
        self.returncode: int | None = None

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            m = READY.search(self.out.read_text(errors="replace"))
            if m:
                self.api, self.admin = m.group(1), m.group(2)
                return
            time.sleep(0.1)
        raise BenchError(f"instance {self.name} did not start:\n{self.tail()}")

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def stop(self) -> int:
        terminate(self.proc, 90, f"instance {self.name}")
        self.returncode = self.proc.returncode
        return self.returncode


class Fleet:
    """Every instance started, so that all of them are stopped whatever happens."""

    def __init__(self, tmp: Path, model: str, settings: dict[str, str], threads: int):
        self.tmp, self.model, self.settings, self.threads = tmp, model, settings, threads
        self.live: list[Instance] = []
        self.exits: dict[str, int] = {}

    def start(self, name: str, *extra: str) -> Instance:
        sets = [a for k, v in self.settings.items() for a in ("--set", f"{k}={v}")]
        inst = Instance(name, self.model, self.tmp / name, [*sets, *extra], self.threads)
        self.live.append(inst)
        inst.wait_ready()
        return inst

    def stop(self, inst: Instance, remove: bool = True) -> None:
        self.exits[inst.name] = inst.stop()
        if inst.returncode != 0:
            log(f"instance {inst.name} exited with status {inst.returncode}:\n{inst.tail(1500)}")
        self.live.remove(inst)
        if remove:
            shutil.rmtree(inst.data, ignore_errors=True)

    def stop_all(self) -> None:
        for inst in reversed(list(self.live)):
            try:
                self.stop(inst, remove=False)
            except BaseException as exc:   # a second signal while stopping: stop the others still
                log(f"stopping {inst.name}: {exc!r}")
                if inst.proc.poll() is None:
                    inst.proc.kill()
                if inst in self.live:
                    self.live.remove(inst)
