"""A real redis-server per test, on a free loopback port (standalone, password, TLS or a cluster)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is also free and below 65536."""
    for _ in range(200):
        port = free_port()
        if port + 10000 > 65535:
            port -= 30000   # the kernel's ephemeral range starts at 32768; shift below it
        if port > 1024 and _is_free(port) and _is_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a Redis cluster node")


def make_cert(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "redis.crt", directory / "redis.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    return cert, key


class RedisServer:
    def __init__(self, directory: Path, password: str | None = None, tls: bool = False,
                 cluster: bool = False, port: int | None = None, flags: tuple[str, ...] = ()):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or (free_cluster_port() if cluster else free_port())
        self.password, self.tls, self.cluster, self.flags = password, tls, cluster, flags
        self.cert = self.key = None
        if tls:
            self.cert, self.key = make_cert(self.dir)
        self.proc: subprocess.Popen | None = None
        self.start()

    def args(self) -> list[str]:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (scripts/bootstrap installs it)")
        a = [exe, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.dir)]
        if self.tls:
            a += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.cert),
                  "--tls-key-file", str(self.key), "--tls-ca-cert-file", str(self.cert), "--tls-auth-clients", "no"]
        else:
            a += ["--port", str(self.port)]
        if self.password:
            a += ["--requirepass", self.password]
        if self.cluster:
            a += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.dir / "nodes.conf")]
        return a + list(self.flags)

    def start(self) -> None:
        log = self.dir / "redis.log"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(self.args(), stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30   # a loaded machine can be slow to start it
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = log.read_text(errors="replace")[-400:]
                raise RuntimeError(f"redis-server exited on port {self.port}: {tail}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.cert}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"


def make_cluster(directory: Path, nodes: int = 3, replicas: int = 0, flags: tuple[str, ...] = ()) -> list[RedisServer]:
    """nodes masters, each with `replicas` replicas (servers: the masters first, as redis-cli assigns
    them), started with flags."""
    servers = [RedisServer(Path(directory) / f"n{i}", cluster=True, flags=flags) for i in range(nodes * (1 + replicas))]
    subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{s.port}" for s in servers],
                    "--cluster-replicas", str(replicas), "--cluster-yes"], check=True, capture_output=True, timeout=30)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        states = [subprocess.run(["redis-cli", "-p", str(s.port), "cluster", "info"],
                                 capture_output=True, text=True).stdout for s in servers]
        if all("cluster_state:ok" in out for out in states):   # every node: one late node answers CLUSTERDOWN
            return servers
        time.sleep(0.2)
    raise RuntimeError("Redis cluster did not become ready")
