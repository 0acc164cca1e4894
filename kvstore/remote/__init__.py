"""The remote tier: page records in a distributed store that instances share (tier.py), through a
backend chosen by remote.url's scheme (backend.py: redis, rediss, redis+cluster in
redis_backend.py, mooncake in mooncake.py, or a plugin's under the entry point group
kvstore.remote)."""

from __future__ import annotations

import functools
import os

from kvstore.config import Config
from kvstore.errors import ConfigError
from kvstore.pages import record
from kvstore.pages.spec import KVSpec
from kvstore.remote.backend import REMOTE_BACKENDS, RemoteBackend, RemoteDown
from kvstore.remote.tier import RemoteTier
from kvstore.tiers.buffers import round_up

__all__ = ["RemoteBackend", "RemoteDown", "RemoteTier", "head_room", "open_remote"]


def _factory(url: str):
    from kvstore.remote import mooncake, redis_backend  # noqa: F401 (they register the built-in backends)

    scheme = url.partition("://")[0].lower()
    try:
        return REMOTE_BACKENDS.get(scheme)
    except ConfigError:
        raise ConfigError("remote.url", f"{scheme}://...", "must start with one of "
                          + ", ".join(f"{n}://" for n in REMOTE_BACKENDS.names())) from None


def head_room(config: Config, spec: KVSpec) -> int:
    """Bytes warm should leave before each page: room for a record's head, to 64 bytes, when
    remote.url's backend lands whole records (its factory's `lands_records`: Mooncake, where a
    value read in two parts costs a transfer slice more per page); else 0."""
    if not config.remote.url or not getattr(_factory(config.remote.url), "lands_records", False):
        return 0
    return round_up(record.head_bound(spec), 64)


def open_remote(config: Config, spec: KVSpec) -> RemoteTier | None:
    """The remote tier remote.url names (None when it is empty). A bad URL raises ConfigError; a
    remote store that is down now is not an error: the tier starts down and retries."""
    cfg = config.remote
    if not cfg.url:
        return None
    factory = _factory(cfg.url)
    password = os.environ.get(cfg.password_env, "") if cfg.password_env else ""
    connect = functools.partial(factory, cfg.url, cfg.timeout_ms / 1000, password)
    tier = RemoteTier(cfg, spec, connect)
    try:
        tier.backend = connect()
    except RemoteDown as exc:
        tier.mark_down(exc)
    return tier
