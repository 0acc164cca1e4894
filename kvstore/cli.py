"""The `kvstore` command.

Each command module exposes `add_parser(subparsers)`, which registers its subcommand with
`set_defaults(func=run)`, and `run(args) -> int`. Commands that read the config add the shared
options with `add_config_options(parser)` and build the config with `config_from_args(args)`.
Every user error ends as one line on stderr, `kvstore: error: <message>`, and exit code 2; a
usage error adds the command to ask, `(see kvstore inspect stats --help)`. A command's options
may come before or after its action (`CommandParser`).
"""

from __future__ import annotations

import argparse
import copy
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


class CommandParser(argparse.ArgumentParser):
    """The parser of `kvstore`, of its commands and of their actions (argparse passes the class on).

    A usage error is one line on stderr, `kvstore: error: MESSAGE (see PROG --help)`, and exit
    code 2. The options of a command with actions are accepted before or after the action:
    `kvstore inspect --json stats` and `kvstore inspect stats --json` are the same.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _Actions)

    def error(self, message: str):
        self.exit(2, f"kvstore: error: {' '.join(message.split())} (see {self.prog} --help)\n")


_ADDING = (argparse._AppendAction, argparse._AppendConstAction, argparse._ExtendAction)


class _Actions(argparse._SubParsersAction):
    """The actions of a command. Each action's parser also takes the command's options, without
    defaults of its own, so a value given before the action stays; one given on both sides of it
    and meant to repeat (--set) keeps both."""

    def __call__(self, parser, namespace, values, option_string=None):
        chosen = self._name_parser_map.get(values[0])
        shared = _share_options(parser, chosen) if chosen is not None else []
        before = {a.dest: getattr(namespace, a.dest, None) for a in shared if isinstance(a, _ADDING)}
        super().__call__(parser, namespace, values, option_string)
        for dest, old in before.items():
            new = getattr(namespace, dest, None)
            if old and new is not old:   # given after the action too: argparse started a new list
                setattr(namespace, dest, [*old, *new])


def _share_options(command: argparse.ArgumentParser, action: argparse.ArgumentParser) -> list[argparse.Action]:
    """Copy the command's options (not --help, --version or ones the action has) to the action's parser,
    in help groups of the same titles; once. Returns the copies."""
    if getattr(action, "shared_options", None) is None:
        action.shared_options = []
        taken = {a.dest for a in action._actions} | set(action._option_string_actions)
        groups = {g.title: g for g in action._action_groups}
        for group in command._action_groups:
            for option in group._group_actions:
                if (not option.option_strings or isinstance(option, (argparse._HelpAction, argparse._VersionAction))
                        or option.dest in taken or taken & set(option.option_strings)):
                    continue
                if group.title not in groups:
                    groups[group.title] = action.add_argument_group(group.title, group.description)
                shared = copy.copy(option)
                shared.default, shared.required = argparse.SUPPRESS, False
                action.shared_options.append(groups[group.title]._add_action(shared))
    return action.shared_options


def chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the command (and action) that parsed args, e.g. the one of `kvstore inspect stats`."""
    for subparsers in parser._actions:
        name = getattr(args, subparsers.dest, None)
        if isinstance(subparsers, argparse._SubParsersAction) and name in subparsers.choices:
            return chosen_parser(subparsers.choices[name], args)
    return parser


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse argv; arguments nobody takes are a usage error of the command they were given to."""
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "any_arguments", False):
        chosen_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    return args


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
    import asyncio
    import logging

    config = serve_config(args)
    from kvstore.server.node import run_serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def ready(api: str, admin: str) -> None:
        name = config.server.served_model_name or config.model
        print(f"kvstore serve: {name} ready on {api} (OpenAI API: /v1/completions, "
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
    parser = CommandParser(prog="kvstore", description=DESCRIPTION, epilog=EPILOG,
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
        args = parse_command_line(build_parser(), argv)
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
