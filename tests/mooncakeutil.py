"""A real mooncake_master per test, with its HTTP metadata server, on free loopback ports.

Mooncake is available where the package mooncake-transfer-engine-non-cuda imports (it needs the
Debian package libibverbs1) and its mooncake_master binary is found; `missing()` says why not.
The master keeps no memory of its own: the backend under test lends it (segment= in `url`).
"""

from __future__ import annotations

import importlib.util
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from redisutil import free_port


def master_binary() -> str | None:
    """The mooncake_master executable the package ships (not its Python wrapper), else one on PATH."""
    try:
        spec = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):
        spec = None
    if spec and spec.origin:
        exe = Path(spec.origin).parent / "mooncake_master"
        if exe.is_file():
            return str(exe)
    return shutil.which("mooncake_master")


def missing() -> str:
    """Why Mooncake cannot run here ('' when it can)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return (f"mooncake cannot be imported ({' '.join(str(exc).split())[:160]}): scripts/bootstrap installs "
                "mooncake-transfer-engine-non-cuda and libibverbs1")
    if master_binary() is None:
        return "the mooncake_master binary is not found (pip install mooncake-transfer-engine-non-cuda)"
    return ""


def _free_ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return sorted(ports)


class MooncakeMaster:
    def __init__(self, directory: Path, *flags: str):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rpc_port, self.http_port, self.metrics_port = _free_ports(3)
        self.flags = flags
        self.proc: subprocess.Popen | None = None
        self.start()

    def args(self) -> list[str]:
        exe = master_binary()
        if exe is None:
            raise RuntimeError("mooncake_master is not installed (scripts/bootstrap installs it)")
        return [exe, "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc_port}",
                "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http_port}", "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}", "--logtostderr", *self.flags]

    def start(self) -> None:
        log = self.dir / "master.log"
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(self.args(), stdout=out, stderr=subprocess.STDOUT, cwd=self.dir)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = log.read_text(errors="replace")[-400:]
                raise RuntimeError(f"mooncake_master exited on port {self.rpc_port}: {tail}")
            if self._answers():
                return
            time.sleep(0.05)
        raise RuntimeError(f"mooncake_master did not start on port {self.rpc_port}")

    def _answers(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.rpc_port), timeout=0.2).close()
            urllib.request.urlopen(f"{self.metadata}?key=kvstore-probe", timeout=0.5)
        except urllib.error.HTTPError as exc:
            return exc.code == 404
        except OSError:
            return False
        return True

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def url_with(self, segment: str = "256MiB", **options: str) -> str:
        query = "".join(f"&{k}={v}" for k, v in options.items())
        return f"mooncake://127.0.0.1:{self.rpc_port}?metadata={self.metadata}&segment={segment}{query}"

    @property
    def url(self) -> str:
        return self.url_with()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.thaw()
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def freeze(self) -> None:
        """SIGSTOP: the master keeps its sockets open and answers nothing (a hung server)."""
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
