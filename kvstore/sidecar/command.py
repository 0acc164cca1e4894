"""The sidecar data plane (`kvstore sidecar`): the store alone, next to an inference engine in
another process, which uses it through kvstore.sidecar.client.SidecarClient.

    kvstore/sidecar/protocol.py    the wire protocol: frames, ops, field checks, errors
    kvstore/sidecar/server.py      SidecarServer: the Unix socket, the ops, draining
    kvstore/sidecar/session.py     Session: one connection's leases on warm slots
    kvstore/sidecar/command.py     this command: config, socket file, shared memory, run
    kvstore/sidecar/client.py      SidecarClient, for the engine's process (client_ops.py: its ops)

Page bytes do not cross the socket: the warm tier lives in a POSIX shared-memory segment that
the client maps too, and requests carry slot numbers. The segment is named after the data
directory (DataDir.shm_name), which the sidecar holds locked, so one left behind by a sidecar
killed together with its resource tracker is found and reclaimed by the next start. Slots a
client holds are leased: they end when it disconnects or sends nothing for sidecar.lease_s.

Lifecycle: the REST admin API (kvstore.server.admin) listens on admin.port next to the socket.
Ready (`kvstore sidecar: ready on SOCKET` on stdout) once the cold tier is indexed and both listen.
SIGTERM or SIGINT drains: stop accepting, finish the requests in flight, write hot and warm
pages to cold (store.close(persist=True)), remove the socket file, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
import time
from pathlib import Path

from kvstore.config import Config, format_size
from kvstore.datadir import make_private_dirs
from kvstore.errors import ConfigError, KVStoreError
from kvstore.heap import frozen
from kvstore.pages.spec import KVSpec
from kvstore.sidecar.protocol import one_line
from kvstore.sidecar.server import BYTES_FRAME_BYTES, SidecarServer
from kvstore.store.tiered import INDEX_WAIT_S, TieredStore
from kvstore.tiers.buffers import keep_write_buffers
from kvstore.tiers.device import resolve_device

log = logging.getLogger("kvstore.sidecar")

# the command
DESCRIPTION = """\
Run the tiered store alone, next to an inference engine in another process: a Unix socket
(msgpack frames) for control, page bytes through the warm tier in shared memory, which the
client (kvstore.sidecar.client.SidecarClient) maps. The REST admin API listens on admin.port.

One line is printed when the sidecar is ready (after the cold tier is indexed):
  kvstore sidecar: ready on SOCKET
SIGTERM or SIGINT drains: finish the requests in flight, write hot and warm pages to cold,
remove the socket file, exit 0.
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("sidecar", help="run the store alone next to an external inference engine "
                                              "(Unix socket + shared memory)",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_options(p)
    p.set_defaults(func=run)
    return p


def _add_options(p: argparse.ArgumentParser) -> None:
    from kvstore.config import add_config_options

    p.add_argument("--socket", metavar="PATH",
                   help="the Unix socket to serve (config key sidecar.socket; a relative path is under data_dir)")
    p.add_argument("--admin-port", metavar="N", help="the REST admin API's port, 0 for any free one "
                                                     "(config key admin.port, default 8081)")
    add_config_options(p)


def sidecar_config(args: argparse.Namespace) -> Config:
    """The config of `kvstore sidecar`: the flags, and the warm tier always in shared memory."""
    from kvstore.config import config_from_args

    for key, value in (("sidecar.socket", args.socket), ("admin.port", args.admin_port)):
        if value is not None:
            args.set = [*args.set, f"{key}={value}"]
    args.set = [*args.set, "warm.shared_memory=true"]
    return config_from_args(args)


def sidecar_spec(config: Config) -> KVSpec:
    """The geometry of the sidecar's pages: the model's, or one tensor-parallel rank's (sidecar.tp_size)."""
    spec = config.kv_spec(resolve_device(config.hot.device).type)
    tp, heads = config.sidecar.tp_size, spec.num_kv_heads
    if tp == 1:
        return spec
    if (tp <= heads and heads % tp) or (tp > heads and tp % heads):
        raise ConfigError("sidecar.tp_size", tp, f"must divide the model's {heads} KV heads, or be a multiple of them")
    return KVSpec(spec.num_layers, max(1, heads // tp), spec.head_dim, spec.dtype, spec.page_size)


def claim_socket(path: Path) -> None:
    """Make `path` free to bind: refuse a live socket or another file there; remove a stale socket."""
    if len(os.fsencode(path)) > 107:
        raise ConfigError("sidecar.socket", str(path), "must be a path under 108 bytes (a Unix socket's limit)")
    make_private_dirs(path.parent)   # the data directory, by default: 0700 from the start
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise KVStoreError(f"sidecar.socket: {path} exists and is not a socket; remove it or choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(str(path))
    except OSError:
        os.unlink(path)
        log.info("removed a stale socket file %s", path)
        return
    finally:
        probe.close()
    raise KVStoreError(f"another process is serving {path} (a kvstore sidecar already running?)")


def prefault_warm(store: TieredStore) -> None:
    """Touch all of the shared warm tier now: its memory is committed at start (a full /dev/shm is
    an error here, not a SIGBUS mid-request) and no put pays first-touch page faults later."""
    need = store.warm.capacity_bytes
    with contextlib.suppress(OSError):
        st = os.statvfs("/dev/shm")
        if need > st.f_bavail * st.f_frsize:
            raise KVStoreError(f"warm.bytes = {need}: the shared-memory filesystem /dev/shm has only "
                               f"{format_size(st.f_bavail * st.f_frsize)} free")
    store.warm.raw.zero_()


async def start_admin_api(sidecar: SidecarServer) -> str:
    """The REST admin API (kvstore.server.admin) on admin.host:admin.port; returns its URL."""
    from kvstore.server.admin import admin_url, create_admin_app, start_admin

    app = create_admin_app(sidecar.store, sidecar.config)
    sidecar.admin_runner = await start_admin(app, sidecar.config)
    return admin_url(sidecar.admin_runner)


async def serve(config: Config, store: TieredStore, path: Path) -> int:
    """Serve until SIGTERM or SIGINT, then drain. The caller closes the store."""
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(_log_loop_error)
    sidecar = SidecarServer(config, store, path)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, sidecar.request_stop)
    try:
        await sidecar.start()
        url = await start_admin_api(sidecar)
    except BaseException:
        await sidecar.drain()
        raise
    log.info("warm tier: %d slots of %d bytes in shared memory %s; lease %g s",
             store.warm.num_slots, store.spec.page_bytes, store.warm.shm_name, config.sidecar.lease_s)
    with frozen("kvstore sidecar"):   # full collections do not walk the startup heap (kvstore.heap)
        print(f"kvstore sidecar: admin API on {url}", flush=True)
        print(f"kvstore sidecar: ready on {path}", flush=True)
        await sidecar.stopped.wait()
    return 0


def run(args: argparse.Namespace) -> int:
    config = sidecar_config(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    path = config.sidecar_socket.absolute()
    spec = sidecar_spec(config)
    claim_socket(path)
    store = TieredStore(config, spec=spec)
    store.wait_indexed(INDEX_WAIT_S)   # a small cold tier is indexed before the first client; a large one meanwhile
    code = 1
    try:
        if store.warm.num_slots < 1:
            raise ConfigError("warm.bytes", config.warm.bytes, f"must hold at least one page "
                                                               f"({store.spec.page_bytes} bytes) for the sidecar")
        prefault_warm(store)
        # the bytes fallback allocates and frees a frame or two per request: keep them on the heap
        keep_write_buffers(BYTES_FRAME_BYTES, 16 * BYTES_FRAME_BYTES)
        code = asyncio.run(serve(config, store, path))
    finally:
        started = time.monotonic()
        try:
            store.close(persist=True)   # hot and warm pages to cold
        except KVStoreError as exc:
            log.error("closing the store failed: %s", one_line(exc))
            code = 1
        else:
            if code == 0:
                log.info("stopped: pages written to cold in %.2f s", time.monotonic() - started)
    return code


def _log_loop_error(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    exc = context.get("exception")
    log.error("%s%s", context.get("message", "event loop error"), f": {type(exc).__name__}: {exc}" if exc else "")
