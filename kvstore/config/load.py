"""Loading the config tree: built-in defaults < YAML file (--config or KVSTORE_CONFIG) < KVSTORE_*
environment variables < overrides (dotted key -> value), then the checks across keys.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import yaml

from kvstore.config.kinds import default_of
from kvstore.config.tree import Config, fields_of, is_section, key_paths
from kvstore.errors import ConfigError

ENV_PREFIX = "KVSTORE_"
ENV_CONFIG_FILE = "KVSTORE_CONFIG"

# Variables with the prefix that are not config keys (declared once, here).
EXTRA_ENV_VARS: dict[str, str] = {
    "KVSTORE_TEST_VLLM": "scripts/test: 0 leaves out the vLLM venv and the connector's tests",
    "KVSTORE_TEST_SGLANG": "scripts/test: 0 leaves out the SGLang venv and the HiCache backend's tests",
    "KVSTORE_KERNEL_MARCH": "the engine's compiled CPU kernels are built for this -march (default native), "
                            "e.g. x86-64-v3 for AVX2 without AVX-512",
}


def env_name(path: str) -> str:
    return ENV_PREFIX + path.replace(".", "_").upper()


def env_vars(root: type[Config] = Config) -> dict[str, str]:
    """Environment variable -> key path, for every key of the tree `root`."""
    return {env_name(p): p for p in key_paths(root)}


def _build(cls, data: Mapping[str, Any], prefix: str = ""):
    if not isinstance(data, Mapping):
        raise ConfigError(prefix.rstrip(".") or "config", data, "must be a mapping of keys to values")
    fields = fields_of(cls)
    for key in data:
        if key not in fields:
            raise ConfigError(prefix + str(key), data[key],
                              f"unknown key; allowed here: {', '.join(fields)}")
    values = {}
    for name, f in fields.items():
        path = prefix + name
        if is_section(f):
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


