"""What the API's aiohttp application holds: the engine, whom it serves and as what, its readiness;
and what each request carries (its tenant, its `user`)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from aiohttp import web

from app.api.config import ServerConfig
from engine import AsyncLLM
from kvstore.server.metrics import Metrics

ENGINE_STOPPED = "the engine stopped after an internal error; restart the server"


@dataclass
class ServerState:
    ready: bool = False         # warm-up done: /health answers 200
    started: int = dataclasses.field(default_factory=lambda: int(time.time()))


@dataclass(frozen=True)
class Served:
    """What the API answers as, and to whom: the model id and root, the API keys and their tenants."""

    name: str
    root: str
    keys: dict[bytes, str]          # API key -> tenant; empty: no key needed, every request in tenant ""
    trust_tenant_header: bool = False

    @classmethod
    def of(cls, llm, server: ServerConfig) -> "Served":
        keys = {k.encode(): t for k, t in server.api_keys.items()}
        if server.api_key:
            keys.setdefault(server.api_key.encode(), "")
        return cls(server.served_model_name or llm.model_name, llm.config.model, keys, server.trust_tenant_header)


ENGINE = web.AppKey("engine", AsyncLLM)
STATE = web.AppKey("state", ServerState)
SERVED = web.AppKey("served", Served)
METRICS = web.AppKey("metrics", Metrics)
MAX_BODY = web.AppKey("max_body_bytes", int)
TENANT = web.RequestKey("tenant", str)     # the authenticated tenant
USER = web.RequestKey("user", str)         # the `user` field, recorded in the access log
