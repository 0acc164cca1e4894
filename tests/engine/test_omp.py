"""One OpenMP team in the process: the thread that builds the engine hands its team back, so that
the engine thread's is the only one (engine/omp.py). Threads are counted in a child process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import requires


def needs_linux() -> None:
    requires(sys.platform.startswith("linux"), "these tests count threads in /proc/self/task (Linux)")

_PRELUDE = """
import os, torch
torch.set_num_threads(2)
threads = lambda: len(os.listdir("/proc/self/task"))
parallel = lambda: (torch.ones(1 << 22) + 1).sum()     # large enough for PyTorch to split
"""


def child(body: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_PRELUDE) + textwrap.dedent(body)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return [int(x) for x in out.stdout.split()]


def test_release_ends_the_threads_team_and_a_later_op_makes_a_new_one():
    needs_linux()
    from engine.omp import release_thread_team
    requires(release_thread_team(), "no OpenMP runtime with omp_pause_resource_all in this PyTorch")
    with_team, released, again = child("""
        from engine.omp import release_thread_team
        parallel()
        a = threads()
        assert release_thread_team()
        b = threads()
        parallel()
        print(a, b, threads())
    """)
    assert released == with_team - 1 and again == with_team


def test_building_the_engine_leaves_its_thread_without_a_team():
    needs_linux()
    from engine.omp import release_thread_team
    requires(release_thread_team(), "no OpenMP runtime with omp_pause_resource_all in this PyTorch")
    built, after_op = child("""
        import tempfile
        from engine import LLM
        parallel()                                     # the team exists before the engine is built
        llm = LLM("tiny", data_dir=tempfile.mkdtemp(), hot__pool="8MiB", warm__bytes="8MiB")
        a = threads()
        parallel()                                     # the first parallel op after it makes a team again
        print(a, threads())
        llm.close()
    """)
    assert after_op == built + 1
