"""The `kvstore` command: help for every command, one-line errors."""

from __future__ import annotations

import os

import pytest

from kvstore.cli import main

COMMANDS = ["plan", "config", "fsck", "bench", "serve", "inspect", "sidecar", "job"]


def test_top_level_help_names_every_command(kvstore_cli):
    out = kvstore_cli("--help")
    assert out.returncode == 0, out.stderr
    for command in COMMANDS:
        assert f"\n    {command} " in out.stdout, command
    assert "KVSTORE_" in out.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_command_help(command, capsys):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: kvstore {command}")


def test_job_with_a_missing_input_is_one_line(kvstore_cli, tmp_path):
    out = kvstore_cli("job", "run", str(tmp_path / "x.jsonl"), "--out", str(tmp_path / "a.jsonl"))
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "x.jsonl" in out.stderr and "Traceback" not in out.stderr


def test_serve_bad_port_is_one_line(kvstore_cli):
    out = kvstore_cli("serve", "--model", "tiny", "--port", "99999")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "server.port" in out.stderr and "Traceback" not in out.stderr


def test_version(capsys):
    from kvstore import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kvstore {__version__}"


def test_no_command_is_a_usage_error(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().err


def test_unknown_command_is_a_usage_error(capsys):
    assert main(["frobnicate"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_user_error_in_process_is_one_line(capsys, monkeypatch):
    for name in [n for n in os.environ if n.startswith("KVSTORE_")]:
        monkeypatch.delenv(name)
    assert main(["config", "--set", "page_size=12"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvstore: error: page_size") and err.count("\n") == 1


def test_a_command_module_that_cannot_be_imported_is_reported(monkeypatch, capsys):
    import kvstore.cli

    real = kvstore.cli.importlib.import_module

    def import_module(name):
        if name == "kvstore.bench":
            raise ImportError("No module named 'lmdb'")
        return real(name)

    monkeypatch.setattr(kvstore.cli.importlib, "import_module", import_module)
    assert main(["bench", "tiers", "--pages", "1"]) == 2
    err = capsys.readouterr().err
    assert err == "kvstore bench: unavailable in this build (kvstore.bench cannot be imported: " \
                  "No module named 'lmdb')\n"
