"""Small native libraries built for this machine: compiled once with the system's C++ compiler
(`$CXX`, else c++, g++ or clang++) into the user's cache (~/.cache/kvstore/kernels, named by a
hash of the sources, the flags, the compiler and the CPU) and loaded with ctypes. No Python or
PyTorch headers, so a build takes a second or less; `scripts/bootstrap` builds them ahead.

Users: the engine's CPU attention kernels (engine/attention/native.py) and the cold tier's
checksummed copy (kvstore/pages/native_copy.py). Each says what it falls back to when a build
cannot be had (NotBuilt, whose message names what is missing).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Sequence

from kvstore.errors import NotBuilt

log = logging.getLogger("kvstore.native")


def compiler() -> str | None:
    """The C++ compiler to build with, or None when the machine has none."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them in /proc/cpuinfo (avx2, avx512f, ..); empty where
    they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line.split(":", 1)[1] for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


def _cpu() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(lines))   # the first CPU's lines


def library_path(name: str, cxx: str, inputs: Sequence[Path], args: Sequence[str]) -> Path:
    """Where library `name`, built by `cxx` from `inputs` with `args`, lives for this CPU."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    digest = hashlib.sha256(b"\0".join([*(f.read_bytes() for f in inputs), " ".join(args).encode(),
                                        version.encode(), _cpu().encode()])).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kvstore" / "kernels" / f"{name}-{digest}.so"


def build(name: str, what: str, sources: Sequence[Path], headers: Sequence[Path] = (),
          flags: Sequence[str] = (), libs: Sequence[str] = (), remedy: str = "") -> Path:
    """The shared library `name` (`what` it is, for messages), compiled from `sources` now unless it
    already is. NotBuilt, naming the cause and then `remedy`, when it cannot be."""
    cxx = compiler()
    suffix = f"; {remedy}" if remedy else ""
    if cxx is None:
        raise NotBuilt(f"{what} needs a C++ compiler (c++, g++ or clang++; or set CXX){suffix}")
    args = [*flags, "-fPIC", "-shared"]
    path = library_path(name, cxx, [*sources, *headers], [*args, *libs])
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run([cxx, *args, "-o", tmp, *map(str, sources), *libs], capture_output=True, text=True)
        if done.returncode:
            lines = (done.stderr or done.stdout).strip().splitlines() or ["(no output)"]
            why = next((ln for ln in lines if "error" in ln), lines[-1])   # not the notes after it
            raise NotBuilt(f"building {what} failed ({Path(cxx).name}): {why.strip()}{suffix}")
        os.replace(tmp, path)   # atomic: a concurrent build leaves one whole library
        log.info("built %s: %s", what, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def report(what: str, built: Callable[[], object]) -> int:
    """A `python -m` entry point's body: build `what` with `built()` (if needed) and print where it
    is (0), or why it cannot be had (1)."""
    try:
        where = built()
    except NotBuilt as exc:
        print(f"{what}: not built: {exc}")
        return 1
    print(f"{what}: {where}")
    return 0
