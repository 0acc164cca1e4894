"""The `kvstore` command.

Each command module exposes `add_parser(subparsers)`, which registers its subcommand with
`set_defaults(func=run)`, and `run(args) -> int`. Commands that read the config add the shared
options with `add_config_options(parser)` and build the config with `config_from_args(args)`.
Every user error ends as one line on stderr, `kvstore: error: <message>`, and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from kvstore import __version__
from kvstore.errors import KVStoreError

DESCRIPTION = """\
kvstore: a tiered KV-cache store for LLM inference
(hot: GPU memory, warm: pinned host memory, cold: LMDB on local disk).
"""

EPILOG = """\
config precedence: built-in defaults < YAML file (--config, or KVSTORE_CONFIG)
  < KVSTORE_* environment variables < flags (--set KEY=VALUE, --data-dir).
  `kvstore config --keys` lists every key; etc/kvstore.yaml explains each.
Run `kvstore COMMAND --help` for a command's options.
"""


def add_config_options(parser: argparse.ArgumentParser) -> None:
    """The options of every command that reads the config."""
    group = parser.add_argument_group("config (defaults < file < KVSTORE_* env < these flags)")
    group.add_argument("--config", metavar="FILE",
                       help="YAML config file (default: $KVSTORE_CONFIG, else built-in defaults)")
    group.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                       help="set one config key, e.g. --set hot.pool=2GiB (repeatable)")
    group.add_argument("--data-dir", metavar="DIR", help="the data directory (config key data_dir)")


def config_from_args(args: argparse.Namespace):
    """The effective Config for a command's parsed arguments. Raises ConfigError."""
    from kvstore.config import load_config, parse_set

    overrides = parse_set(getattr(args, "set", None) or [])
    if getattr(args, "data_dir", None):
        overrides["data_dir"] = args.data_dir
    return load_config(getattr(args, "config", None), os.environ, overrides)


def reference_rows() -> list[tuple[str, str, str, str]]:
    """(key, environment variable, default, allowed) for every config key."""
    from kvstore.config import env_name, key_paths

    def show(default) -> str:
        return str(default).lower() if isinstance(default, bool) else str(default)

    return [(path, env_name(path), show(f.default), f.metadata["allowed"]) for path, f in key_paths().items()]


def _run_config(args: argparse.Namespace) -> int:
    if args.keys:
        rows = [("KEY", "ENVIRONMENT", "DEFAULT", "ALLOWED")] + reference_rows()
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        for row in rows:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[3])
        return 0
    import yaml

    cfg = config_from_args(args)
    print("# effective kvstore config: defaults < file < KVSTORE_* env < flags")
    print(yaml.safe_dump(cfg.to_dict(redact=True), sort_keys=False), end="")
    return 0


def _add_config_command(subparsers) -> None:
    p = subparsers.add_parser("config", help="print the effective config as YAML (--keys: list every key)",
                              description="Print the effective config (after file, environment and flags) "
                                          "as YAML, or with --keys every key with its environment variable, "
                                          "default and allowed values.")
    add_config_options(p)
    p.add_argument("--keys", action="store_true", help="list every key, its env variable and allowed values")
    p.set_defaults(func=_run_config)


SERVE_DESCRIPTION = """\
Run the tiered store, the decoding engine and the OpenAI-compatible API in one process.

The API: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health
(503 until the warm-up requests are done, then 200). Requests name the model as /v1/models
lists it: the preset's name, or the model directory's name. The tenant is the X-Tenant
header (or the request's `user` field): tenants never share cached prefixes.
One line is printed when the server is ready; SIGINT or SIGTERM stops it cleanly.
"""


def _add_serve_command(subparsers) -> None:
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
    add_config_options(p)
    p.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    for key, value in (("model", args.model), ("server.host", args.host), ("server.port", args.port),
                       ("admin.port", args.admin_port), ("cluster.redis_url", args.redis_url)):
        if value is not None:
            args.set = [*args.set, f"{key}={value}"]
    config = config_from_args(args)
    from kvstore.server.node import run_serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def ready(api: str, admin: str) -> None:
        print(f"kvstore serve: {config.model} ready on {api} (OpenAI API: /v1/completions, "
              f"/v1/chat/completions); admin API on {admin}", flush=True)
    asyncio.run(run_serve(config, ready))
    return 0


def _add_module_command(subparsers, module_name: str, name: str | None = None) -> None:
    """Register a module's subcommand; if the module cannot be imported, a stub that says so."""
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        name = name or module_name.rsplit(".", 1)[-1]
        why = f"{module_name} cannot be imported: {exc}"
        p = subparsers.add_parser(name, help=f"(unavailable in this build: {exc})")
        p.set_defaults(func=lambda args: _unavailable(name, why), any_arguments=True)
        return
    module.add_parser(subparsers)


def _unavailable(name: str, why: str) -> int:
    print(f"kvstore {name}: unavailable in this build ({why})", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"kvstore {__version__}")
    subparsers = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND", required=True)
    _add_module_command(subparsers, "kvstore.plan")
    _add_config_command(subparsers)
    _add_module_command(subparsers, "kvstore.fsck")
    _add_module_command(subparsers, "kvstore.bench")
    _add_serve_command(subparsers)
    _add_module_command(subparsers, "kvstore.inspect")
    _add_module_command(subparsers, "kvstore.server.sidecar")
    _add_module_command(subparsers, "kvstore.job.cli", "job")
    return parser


def _error(message: str) -> int:
    print(f"kvstore: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Run the `kvstore` command; returns the exit code."""
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra and not getattr(args, "any_arguments", False):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # argparse: --help and --version (0), usage errors (2)
        return exc.code if isinstance(exc.code, int) else 2
    except KVStoreError as exc:
        return _error(str(exc))
    try:
        return int(args.func(args) or 0)
    except KVStoreError as exc:
        return _error(str(exc))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `kvstore config --keys | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:
        print(f"kvstore: error: {exc}", file=sys.stderr)
        return 1
