"""One typed, validated config tree.

Layers, lowest first: built-in defaults < YAML file (--config or KVSTORE_CONFIG) < KVSTORE_*
environment variables < CLI flags (--set KEY=VALUE and the named flags). Each key's
environment variable is derived once from its path: `hot.pool` -> KVSTORE_HOT_POOL.
Every invalid key or value raises ConfigError naming the key, the value and what is allowed.

The keys' kinds (parsers, `opt`) are in kinds.py, the tree of sections in tree.py, loading it
in load.py, and its command-line options in options.py; everything is imported from here.
"""

from kvstore.config.kinds import (_bool, _float, _int, _pool, _str, _unit, default_of, format_size, mapping, opt,
                                  parse_size)
from kvstore.config.load import ENV_CONFIG_FILE, ENV_PREFIX, EXTRA_ENV_VARS, env_name, env_vars, load_config
from kvstore.config.options import add_config_options, config_from_args, parse_set, reference_rows
from kvstore.config.tree import (ON_DAMAGE, PREFETCH_POLICIES, REMOTE_SCHEMES, WRITE_POLICIES, AdminConfig,
                                 ClusterConfig, ColdConfig, Config, DaemonConfig, HotConfig, PrefetchConfig,
                                 RemoteConfig, SidecarConfig, WarmConfig, key_paths, redact_secret)
from kvstore.errors import ConfigError

__all__ = [
    "_bool", "_float", "_int", "_pool", "_str", "_unit", "default_of", "format_size", "mapping", "opt", "parse_size",
    "ENV_CONFIG_FILE", "ENV_PREFIX", "EXTRA_ENV_VARS", "env_name", "env_vars", "load_config",
    "add_config_options", "config_from_args", "parse_set", "reference_rows",
    "ON_DAMAGE", "PREFETCH_POLICIES", "REMOTE_SCHEMES", "WRITE_POLICIES", "AdminConfig", "ClusterConfig",
    "ColdConfig", "Config", "DaemonConfig", "HotConfig", "PrefetchConfig", "RemoteConfig", "SidecarConfig",
    "WarmConfig", "key_paths", "redact_secret", "ConfigError",
]
