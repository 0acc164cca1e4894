"""One OpenMP thread team at a time: the engine's.

Every thread that runs a parallel PyTorch op (or a native kernel) gets an OpenMP team of its own,
whose worker threads live as long as that thread. With more OpenMP threads in the process than
CPUs, libgomp stops letting idle workers spin: each of the engine's hundreds of parallel regions a
step then waits for its workers to be woken. On two cores with two engine threads, a model loaded
on the main thread and served from the engine thread decoded at 120 tokens/s against 206 on one
thread (decode 8 x 128, SmolLM2-135M).

So the thread that loads the model hands its team back when it is done (`release_thread_team`),
the engine thread makes the one team the process keeps, and the store's threads copy without
PyTorch (kvstore/tiers/buffers.py: copy_serial).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import logging
import os

import torch

log = logging.getLogger("kvstore.engine")

_PAUSE_SOFT = 1         # omp_pause_soft: the thread's team ends; a later parallel region makes a new one


@functools.cache
def _pause_function():
    """omp_pause_resource_all of the OpenMP runtime PyTorch loaded (None when there is none to find)."""
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for path in [None, *sorted(glob.glob(os.path.join(lib_dir, "lib*omp*.so*")))]:
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    log.debug("no OpenMP runtime with omp_pause_resource_all found; thread teams stay")
    return None


def release_thread_team() -> bool:
    """End the calling thread's OpenMP team, if it has one: its worker threads exit. True when the
    runtime did it (a thread without a team also gives True); False when there is no way here."""
    fn = _pause_function()
    return fn is not None and fn(_PAUSE_SOFT) == 0
