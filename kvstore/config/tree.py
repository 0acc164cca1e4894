"""The config tree: the store's sections (hot, warm, cold, prefetch, daemon, admin, sidecar,
cluster, remote) under `Config`, each key declared once with `opt` (kinds.py), and the order and
dotted paths of the keys.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from kvstore.config.kinds import _bool, _float, _int, _pool, _str, _unit, opt, parse_size
from kvstore.errors import ConfigError
from kvstore.pages.spec import DTYPES, KVSpec, canonical_dtype, is_power_of_two

WRITE_POLICIES = ("write_back", "write_through")
PREFETCH_POLICIES = ("best_effort", "wait", "timeout")
ON_DAMAGE = ("refuse", "quarantine")


def _policy_names() -> list[str]:
    from kvstore.placement.policy import policy_names
    return policy_names()


@dataclass(frozen=True)
class HotConfig:
    pool: float | int = opt("256MiB", _pool, "a byte size such as 512MiB or 4GiB, or a fraction in (0, 1] "
                            "of free device memory", lambda v: v > 0)
    device: str = opt("auto", _str, "auto, cpu, cuda or cuda:N",
                      lambda v: v in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", v) is not None)
    high_watermark: float = opt(0.90, _float, "a number in (0, 1]", _unit)
    low_watermark: float = opt(0.75, _float, "a number in (0, 1] below high_watermark", _unit)
    backend: str = opt("device", _str, "a tier backend registered under the entry point group "
                                           "kvstore.tiers (built in: device)")


@dataclass(frozen=True)
class WarmConfig:
    bytes: int = opt("1GiB", parse_size, "a byte size such as 1GiB (0 disables the warm tier)")
    high_watermark: float = opt(0.90, _float, "a number in (0, 1]", _unit)
    low_watermark: float = opt(0.75, _float, "a number in (0, 1] below high_watermark", _unit)
    shared_memory: bool = opt(False, _bool, "true or false")
    backend: str = opt("host", _str, "a tier backend registered under the entry point group "
                                           "kvstore.tiers (built in: host)")


@dataclass(frozen=True)
class ColdConfig:
    enabled: bool = opt(True, _bool, "true or false")
    path: str = opt("cold", _str, "a directory (relative paths are under data_dir)")
    max_bytes: int = opt("8GiB", parse_size, "a byte size such as 100GiB", lambda v: v > 0)
    map_size_max: int = opt(0, parse_size, "a byte size >= max_bytes, or 0 for 2 x max_bytes")
    high_watermark: float = opt(0.95, _float, "a number in (0, 1]", _unit)
    low_watermark: float = opt(0.85, _float, "a number in (0, 1] below high_watermark", _unit)
    write_batch: int = opt(64, _int, "an integer >= 1", lambda v: v >= 1)
    on_damage: str = opt("refuse", _str, f"one of {', '.join(ON_DAMAGE)} (a damaged LMDB file at start: refuse to "
                         "start, or set the store aside and start empty)", lambda v: v in ON_DAMAGE)
    backend: str = opt("lmdb", _str, "a tier backend registered under the entry point group "
                                           "kvstore.tiers (built in: lmdb)")


@dataclass(frozen=True)
class PrefetchConfig:
    policy: str = opt("timeout", _str, f"one of {', '.join(PREFETCH_POLICIES)}",
                      lambda v: v in PREFETCH_POLICIES)
    timeout_s: float = opt(2.0, _float, "seconds >= 0", lambda v: v >= 0)


@dataclass(frozen=True)
class DaemonConfig:
    interval_s: float = opt(0.05, _float, "seconds > 0", lambda v: v > 0)
    max_dirty_bytes: int = opt("256MiB", parse_size, "a byte size >= 1 page, such as 256MiB (pages waiting for "
                               "write-behind, at most half the warm tier)", lambda v: v > 0)
    backpressure_timeout_s: float = opt(5.0, _float, "seconds >= 0 a producer (a sidecar put) waits for "
                                        "write-behind before it stores what fits", lambda v: v >= 0)


@dataclass(frozen=True)
class AdminConfig:
    host: str = opt("127.0.0.1", _str, "an address to bind (a non-loopback one requires admin.token)")
    port: int = opt(8081, _int, "a port number in 0..65535 (0: any free port)", lambda v: 0 <= v <= 65535)
    token: str = opt("", _str, "a bearer token (empty: no auth, allowed on loopback only)")
    tls_cert: str = opt("", _str, "a PEM certificate file (with tls_key: serve HTTPS)")
    tls_key: str = opt("", _str, "a PEM private key file")
    max_body_bytes: int = opt("1MiB", parse_size, "a byte size >= 1KiB", lambda v: v >= 1024)
    history_interval_s: float = opt(2.0, _float, "seconds > 0 between the dashboard's history samples",
                                    lambda v: v > 0)
    history_samples: int = opt(300, _int, "an integer >= 2: the history samples kept (a ring buffer)",
                               lambda v: v >= 2)


@dataclass(frozen=True)
class SidecarConfig:
    socket: str = opt("kvstore.sock", _str, "a Unix socket path (relative paths are under data_dir)")
    lease_s: float = opt(30.0, _float, "seconds > 0: a client's pins expire this long after it goes quiet",
                         lambda v: v > 0)
    max_frame_bytes: int = opt("64MiB", parse_size, "a byte size >= 1KiB", lambda v: v >= 1024)
    tp_size: int = opt(1, _int, "an integer >= 1: the client engine's tensor-parallel size", lambda v: v >= 1)


@dataclass(frozen=True)
class ClusterConfig:
    redis_url: str = opt("", _str, "a redis://, rediss:// (TLS) URL, or empty for local-only mode",
                         lambda v: v == "" or v.startswith(("redis://", "rediss://", "unix://")))
    redis_mode: str = opt("standalone", _str, "standalone or cluster (Redis Cluster)",
                          lambda v: v in ("standalone", "cluster"))
    key_prefix: str = opt("kvstore:", _str, "a non-empty string prefixing every Redis key", lambda v: v != "")
    instance_id: str = opt("", _str, "this instance's name in the index (empty: host-pid-random)")
    advertise_url: str = opt("", _str, "the URL peers fetch pages from (empty: the admin API's own)")
    token: str = opt("", _str, "the shared secret instances present to each other to fetch pages")
    fetch_policy: str = opt("auto", _str, "auto (fetch when cheaper than recomputing), always or never",
                            lambda v: v in ("auto", "always", "never"))
    heartbeat_s: float = opt(1.0, _float, "seconds > 0", lambda v: v > 0)
    ttl_s: float = opt(3.0, _float, "seconds > 0, more than heartbeat_s: a silent instance is dead after it",
                       lambda v: v > 0)
    flush_interval_s: float = opt(0.05, _float, "seconds > 0", lambda v: v > 0)


REMOTE_SCHEMES = ("redis://", "rediss://", "redis+cluster://", "mooncake://")


@dataclass(frozen=True)
class RemoteConfig:
    url: str = opt("", _str, "empty (no remote tier), redis://HOST:PORT[/DB], rediss://... (TLS), "
                   "redis+cluster://HOST:PORT[,HOST:PORT...] or mooncake://MASTER_HOST:PORT?metadata=URL",
                   lambda v: v == "" or v.startswith(REMOTE_SCHEMES) or "://" in v)
    password_env: str = opt("KVSTORE_REMOTE_PASSWORD", _str, "the name of an environment variable holding the "
                            "remote store's password (used when remote.url has none)")
    timeout_ms: int = opt(500, _int, "milliseconds >= 1: the longest a call to the remote store waits",
                          lambda v: v >= 1)
    max_bytes: int = opt("32GiB", parse_size, "a byte size (0: no budget of kvstore's; the store's own eviction, "
                         "such as Redis maxmemory, bounds it)")
    write: bool = opt(True, _bool, "true (pages written to cold go to the remote store too) or false (read only)")
    key_prefix: str = opt("kvstore:", _str, "a non-empty string prefixing every key in the remote store",
                          lambda v: v != "")
    queue_pages: int = opt(4096, _int, "an integer >= 1: pages waiting to be written to the remote store, at most "
                           "(beyond it the oldest are skipped: cold still holds them)", lambda v: v >= 1)


@dataclass(frozen=True)
class Config:
    """The store's config tree. An application extends it with sections of its own (a subclass
    adding fields, e.g. engine.config.Config): one file, one precedence for all of them."""

    SECRET_KEYS: ClassVar[tuple[str, ...]] = ("admin.token", "cluster.token", "cluster.redis_url", "remote.url")
    # where an extension's sections are listed (config output, --keys): after this section
    EXTENSIONS_AFTER: ClassVar[str] = "daemon"

    data_dir: str = opt("./kvstore-data", _str, "a directory")
    model: str = opt("tiny", _str, "a preset name or a Hugging Face model directory")
    kv_dtype: str = opt("auto", _str, f"auto or one of {', '.join(DTYPES)}",
                        lambda v: v == "auto" or _dtype_ok(v))
    page_size: int = opt(16, _int, "a positive power of two (e.g. 16)", is_power_of_two)
    max_seq_len: int = opt(8192, _int, "an integer >= 1", lambda v: v >= 1)
    eviction_policy: str = opt("lru", _str, "a registered eviction policy",
                               lambda v: v in _policy_names())
    write_policy: str = opt("write_back", _str, f"one of {', '.join(WRITE_POLICIES)}",
                            lambda v: v in WRITE_POLICIES)
    prefix_cache_max_entries: int = opt(1_000_000, _int, "an integer >= 1", lambda v: v >= 1)
    pin_ttl_s: float = opt(600.0, _float, "seconds > 0", lambda v: v > 0)
    hot: HotConfig = field(default_factory=HotConfig)
    warm: WarmConfig = field(default_factory=WarmConfig)
    cold: ColdConfig = field(default_factory=ColdConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    sidecar: SidecarConfig = field(default_factory=SidecarConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)

    # derived
    @property
    def cold_path(self) -> Path:
        p = Path(self.cold.path)
        return p if p.is_absolute() else Path(self.data_dir) / p

    @property
    def cold_map_size_max(self) -> int:
        return self.cold.map_size_max or 2 * self.cold.max_bytes

    def resolved_kv_dtype(self, device: str) -> str:
        if self.kv_dtype != "auto":
            return canonical_dtype(self.kv_dtype, "kv_dtype")
        return "bfloat16" if device.startswith("cuda") else "float32"

    def kv_spec(self, device: str = "cpu") -> KVSpec:
        from kvstore.pages.shapes import load_shape
        return load_shape(self.model).kv_spec(self.resolved_kv_dtype(device), self.page_size)

    def to_dict(self, redact: bool = False) -> dict:
        tree = dataclasses.asdict(self)
        out = {name: tree[name] for name in fields_of(type(self))}
        if redact:
            for path in self.SECRET_KEYS:
                section, key = path.split(".")
                value = out[section][key]
                if isinstance(value, dict):
                    out[section][key] = {redact_secret(k): t for k, t in value.items()}
                elif value:
                    out[section][key] = redact_secret(value)
        return out

    @property
    def sidecar_socket(self) -> Path:
        p = Path(self.sidecar.socket)
        return p if p.is_absolute() else Path(self.data_dir) / p

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)


def redact_secret(value: str) -> str:
    """Hide a secret; for a URL only its password."""
    m = re.match(r"^([a-z][a-z0-9+.-]*://)([^@/]*)@(.*)$", value)
    if m:
        user = m.group(2).split(":", 1)[0]
        return f"{m.group(1)}{user}:<redacted>@{m.group(3)}"
    return value if "://" in value else "<redacted>"


def _dtype_ok(v: str) -> bool:
    try:
        canonical_dtype(v)
        return True
    except ConfigError:
        return False


def fields_of(cls) -> dict[str, dataclasses.Field]:
    """A config class's fields, in the order they are listed: an extension's own sections (fields
    a subclass of Config adds) after the section EXTENSIONS_AFTER, so that extending the tree
    does not move the store's keys to its end."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    after = getattr(cls, "EXTENSIONS_AFTER", None)
    base = next((b for b in cls.__mro__[1:] if b is Config), None)
    if base is None or after not in fields:
        return fields
    own = [n for n in fields if n not in {f.name for f in dataclasses.fields(base)}]
    order = [n for n in fields if n not in own]
    at = order.index(after) + 1
    return {n: fields[n] for n in order[:at] + own + order[at:]}


def is_section(f: dataclasses.Field) -> bool:
    return isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory)


def key_paths(cls=Config, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every leaf key, by dotted path."""
    out = {}
    for name, f in fields_of(cls).items():
        if is_section(f):
            out.update(key_paths(f.default_factory, f"{prefix}{name}."))
        else:
            out[prefix + name] = f
    return out

