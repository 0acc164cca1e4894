"""The `kvstore` command (the console script): the store's commands plus the application's
(`serve`, `job`), all reading the engine's config tree (engine.config.Config)."""

from __future__ import annotations

from engine.config import Config
from kvstore import cli

# in the order `kvstore --help` lists them
COMMANDS: tuple = ("kvstore.tools.plan", cli.add_config_command, "kvstore.tools.fsck", "kvstore.tools.bench",
                   "app.serve", "kvstore.tools.inspect", "kvstore.sidecar.command", ("app.job.cli", "job"))


def build_parser():
    """The `kvstore` command line (an argparse parser)."""
    return cli.build_parser(COMMANDS, Config)


def main(argv: list[str] | None = None) -> int:
    """Run the `kvstore` command; returns the exit code."""
    return cli.main(argv, COMMANDS, Config)
