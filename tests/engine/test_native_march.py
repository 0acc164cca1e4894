"""The native kernels built for another CPU (KVSTORE_KERNEL_MARCH): the AVX2 build (x86-64-v3: 8-lane
vectors and a register blocking of its own) holds the kernels' tests, the parity tests against
transformers and the scheduler state machine on an AVX-512 machine too; a -march the compiler
refuses is a one-line error, with `auto` falling back to sdpa."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch

from conftest import REPO, clean_env, requires
from engine.attention import create_backend
from kvstore.errors import ConfigError
from kvstore.native import cpu_flags


def with_march(march: str | None, *args: str) -> subprocess.CompletedProcess:
    """This Python run with `args` here, the kernels built for -march=`march` (None: this CPU's own)."""
    env = clean_env(**({"KVSTORE_KERNEL_MARCH": march} if march else {}))
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_the_avx2_build_passes_the_native_tests():
    requires({"avx2", "fma"} <= cpu_flags(), "the AVX2 build needs an x86-64 CPU with AVX2 and FMA")
    where = with_march("x86-64-v3", "-c", "from engine.attention import native; print(native.build())")
    assert where.returncode == 0, where.stderr
    default = with_march(None, "-c", "from engine.attention import native; print(native.build())")
    if "avx512f" in cpu_flags():   # a library of its own, not the one built for this CPU
        assert where.stdout.strip() != default.stdout.strip()
    done = with_march("x86-64-v3", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/engine/test_attention.py",
                      "tests/engine/test_native_ops.py", "tests/engine/test_hf_parity.py", "tests/engine/test_real_model.py",
                      "tests/engine/test_scheduler_machine.py")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout


def test_a_march_the_compiler_refuses_is_a_clear_error(monkeypatch, tmp_path):
    from engine.attention import native
    from engine.attention.sdpa import SdpaBackend
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("KVSTORE_KERNEL_MARCH", "no-such-cpu")
    with pytest.raises(ConfigError, match="KVSTORE_KERNEL_MARCH") as exc:
        create_backend("native", torch.device("cpu"), torch.float32, 64)
    assert "\n" not in str(exc.value) and "no-such-cpu" in str(exc.value)
    assert isinstance(create_backend("auto", torch.device("cpu"), torch.float32, 64), SdpaBackend)


def test_a_march_beyond_this_cpu_is_refused_before_it_could_crash(monkeypatch, tmp_path):
    """On an AVX2 CPU (its flags as /proc/cpuinfo would show them) a build for AVX-512 is refused: the
    library would die of an illegal instruction at its first call."""
    requires(platform.machine() == "x86_64", "x86-64's -march names and instruction sets")
    from engine.attention import native
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "cpu_flags", lambda: {"sse2", "avx", "avx2", "fma"})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("KVSTORE_KERNEL_MARCH", "skylake-avx512")
    with pytest.raises(ConfigError, match="KVSTORE_KERNEL_MARCH=skylake-avx512 builds the native kernels for avx512f"):
        create_backend("native", torch.device("cpu"), torch.float32, 64)
    monkeypatch.setenv("KVSTORE_KERNEL_MARCH", "x86-64-v3")   # within this CPU: built
    assert isinstance(create_backend("native", torch.device("cpu"), torch.float32, 64), native.NativeBackend)
