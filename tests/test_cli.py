"""The `kvstore` command: help for every command, one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from app.cli import main
from conftest import clean_env

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
        if name == "kvstore.tools.bench":
            raise ImportError("No module named 'lmdb'")
        return real(name)

    monkeypatch.setattr(kvstore.cli.importlib, "import_module", import_module)
    assert main(["bench", "tiers", "--pages", "1"]) == 2
    err = capsys.readouterr().err
    assert err == "kvstore bench: unavailable in this build (kvstore.tools.bench cannot be imported: " \
                  "No module named 'lmdb')\n"


# usage errors: (argv, a part of the message, the command named in the hint)
MISTAKES = [
    ([], "the following arguments are required: COMMAND", "kvstore"),
    (["frobnicate"], "argument COMMAND: invalid choice: 'frobnicate'", "kvstore"),
    (["config", "--bogus"], "unrecognized arguments: --bogus", "kvstore config"),
    (["plan", "--context", "x", "--concurrency", "1"], "argument --context: invalid int value: 'x'", "kvstore plan"),
    (["plan", "--context", "8"], "the following arguments are required: --concurrency", "kvstore plan"),
    (["fsck", "--repair", "--bogus"], "unrecognized arguments: --bogus", "kvstore fsck"),
    (["bench"], "the following arguments are required: BENCHMARK", "kvstore bench"),
    (["bench", "nope"], "argument BENCHMARK: invalid choice: 'nope'", "kvstore bench"),
    (["bench", "tiers", "--pages", "x"], "argument --pages: invalid int value: 'x'", "kvstore bench tiers"),
    (["bench", "tiers", "--device", "tpu"], "argument --device: invalid choice: 'tpu'", "kvstore bench tiers"),
    (["serve", "--port"], "argument --port: expected one argument", "kvstore serve"),
    (["serve", "--model", "tiny", "extra"], "unrecognized arguments: extra", "kvstore serve"),
    (["sidecar", "--bogus"], "unrecognized arguments: --bogus", "kvstore sidecar"),
    (["inspect"], "the following arguments are required: ACTION", "kvstore inspect"),
    (["inspect", "--json"], "the following arguments are required: ACTION", "kvstore inspect"),
    (["inspect", "frob"], "argument ACTION: invalid choice: 'frob'", "kvstore inspect"),
    (["inspect", "--timeout", "soon", "stats"], "argument --timeout: invalid float value: 'soon'", "kvstore inspect"),
    (["inspect", "stats", "--timeout", "soon"], "argument --timeout: invalid float value: 'soon'",
     "kvstore inspect stats"),
    (["inspect", "stats", "--bogus"], "unrecognized arguments: --bogus", "kvstore inspect stats"),
    (["inspect", "pages", "--limit", "x"], "argument --limit: invalid int value: 'x'", "kvstore inspect pages"),
    (["inspect", "page"], "the following arguments are required: key", "kvstore inspect page"),
    (["inspect", "evict", "ab"], "the following arguments are required: --to", "kvstore inspect evict"),
    (["inspect", "flush", "lukewarm"], "argument tier: invalid choice: 'lukewarm'", "kvstore inspect flush"),
    (["job"], "the following arguments are required: COMMAND", "kvstore job"),
    (["job", "walk"], "argument COMMAND: invalid choice: 'walk'", "kvstore job"),
    (["job", "run", "in.jsonl"], "the following arguments are required: --out", "kvstore job run"),
    (["job", "run", "in.jsonl", "--out", "a.jsonl", "--bogus"], "unrecognized arguments: --bogus", "kvstore job run"),
]
# one of each kind and depth, also as a process of its own
IN_A_PROCESS = [0, 1, 3, 8, 18, 19, 25]


def _assert_usage_error(err: str, part: str, command: str) -> None:
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert err.startswith("kvstore: error: ") and part in err, err
    assert err.endswith(f" (see {command} --help)\n"), err


@pytest.mark.parametrize("argv, part, command", MISTAKES)
def test_usage_errors_are_one_line(argv, part, command, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    _assert_usage_error(err, part, command)


@pytest.mark.parametrize("argv, part, command", [MISTAKES[i] for i in IN_A_PROCESS])
def test_usage_errors_of_the_process(argv, part, command, kvstore_cli):
    out = kvstore_cli(*argv)
    assert out.returncode == 2 and out.stdout == ""
    assert "Traceback" not in out.stderr
    _assert_usage_error(out.stderr, part, command)


@pytest.mark.parametrize("argv", [["inspect", "stats"], ["inspect", "pin"], ["bench", "tiers"], ["job", "run"]])
def test_action_help(argv, capsys):
    assert main([*argv, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: kvstore {' '.join(argv)}") and "--help" in out
    if argv[0] == "inspect":    # the command's options are listed with the action's
        assert "--json" in out and "--url URL" in out and "--set KEY=VALUE" in out


def _toy_parser():
    from kvstore.cli import CommandParser

    parser = CommandParser(prog="toy")
    parser.add_argument("--level", type=int, default=1)
    parser.add_argument("--tag", action="append", default=[])
    parser.add_argument("--name")
    actions = parser.add_subparsers(dest="action", required=True)
    actions.add_parser("go").add_argument("target")
    stop = actions.add_parser("stop")
    stop.add_argument("--level", default="own")   # an action's own option of the same name is not replaced
    return parser


def test_a_commands_options_go_before_or_after_its_action():
    parser = _toy_parser()
    before = parser.parse_args(["--level", "3", "--tag", "a", "--name", "n", "go", "x"])
    after = parser.parse_args(["go", "x", "--level", "3", "--tag", "a", "--name", "n"])
    assert vars(before) == vars(after) == {"level": 3, "tag": ["a"], "name": "n", "action": "go", "target": "x"}
    assert vars(parser.parse_args(["--name", "n", "go", "x", "--level", "3", "--tag", "a"])) == vars(before)
    both = parser.parse_args(["--tag", "a", "--level", "2", "--name", "n", "go", "x", "--tag", "b", "--level", "5"])
    assert both.tag == ["a", "b"] and both.level == 5
    plain = parser.parse_args(["go", "x"])
    assert plain.level == 1 and plain.tag == [] and plain.name is None
    assert parser.parse_args(["--name", "n", "stop", "--level", "4"]).level == "4"


def test_serve_flags_set_config_keys(monkeypatch):
    from app.cli import build_parser
    from app.serve import serve_config

    for name in [n for n in os.environ if n.startswith("KVSTORE_")]:
        monkeypatch.delenv(name)
    args = build_parser().parse_args(["serve", "--served-model-name", "acme-7b", "--api-key", "s3cret",
                                      "--max-model-len", "4096", "--host", "0.0.0.0", "--port", "0"])
    config = serve_config(args)
    assert config.server.served_model_name == "acme-7b" and config.server.api_key == "s3cret"
    assert config.max_seq_len == 4096 and config.server.host == "0.0.0.0" and config.server.port == 0
    default = serve_config(build_parser().parse_args(["serve"]))
    assert default.server.served_model_name == "" and default.server.api_key == "" and default.max_seq_len == 8192


def test_serve_bad_max_model_len_is_one_line(kvstore_cli):
    out = kvstore_cli("serve", "--max-model-len", "0")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("kvstore: error: max_seq_len")


def test_serve_help_names_the_api():
    from app.serve import SERVE_DESCRIPTION

    for endpoint in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize",
                     "/version", "/health", "/metrics", "server.api_keys", "server.trust_tenant_header"):
        assert endpoint in SERVE_DESCRIPTION, endpoint


@pytest.mark.parametrize("argv", [["config", "--keys"], ["job", "run", "--help"], ["plan", "--help"],
                                  ["inspect", "stats", "--help"]])
def test_a_command_starts_without_loading_torch(argv):
    """Only the chosen command's module is imported, and the config does not need torch: a
    command (a job's progress bar) shows up at once, not after a second or two of imports."""
    code = f"import sys; from app.cli import main; main({argv!r}); print('torch' in sys.modules, file=sys.stderr)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=120)
    assert proc.stderr.strip().splitlines()[-1] == "False", proc.stderr
