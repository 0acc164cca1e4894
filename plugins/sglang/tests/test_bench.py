"""scripts/bench_sglang's benchmark, at a tiny size: one JSON report naming both backends."""

from __future__ import annotations

import json
import subprocess
import sys


def test_report_of_kvstore_and_the_file_backend():
    done = subprocess.run([sys.executable, "-m", "kvstore_sglang.bench", "--pages", "4", "--rounds", "2",
                           "--layers", "2", "--heads", "2", "--head-dim", "32", "--page-size", "16"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["exact"] is True
    for field in ("backup_gbps", "prefetch_gbps", "prefetch_again_gbps"):
        assert set(report[field]) == {"kvstore", "file"} and all(v > 0 for v in report[field].values())
    assert set(report["ratio_kvstore_over_file"]) == {"backup", "prefetch", "prefetch_again"}
    assert report["kvstore_cold_prefetch_gbps"] > 0
    assert all(len(t) == 2 for ops in report["seconds"].values() for t in ops.values())


def test_bad_argument_is_a_one_line_error():
    done = subprocess.run([sys.executable, "-m", "kvstore_sglang.bench", "--pages", "0"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "--pages must be at least 1" in done.stderr and "Traceback" not in done.stderr
