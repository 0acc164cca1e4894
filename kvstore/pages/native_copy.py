"""The cold tier's checksummed copy in one native call a batch (copy_hash.cpp), where it can be had.

record.copy_payloads hands a batch of records to `copy_hash`: each page is copied out and hashed
chunk by chunk in C, with the GIL released for the whole batch, so the read threads of a
`read_many` run side by side instead of taking turns at the interpreter between chunks. xxhash
itself is the one python-xxhash carries (its extension module exports xxhash's C functions; its
`_dispatch` ones pick AVX2 or AVX-512 at run time): 1.4x the speed of the system's libxxhash
0.8.1 on a page in L2 cache (BENCHMARKS.md), and always there. Where that module does not export
them, the system's libxxhash (a dependency of apt on Debian and Ubuntu) is used. The library is
built like the engine's kernels (kvstore.native). When neither xxhash nor a compiler can be had, or
the native digest of a test buffer differs from python-xxhash's, `copier()` is None (one log line
says why) and records are copied in Python, more slowly, with the same checks.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from pathlib import Path

import numpy as np
import xxhash

from kvstore.errors import NotBuilt
from kvstore.native import build, report

log = logging.getLogger("kvstore.native")

SOURCE = Path(__file__).with_name("copy_hash.cpp")
FLAGS = ("-O2", "-std=c++17")
VERSION = 3   # kv_copy_hash_version() of the source
_FUNCTIONS = ("XXH3_createState", "XXH3_freeState", "XXH3_128bits_reset", "XXH3_128bits_update",
              "XXH3_128bits_digest")


class _XxhFunctions(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("create", "release", "reset", "update", "digest")]


class NativeCopy:
    """copy_hash.cpp loaded, with xxhash's C functions; `copy_hash` is thread-safe."""

    def __init__(self, lib, xxh):
        self.lib = lib
        self.xxh = xxh          # kept: its functions are called from C
        update = getattr(xxh, "XXH3_128bits_update_dispatch", None) or xxh.XXH3_128bits_update
        fns = [getattr(xxh, name) for name in _FUNCTIONS]
        fns[3] = update
        self.functions = _XxhFunctions(*(ctypes.cast(fn, ctypes.c_void_p).value for fn in fns))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.kv_copy_hash.argtypes = [p, ctypes.c_int, i64, i64, p, p, p, p, p, i64, i64, p, p]
        lib.kv_copy_hash.restype = ctypes.c_int

    def copy_hash(self, values: np.ndarray, heads: np.ndarray, srcs: np.ndarray, dsts: np.ndarray, nbytes: int,
                  chunk: int, lmdb_file: tuple[int, int] | None = None) -> tuple[bytes, np.ndarray]:
        """Copy page i (nbytes at address srcs[i]) to dsts[i]; returns the xxh3-128 digest of each
        record's head (heads[i] up to srcs[i]) and copied page, 16 bytes each, and whether each page
        came from the file: with `lmdb_file` (fd, page size) the records are values in an LMDB map
        of that file (values[i]: where record i starts), and a page in LMDB's overflow pages is read
        from the file (pread), any other from the map. The addresses must stay valid (and the
        targets unshared) until this returns."""
        n = len(srcs)
        digests = np.empty(16 * n, np.uint8)
        from_file = np.zeros(n, np.uint8)
        fd, psize = lmdb_file or (-1, 0)
        arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in (values, heads, srcs - heads, srcs, dsts)]
        rc = self.lib.kv_copy_hash(ctypes.addressof(self.functions), fd, psize, n, *(a.ctypes.data for a in arrays),
                                   nbytes, chunk, digests.ctypes.data, from_file.ctypes.data)
        if rc:
            raise MemoryError("xxhash could not allocate its state")
        return digests.tobytes(), from_file.astype(bool)


_lock = threading.Lock()
_copier: NativeCopy | None | bool = False   # False: not tried yet
why_not = ""                                 # why it is None


def copier() -> NativeCopy | None:
    """The native copy, loaded (and built) on first use; None where it cannot be had."""
    global _copier, why_not
    with _lock:
        if _copier is False:
            try:
                _copier = _load()
            except (NotBuilt, OSError, AttributeError) as exc:
                why_not = str(exc)
                log.info("checksummed cold reads run in Python: %s", why_not)
                _copier = None
        return _copier


def _xxhash_library() -> ctypes.CDLL:
    """python-xxhash's extension module where it exports xxhash's functions, else the system's libxxhash."""
    try:
        from xxhash import _xxhash   # python-xxhash's extension module
        own = ctypes.CDLL(_xxhash.__file__)   # loaded already: this only looks its symbols up
        for name in (*_FUNCTIONS, "XXH3_128bits_update_dispatch"):
            getattr(own, name)
        return own
    except (ImportError, OSError, AttributeError):
        pass
    try:
        return ctypes.CDLL("libxxhash.so.0")
    except OSError:
        name = ctypes.util.find_library("xxhash")   # runs ldconfig: only where the usual name is not found
        if name is None:
            raise NotBuilt("python-xxhash exports no xxhash functions and the system's xxhash library "
                           "(libxxhash.so.0) is not installed (Debian: libxxhash0)") from None
        return ctypes.CDLL(name)


def _load() -> NativeCopy:
    xxh = _xxhash_library()
    lib = ctypes.CDLL(str(build("copy_hash", "the native checksummed copy", [SOURCE], flags=FLAGS)))
    if lib.kv_copy_hash_version() != VERSION:
        raise NotBuilt(f"the native checksummed copy is version {lib.kv_copy_hash_version()}, expected {VERSION}")
    native = NativeCopy(lib, xxh)
    _self_test(native)
    return native


def _self_test(native: NativeCopy) -> None:
    """The native digest of a head and a page of odd sizes must be python-xxhash's, and the copy exact."""
    data = np.frombuffer(xxhash.xxh3_128(b"kvstore").digest() * 4099, np.uint8)   # 65,584 bytes
    head, page = data[:37], data[37:]
    out = np.zeros_like(page)
    at = np.array([head.ctypes.data])
    digest, _ = native.copy_hash(at, at, at + head.nbytes, np.array([out.ctypes.data]), page.nbytes, 4096)
    if digest != xxhash.xxh3_128(data.tobytes()).digest() or not np.array_equal(out, page):
        raise NotBuilt("the native checksummed copy disagrees with python-xxhash")


def main() -> int:
    """`python -m kvstore.pages.native_copy`: build the library (if needed) and say whether it is used."""
    def built() -> str:
        native = copier()
        if native is None:
            raise NotBuilt(f"{why_not} (cold reads copy in Python)")
        return native.lib._name
    return report("native checksummed copy", built)


if __name__ == "__main__":
    raise SystemExit(main())
