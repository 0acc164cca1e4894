"""The `kvstore` command (the console script): the store's commands plus the application's
(`serve`, `job`), all reading one config tree (app.api.config.Config: the store's, the engine's and
the API's sections)."""

from __future__ import annotations

from app.api.config import Config
from kvstore import cli

# in the order `kvstore --help` lists them
COMMANDS: tuple = (*cli.COMMANDS[:4], ("serve", "app.serve"), *cli.COMMANDS[4:], ("job", "app.job.cli"))


def build_parser():
    """The `kvstore` command line (an argparse parser)."""
    return cli.build_parser(COMMANDS, Config)


def main(argv: list[str] | None = None) -> int:
    """Run the `kvstore` command; returns the exit code."""
    return cli.main(argv, COMMANDS, Config)
