"""`kvstore serve`: its command line, and the process it runs: the tiered store (and its daemon),
the engine and its OpenAI-compatible API, the REST admin API with metrics and, with
cluster.redis_url, this instance's part in the cross-instance prefix index.

SIGINT or SIGTERM drains: /readyz turns 503, the APIs stop taking requests and give those in
flight a grace period, the engine stops, and the store closes with its hot and warm pages
written to cold, so a restarted instance serves them all.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
from typing import Callable

from aiohttp import web

from app.api.config import Config
from kvstore.config import add_config_options, config_from_args
from kvstore.errors import ConfigError
from kvstore.heap import frozen

SHUTDOWN_GRACE_S = 5.0


SERVE_DESCRIPTION = """\
Run the tiered store, the decoding engine and the OpenAI-compatible API in one process.

The API: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, POST /tokenize,
POST /detokenize, GET /version, GET /health (503 until the warm-up requests are done, then 200)
and GET /metrics (Prometheus). Requests name the model as /v1/models lists it: --served-model-name,
else the preset's name or the model directory's name. With --api-key every /v1/* request carries
`Authorization: Bearer KEY`.
Tenants never share cached prefixes. A request's tenant is its API key's (server.api_keys); the
X-Tenant header chooses it only with server.trust_tenant_header=true (behind a gateway that
authenticates users itself); the request's `user` field is only recorded.
One line is printed when the server is ready; SIGINT or SIGTERM stops it cleanly.
"""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="run the store, the engine and the OpenAI-compatible API in one process",
                              description=SERVE_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", metavar="DIR_OR_PRESET",
                   help="a Hugging Face model directory or a preset (tiny, small...); sets the config key "
                        "`model` (default: tiny)")
    p.add_argument("--host", help="address to listen on (config key server.host, default 127.0.0.1)")
    p.add_argument("--port", help="TCP port, 0 for any free one (config key server.port, default 8000)")
    p.add_argument("--admin-port", help="TCP port of the REST admin API (config key admin.port, default 8081)")
    p.add_argument("--redis-url", help="the cross-instance prefix index (config key cluster.redis_url; "
                                       "default: none, local-only)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model id the API answers to and /v1/models lists (config key "
                        "server.served_model_name; default: the preset's name or the model directory's name)")
    p.add_argument("--api-key", metavar="KEY",
                   help="a bearer token every /v1/* request must carry (config key server.api_key; also "
                        "KVSTORE_SERVER_API_KEY, which keeps it out of `ps`)")
    p.add_argument("--max-model-len", metavar="N",
                   help="the longest sequence, prompt and output, in tokens (config key max_seq_len, default 8192)")
    add_config_options(p)
    p.set_defaults(func=_run_serve)


# the flags of `kvstore serve` that set a config key: (argument dest, config key)
SERVE_FLAGS = (("model", "model"), ("host", "server.host"), ("port", "server.port"), ("admin_port", "admin.port"),
               ("redis_url", "cluster.redis_url"), ("served_model_name", "server.served_model_name"),
               ("api_key", "server.api_key"), ("max_model_len", "max_seq_len"))


def serve_config(args: argparse.Namespace):
    """The config of `kvstore serve`: its flags are --set items. Raises ConfigError."""
    flags = [f"{key}={getattr(args, dest)}" for dest, key in SERVE_FLAGS if getattr(args, dest) is not None]
    return config_from_args(argparse.Namespace(**{**vars(args), "set": [*args.set, *flags]}))


def _run_serve(args: argparse.Namespace) -> int:
    config = serve_config(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def ready(api: str, admin: str) -> None:
        name = config.server.served_model_name or config.model
        print(f"kvstore serve: {name} ready on {api} (OpenAI API: /v1/completions, "
              f"/v1/chat/completions); admin API on {admin}", flush=True)
    asyncio.run(run_serve(config, ready))
    return 0


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
    from app.api.server import api_runner, create_app, warm_up
    from engine import LLM, AsyncLLM
    from kvstore.cluster.node import CLUSTER, ClusterNode, make_prefetch
    from kvstore.server.admin import admin_url, create_admin_app, set_draining, start_admin
    from kvstore.server.metrics import Metrics
    from kvstore.store.tiered import INDEX_WAIT_S

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
    metrics = Metrics(store, llm)
    engine = AsyncLLM(llm, on_finish=lambda o: metrics.observe_request(
        o.ttft_s, o.latency_s, o.finish_reason in ("stop", "length"), prompt_tokens=len(o.prompt_token_ids),
        generation_tokens=len(o.token_ids), cached_tokens=o.cached_tokens))
    engine.ready = False
    admin = create_admin_app(store, config, engine=engine, metrics=metrics,
                             model_name=config.server.served_model_name or llm.model_name)
    runners: list[web.AppRunner] = []
    node = None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        runners.append(await start_admin(admin, config))
        if config.cluster.redis_url:
            node = ClusterNode(config, store, admin_url(runners[0]), lambda: llm.runner.tokens_per_s)
            admin[CLUSTER] = node
            metrics.collector.cluster = node
            await node.start()
        engine.prefetch = make_prefetch(store, node)
        await engine.start()
        api = create_app(engine, config.server, metrics)
        runner = api_runner(api)
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, config.server.host, config.server.port,
                          shutdown_timeout=SHUTDOWN_GRACE_S).start()
        await warm_up(engine, api)
        with frozen("kvstore serve"):   # full collections do not walk the startup heap (kvstore.heap)
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
        with contextlib.suppress(Exception):
            await asyncio.to_thread(llm.close)   # hot and warm pages to cold
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
