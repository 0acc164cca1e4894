"""The `kvstore` command.

Each command module exposes `add_parser(subparsers)`, which registers its subcommand with
`set_defaults(func=run)`, and `run(args) -> int`. Commands that read the config add the shared
options with `kvstore.config.add_config_options(parser)` and build the config with
`kvstore.config.config_from_args(args)`, of the tree the command line was built for. This module
holds the store's commands; the application (app.cli) adds `serve` and `job`, and its config
tree, and is what the `kvstore` console script runs.
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
from kvstore.config import Config, add_config_options, config_from_args, reference_rows
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


def _run_config(args: argparse.Namespace) -> int:
    if args.keys:
        rows = [("KEY", "ENVIRONMENT", "DEFAULT", "ALLOWED")] + reference_rows(args.config_root)
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        for row in rows:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[3])
        return 0
    import yaml

    cfg = config_from_args(args)
    print("# effective kvstore config: defaults < file < KVSTORE_* env < flags")
    print(yaml.safe_dump(cfg.to_dict(redact=True), sort_keys=False), end="")
    return 0


def add_config_command(subparsers) -> None:
    p = subparsers.add_parser("config", help="print the effective config as YAML (--keys: list every key)",
                              description="Print the effective config (after file, environment and flags) "
                                          "as YAML, or with --keys every key with its environment variable, "
                                          "default and allowed values.")
    add_config_options(p)
    p.add_argument("--keys", action="store_true", help="list every key, its env variable and allowed values")
    p.set_defaults(func=_run_config)


def _add_module_command(subparsers, module_name: str, name: str) -> None:
    """Register a module's subcommand; if the module cannot be imported, a stub that says so."""
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        why = f"{module_name} cannot be imported: {exc}"
        p = subparsers.add_parser(name, help=f"(unavailable in this build: {exc})")
        p.set_defaults(func=lambda args: _unavailable(name, why), any_arguments=True)
        return
    module.add_parser(subparsers)


def _unavailable(name: str, why: str) -> int:
    print(f"kvstore {name}: unavailable in this build ({why})", file=sys.stderr)
    return 2


# The store's commands, in the order `kvstore --help` lists them: (name, the module whose add_parser
# registers it, or a function that does). An application adds its own (app.cli).
COMMANDS: tuple = (("plan", "kvstore.tools.plan"), ("config", add_config_command), ("fsck", "kvstore.tools.fsck"),
                   ("bench", "kvstore.tools.bench"), ("inspect", "kvstore.tools.inspect"),
                   ("sidecar", "kvstore.sidecar.command"))


def build_parser(commands: tuple = COMMANDS, config_root: type[Config] = Config,
                 only: str | None = None) -> argparse.ArgumentParser:
    """The `kvstore` command line with `commands`, whose config is the tree `config_root`. With
    `only`, that command alone is registered: the other modules (torch, the store...) are not
    imported, so a command starts at once."""
    parser = CommandParser(prog="kvstore", description=DESCRIPTION, epilog=EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"kvstore {__version__}")
    parser.set_defaults(config_root=config_root)
    subparsers = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND", required=True)
    for name, target in commands:
        if only is not None and name != only:
            continue
        if callable(target):
            target(subparsers)
        else:
            _add_module_command(subparsers, target, name)
    return parser


def chosen_command(argv: list[str], commands: tuple) -> str | None:
    """The command argv names (the first word that is not an option), if it is one of `commands`."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return first if first in {name for name, _ in commands} else None


def _error(message: str) -> int:
    print(f"kvstore: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None, commands: tuple = COMMANDS, config_root: type[Config] = Config) -> int:
    """Run the `kvstore` command; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_command_line(build_parser(commands, config_root, chosen_command(argv, commands)), argv)
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
