"""The plugin's tests run in the SGLang venv (scripts/bootstrap_sglang): SGLang's own HiCacheController
on the CPU, in this process, over a real `kvstore sidecar` child process."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture
def workdir():
    """A short directory (a Unix socket path must stay under 108 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="kvsg-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sidecar(workdir):
    from kvstore_sglang.testing import Sidecar

    sc = Sidecar(workdir / "data", workdir / "kv.sock")
    yield sc
    sc.kill()
    assert "Traceback" not in sc.log(), sc.log()


@pytest.fixture
def controllers():
    """Controllers made by a test; their storage threads are stopped after it."""
    made = []
    yield made
    for c in made:
        c.close()
