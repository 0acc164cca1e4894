"""Crash safety of the cold tier: SIGKILL a writer again and again, lose nothing acknowledged.

A child (cold_crash_writer.py) streams chained pages into one store and prints each page
once its put future resolved. The parent kills it with SIGKILL at a random moment, twelve
times on the same directory; each run continues the chain. After every kill the store must
pass fsck and every acknowledged page must read back byte-identical.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore.tools import fsck

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cold_crash_writer as writer  # noqa: E402  (the child's page recipe)

REPO = Path(__file__).resolve().parent.parent
WRITER = Path(writer.__file__).resolve()
KILLS = 12
MIN_ACKED = 3          # pages a run must acknowledge before it may be killed

needs = (hasattr(signal, "SIGKILL"), "needs SIGKILL")
pytestmark = pytest.mark.usefixtures("requires_part")


def run_and_kill(store: Path, start: int, delay: float) -> list[tuple[int, str]]:
    """Run the writer from page `start`, SIGKILL it `delay` s after MIN_ACKED acks; its acks."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, str(WRITER), str(store), str(start)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    acked: list[tuple[int, str]] = []
    enough = threading.Event()

    def collect() -> None:
        for line in proc.stdout:          # lines are whole: printed and flushed one put at a time
            if line.endswith("\n"):
                index, key = line.split()
                acked.append((int(index), key))
                if len(acked) >= MIN_ACKED:
                    enough.set()
        enough.set()                      # EOF: the child died by itself

    reader = threading.Thread(target=collect, daemon=True)
    reader.start()
    try:
        assert enough.wait(timeout=60), "the writer acknowledged nothing within 60 s"
        assert proc.poll() is None, f"the writer exited early: {proc.stderr.read()}"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
        reader.join(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    return acked


def test_sigkill_loses_no_acknowledged_page(tmp_path):
    store = tmp_path / "cold"
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    acked: dict[int, str] = {}
    parent = writer.NS.digest
    expected_keys: list[str] = []         # key of page i, recomputed here
    out = np.empty(writer.SPEC.page_bytes, np.uint8)

    for run in range(KILLS):
        start = max(acked) + 1 if acked else 0
        delay = rng.choice([0.0, rng.uniform(0, 0.05), rng.uniform(0.05, 0.4)])
        new = run_and_kill(store, start, delay)
        assert new and new[0][0] == start and [i for i, _ in new] == list(range(start, start + len(new)))
        acked.update(new)

        report = fsck.check(store, writer.SPEC.fingerprint)
        context = f"run {run}, seed {seed}, delay {delay:.3f}"
        assert report.damaged == [], context
        assert report.orphans == 0 and report.foreign == 0, context
        assert report.total >= len(acked), context

        while len(expected_keys) <= max(acked):
            parent = writer.key_of(len(expected_keys), parent)
            expected_keys.append(parent.hex())
        with writer.open_store(str(store)) as tier:
            for i, key_hex in acked.items():
                assert key_hex == expected_keys[i], context
                tokens, payload = writer.page(i)
                ok = tier.read(bytes.fromhex(key_hex), writer.NS.digest, np.asarray(tokens, "<i4").tobytes(),
                               writer.SPEC.fingerprint, out)
                assert ok, f"{context}: acknowledged page {i} unreadable ({tier.last_error or 'missing'})"
                assert np.array_equal(out, payload), f"{context}: page {i} differs"
    assert len(acked) >= KILLS * MIN_ACKED
