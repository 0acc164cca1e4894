"""One typed, validated config tree.

Layers, lowest first: built-in defaults < YAML file (--config or KVSTORE_CONFIG) < KVSTORE_*
environment variables < CLI flags (--set KEY=VALUE and the named flags). Each key's
environment variable is derived once from its path: `hot.pool` -> KVSTORE_HOT_POOL.
Every invalid key or value raises ConfigError naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping

import yaml

from kvstore.errors import ConfigError
from kvstore.pages.spec import DTYPES, KVSpec, canonical_dtype, is_power_of_two

ENV_PREFIX = "KVSTORE_"
ENV_CONFIG_FILE = "KVSTORE_CONFIG"
WRITE_POLICIES = ("write_back", "write_through")
PREFETCH_POLICIES = ("best_effort", "wait", "timeout")
ON_DAMAGE = ("refuse", "quarantine")

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any) -> int:
    """Bytes from an int or a string such as '512MiB', '2GiB', '40GB'. Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError
    if isinstance(value, int):
        if value < 0:
            raise ValueError
        return value
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


# Field kinds: a parser from YAML/env/CLI values to the typed value, and what is allowed.
def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError


def _int(v: Any) -> int:
    if isinstance(v, bool):
        raise ValueError
    if isinstance(v, float) and not v.is_integer():
        raise ValueError
    return int(str(v).strip()) if isinstance(v, str) else int(v)


def _float(v: Any) -> float:
    if isinstance(v, bool):
        raise ValueError
    return float(v)


def _pool(v: Any) -> float | int:
    """A byte size, or a fraction in (0, 1] of the free device memory."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return parse_size(v)
    if 0 < f <= 1 and not (isinstance(v, int) and f == 1):
        return f
    return parse_size(v if isinstance(v, (int, str)) else int(f))


def _str(v: Any) -> str:
    if isinstance(v, (dict, list)):
        raise ValueError
    return str(v)


def opt(default: Any, parse: Callable[[Any], Any], allowed: str,
        check: Callable[[Any], bool] = lambda v: True, help: str = ""):
    """A config key: its default (a mapping's is a fresh dict in every instance), parser, what is
    allowed and a check."""
    meta = {"parse": parse, "allowed": allowed, "check": check, "help": help}
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)


def default_of(f: dataclasses.Field) -> Any:
    """A key's default value."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _unit(v: float) -> bool:
    return 0 < v <= 1


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


def mapping(parse_value: Callable[[Any], Any]) -> Callable[[Any], dict]:
    """A field kind: a YAML mapping, or 'a=1,b=2' from the environment or --set; values parsed."""
    def parse(v: Any) -> dict:
        if isinstance(v, str):
            v = dict(item.split("=", 1) for item in v.split(",") if item.strip()) if v.strip() else {}
        if not isinstance(v, dict):
            raise ValueError
        return {str(k).strip(): parse_value(n) for k, n in v.items()}
    return parse


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
        out = {name: tree[name] for name in _fields(type(self))}
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


def _fields(cls) -> dict[str, dataclasses.Field]:
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


def _is_section(f: dataclasses.Field) -> bool:
    return isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory)


def key_paths(cls=Config, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every leaf key, by dotted path."""
    out = {}
    for name, f in _fields(cls).items():
        if _is_section(f):
            out.update(key_paths(f.default_factory, f"{prefix}{name}."))
        else:
            out[prefix + name] = f
    return out


def env_name(path: str) -> str:
    return ENV_PREFIX + path.replace(".", "_").upper()


def env_vars(root: type[Config] = Config) -> dict[str, str]:
    """Environment variable -> key path, for every key of the tree `root`."""
    return {env_name(p): p for p in key_paths(root)}


def _build(cls, data: Mapping[str, Any], prefix: str = ""):
    if not isinstance(data, Mapping):
        raise ConfigError(prefix.rstrip(".") or "config", data, "must be a mapping of keys to values")
    fields = _fields(cls)
    for key in data:
        if key not in fields:
            raise ConfigError(prefix + str(key), data[key],
                              f"unknown key; allowed here: {', '.join(fields)}")
    values = {}
    for name, f in fields.items():
        path = prefix + name
        if _is_section(f):
            values[name] = _build(f.default_factory, data.get(name) or {}, path + ".")
            continue
        raw = data.get(name, default_of(f))
        meta = f.metadata
        try:
            value = meta["parse"](raw)
        except (TypeError, ValueError):
            raise ConfigError(path, raw, f"must be {meta['allowed']}") from None
        if not meta["check"](value):
            raise ConfigError(path, raw, f"must be {meta['allowed']}")
        values[name] = value
    return cls(**values)


def _check_relations(cfg: Config) -> None:
    for section in ("hot", "warm", "cold"):
        sec = getattr(cfg, section)
        if sec.low_watermark >= sec.high_watermark:
            raise ConfigError(f"{section}.low_watermark", sec.low_watermark,
                              f"must be below {section}.high_watermark ({sec.high_watermark})")
    if cfg.cluster.ttl_s <= cfg.cluster.heartbeat_s:
        raise ConfigError("cluster.ttl_s", cfg.cluster.ttl_s,
                          f"must be more than cluster.heartbeat_s ({cfg.cluster.heartbeat_s})")
    if cfg.remote.url and cfg.remote.write and not cfg.cold.enabled:
        raise ConfigError("remote.write", True, "needs cold.enabled true (pages reach the remote store from the "
                                               "cold tier); set remote.write false for a read-only remote tier")
    if cfg.cold.map_size_max and cfg.cold.map_size_max < cfg.cold.max_bytes:
        raise ConfigError("cold.map_size_max", cfg.cold.map_size_max,
                          f"must be at least cold.max_bytes ({cfg.cold.max_bytes})")


def _set_path(tree: dict, path: str, value: Any) -> None:
    parts = path.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(path, value, f"{part} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _read_file(path: str | Path) -> dict:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError("config", str(p), f"cannot read the file ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError("config", str(p), f"is not valid YAML{where}") from None
    if not isinstance(data, dict):
        raise ConfigError("config", str(p), "must hold a YAML mapping at the top level")
    return data


def load_config(file: str | Path | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None, root: type[Config] = Config) -> Config:
    """Build the config tree `root`: defaults < file < environment < overrides (dotted key -> value)."""
    env = os.environ if env is None else env
    file = file or env.get(ENV_CONFIG_FILE)
    tree: dict = _read_file(file) if file else {}
    variables = env_vars(root)
    known = set(variables) | {ENV_CONFIG_FILE} | set(EXTRA_ENV_VARS)
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        if name not in known:
            raise ConfigError(name, value, "unknown environment variable; known: " + ", ".join(sorted(known)))
        if name in variables:
            _set_path(tree, variables[name], value)
    paths = key_paths(root)
    for path, value in (overrides or {}).items():
        if path not in paths:
            raise ConfigError(path, value, "unknown key; see `kvstore config --keys` or etc/kvstore.yaml")
        _set_path(tree, path, value)
    cfg = _build(root, tree)
    _check_relations(cfg)
    return cfg


def parse_set(items: list[str]) -> dict[str, str]:
    """`--set KEY=VALUE` items to a dict."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError("--set", item, "must be KEY=VALUE, e.g. hot.pool=2GiB")
        out[key.strip()] = value
    return out


# Variables with the prefix that are not config keys (declared once, here).
EXTRA_ENV_VARS: dict[str, str] = {
    "KVSTORE_TEST_VLLM": "scripts/test: 0 leaves out the vLLM venv and the connector's tests",
    "KVSTORE_TEST_STRICT": "scripts/test: 1 (the full run) makes a part of the suite the machine cannot run a failure",
}


# The options of the commands that read the config.
def add_config_options(parser) -> None:
    """The options of every command that reads the config (an argparse parser)."""
    group = parser.add_argument_group("config (defaults < file < KVSTORE_* env < these flags)")
    group.add_argument("--config", metavar="FILE",
                       help="YAML config file (default: $KVSTORE_CONFIG, else built-in defaults)")
    group.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                       help="set one config key, e.g. --set hot.pool=2GiB (repeatable)")
    group.add_argument("--data-dir", metavar="DIR", help="the data directory (config key data_dir)")


def config_from_args(args) -> Config:
    """The effective config of a command's parsed arguments (argparse), of the tree the command
    line was built for (`args.config_root`, default the store's). Raises ConfigError."""
    overrides = parse_set(getattr(args, "set", None) or [])
    if getattr(args, "data_dir", None):
        overrides["data_dir"] = args.data_dir
    return load_config(getattr(args, "config", None), os.environ, overrides, getattr(args, "config_root", Config))


def reference_rows(root: type[Config] = Config) -> list[tuple[str, str, str, str]]:
    """(key, environment variable, default, allowed) for every config key of the tree `root`."""
    def show(default) -> str:
        return str(default).lower() if isinstance(default, bool) else str(default)

    return [(path, env_name(path), show(default_of(f)), f.metadata["allowed"])
            for path, f in key_paths(root).items()]
