"""The plugin's tests run in the vLLM venv (scripts/bootstrap_vllm), against real vLLM CPU and a
real `kvstore sidecar`. Two engine runs (with and without the connector) are shared by the tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    from kvstore_vllm.testing import make_model
    return make_model(tmp_path_factory.mktemp("model") / "tiny-llama")


def _start(model: Path, work: Path, mode: str) -> subprocess.Popen:
    work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return subprocess.Popen([sys.executable, str(HERE / "drive.py"), str(model), str(work), mode],
                            stdout=open(work / "stdout.txt", "w"), stderr=open(work / "stderr.txt", "w"), env=env)


def _result(proc: subprocess.Popen, work: Path) -> tuple[list[dict], str]:
    code = proc.wait(900)
    out = (work / "stdout.txt").read_text()
    assert code == 0, f"drive.py exited with {code}:\n{out[-4000:]}\n{(work / 'stderr.txt').read_text()[-4000:]}"
    return json.loads(out.strip().splitlines()[-1]), out


@pytest.fixture(scope="session")
def runs(model_dir, tmp_path_factory):
    """(baseline rows, connector rows, its vLLM log, connector-sync rows, its log); the engines run at once."""
    base = tmp_path_factory.mktemp("baseline")
    # a short directory: the sidecar's socket path must stay under 108 bytes
    conn, sync = Path(tempfile.mkdtemp(prefix="kvv-")), Path(tempfile.mkdtemp(prefix="kvs-"))
    procs = [_start(model_dir, base, "baseline"), _start(model_dir, conn, "connector"),
             _start(model_dir, sync, "connector-sync")]
    (baseline, _), (connector, log), (synced, sync_log) = (_result(procs[0], base), _result(procs[1], conn),
                                                           _result(procs[2], sync))
    return baseline, connector, log, synced, sync_log
