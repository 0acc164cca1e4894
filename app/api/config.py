"""The API's section of the config tree (server), and the tree of the `kvstore` programs it completes.

`Config` is the engine's tree (engine.config.Config: the store's sections and the engine's) plus
`server`: one file, one precedence (defaults < file < KVSTORE_* environment < flags), one
`kvstore config --keys`. The engine alone loads its own tree, which has no server section.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar

from engine import config as engine_config
from kvstore import config as store_config
from kvstore.config import _bool, _int, _str, mapping, opt


def _tenant(v: Any) -> str:
    if v is None:
        return ""
    if not isinstance(v, str):
        raise ValueError
    return v.strip()


@dataclass(frozen=True)
class ServerConfig:
    host: str = opt("127.0.0.1", _str, "an address to bind")
    port: int = opt(8000, _int, "a port number in 0..65535", lambda v: 0 <= v <= 65535)
    served_model_name: str = opt("", _str, "the model id the API answers to (empty: the preset's name or the "
                                 "model directory's name)")
    api_key: str = opt("", _str, "a bearer token every /v1/* request must carry (tenant: the default one; "
                       "empty: no key)")
    api_keys: dict = opt({}, mapping(_tenant), "a mapping API key -> tenant (or 'KEY1=alice,KEY2=bob'): a request's "
                         "tenant is its key's", lambda v: all(k for k in v))
    trust_tenant_header: bool = opt(False, _bool, "true or false (true: the X-Tenant header chooses the tenant, "
                                    "for a gateway that authenticates users itself)")


@dataclass(frozen=True)
class Config(engine_config.Config):
    """The engine's config tree with the API's server section."""

    SECRET_KEYS: ClassVar[tuple[str, ...]] = (*engine_config.Config.SECRET_KEYS, "server.api_key", "server.api_keys")

    server: ServerConfig = field(default_factory=ServerConfig)


load_config = partial(store_config.load_config, root=Config)
load_config.__doc__ = "kvstore.config.load_config for the whole tree (file, env, overrides) -> Config."


def key_paths() -> dict:
    """Every leaf key of the whole tree, by dotted path."""
    return store_config.key_paths(Config)
