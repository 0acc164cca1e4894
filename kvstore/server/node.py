"""`kvstore serve` as one process: the tiered store and its daemon, the engine and its
OpenAI-compatible API, the REST admin API with metrics and, with cluster.redis_url, this
instance's part in the cross-instance prefix index.

SIGINT or SIGTERM drains: /readyz turns 503, the APIs stop taking requests and give those in
flight a grace period, the engine stops, and the store closes with its hot and warm pages
written to cold, so a restarted instance serves them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from typing import Callable

from aiohttp import web

from kvstore.config import Config
from kvstore.daemon import Daemon
from kvstore.errors import ConfigError
from kvstore.server.admin import admin_url, create_admin_app, set_draining, start_admin
from kvstore.server.metrics import Metrics
from kvstore.store import INDEX_WAIT_S

SHUTDOWN_GRACE_S = 5.0


def check_port(key: str, host: str, port: int) -> None:
    """ConfigError naming `key` when host:port cannot be listened on (in use, or not an address here)."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in infos[:1]:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(address)
    except OSError as exc:
        raise ConfigError(key, port, f"cannot listen on {host}:{port} ({exc.strerror or exc}); "
                                     "another process may use it: choose another port") from None


async def run_serve(config: Config, on_ready: Callable[[str, str], None]) -> None:
    """Serve until SIGINT/SIGTERM; on_ready(api_url, admin_url) once warmed up."""
    from engine import LLM, AsyncLLM
    from engine.api import api_runner, create_app, warm_up
    from kvstore.cluster.node import CLUSTER, ClusterNode

    for key, host, port in (("server.port", config.server.host, config.server.port),
                            ("admin.port", config.admin.host, config.admin.port)):
        check_port(key, host, port)    # before the model loads: a busy port fails in a second, not a minute
    llm = LLM(config.model, config=config)
    if config.max_seq_len != Config().max_seq_len and config.max_seq_len > llm.max_seq_len:
        llm.close()
        raise ConfigError("max_seq_len", config.max_seq_len, f"must be at most {llm.max_seq_len}, the model's "
                          "longest sequence (--max-model-len)")
    store = llm.store
    store.wait_indexed(INDEX_WAIT_S)   # a small cold tier is indexed before the first request; a large one meanwhile
    daemon = await Daemon(store).start()
    metrics = Metrics(store, llm)
    engine = AsyncLLM(llm, on_finish=lambda o: metrics.observe_request(
        o.ttft_s, o.latency_s, o.finish_reason in ("stop", "length"), prompt_tokens=len(o.prompt_token_ids),
        generation_tokens=len(o.token_ids), cached_tokens=o.cached_tokens))
    engine.ready = False
    admin = create_admin_app(store, daemon, config, engine=engine, metrics=metrics)
    runners: list[web.AppRunner] = []
    node = None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        runners.append(await start_admin(admin, config))
        if config.cluster.redis_url:
            node = ClusterNode(config, store, daemon, admin_url(runners[0]), lambda: llm.runner.tokens_per_s)
            admin[CLUSTER] = node
            metrics.collector.cluster = node
            engine.prefetch = node.prefetch
            await node.start()
        await engine.start()
        api = create_app(engine, config.server, metrics)
        runner = api_runner(api)
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, config.server.host, config.server.port,
                          shutdown_timeout=SHUTDOWN_GRACE_S).start()
        await warm_up(engine, api)
        engine.ready = True
        host, port = runner.addresses[0][:2]
        on_ready(f"http://{f'[{host}]' if ':' in host else host}:{port}", admin_url(runners[0]))
        await stop.wait()
    finally:
        set_draining(admin)
        for runner in reversed(runners):   # the API first: no new requests, in-flight ones finish
            await runner.cleanup()
        await engine.stop()
        if node is not None:
            await node.stop()
        await daemon.stop()
        with contextlib.suppress(Exception):
            await asyncio.to_thread(llm.close)   # hot and warm pages to cold
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
