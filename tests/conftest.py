"""Shared test helpers: markers, and running the `kvstore` command in a child process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.native import cpu_flags

REPO = Path(__file__).resolve().parent.parent


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than a few seconds; deselect with -m 'not slow'")


def clean_env(**extra: str) -> dict[str, str]:
    """The current environment without KVSTORE_* variables, able to import this checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def unavailable(reason: str) -> None:
    """A part of the suite this machine cannot run (no vLLM venv, no tmpfs mount, no Chromium, no
    package index): a failure that names it, in every run, so that a broken or missing part never
    hides behind a skip. A developer without the part leaves its tests out by name (`-k`, `--deselect`)."""
    pytest.fail(f"{reason} (leave the test out by name where this machine cannot have it: -k or --deselect)")


def requires(available: bool, reason: str) -> None:
    """unavailable(reason) unless the part is available: for a test's first line."""
    if not available:
        unavailable(reason)


def import_or_unavailable(module: str):
    """The imported module, or unavailable (skipped in a subset, a failure in the full run)."""
    try:
        return __import__(module)
    except ImportError as exc:
        unavailable(f"{module} cannot be imported ({exc}); pip install -e '.[dev]' installs it")


# The CPU flag each one-pass read of kvstore.pages.native_copy needs, by its level there (ONE_PASS).
ONE_PASS_FLAGS = {2: "avx512f", 1: "avx2"}


def one_pass_levels() -> list[int]:
    """The one-pass read levels this CPU's flags (as Linux reports them in /proc/cpuinfo) allow,
    widest first: the native copy must run each of them. None where the flags cannot be read."""
    flags = cpu_flags()
    return [level for level, flag in sorted(ONE_PASS_FLAGS.items(), reverse=True) if flag in flags]


@pytest.fixture
def mooncake_master(tmp_path):
    """A mooncake_master with its HTTP metadata server on free loopback ports, stopped after the test."""
    import mooncakeutil
    master = mooncakeutil.MooncakeMaster(tmp_path / "master")
    yield master
    master.stop()


@pytest.fixture
def requires_part(request):
    """A module's `needs = (available, reason)` applied to each of its tests (see requires)."""
    requires(*request.module.needs)


def terminate(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM a child process and wait for it; SIGKILL it after grace_s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def kvstore_cli():
    """Run the `kvstore` command (`python -m app ARGS...`) in a child process; returns the CompletedProcess."""
    def run(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None):
        return subprocess.run([sys.executable, "-m", "app", *map(str, args)], capture_output=True,
                              text=True, env=clean_env(**(env or {})), cwd=cwd or REPO, timeout=120)
    return run
