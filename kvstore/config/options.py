"""The config on the command line: the options of every command that reads it (--config, --set,
--data-dir), the effective config of parsed arguments, and the reference table of every key.
"""

from __future__ import annotations

import os

from kvstore.config.kinds import default_of
from kvstore.config.load import env_name, load_config
from kvstore.config.tree import Config, key_paths
from kvstore.errors import ConfigError


def parse_set(items: list[str]) -> dict[str, str]:
    """`--set KEY=VALUE` items to a dict."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError("--set", item, "must be KEY=VALUE, e.g. hot.pool=2GiB")
        out[key.strip()] = value
    return out


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
