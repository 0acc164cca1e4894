"""The cold tier's checksummed copy in one native call a batch (copy_hash.cpp), where it can be had.

record.copy_payloads hands a batch of records to `copy_hash`, which copies each page out and
hashes it in C, with the GIL released for the whole batch, so the read threads of a `read_many`
run side by side instead of taking turns at the interpreter between chunks. On x86-64 with
AVX-512 or AVX2 a record is read once: each 64-byte stripe is loaded into registers, hashed there
(xxh3 computed in copy_hash.cpp) and written to the target from them with non-temporal stores
(BENCHMARKS.md: "One pass"). Elsewhere the page is copied chunk by chunk, each chunk hashed
right after it landed, with xxhash's own functions: the ones python-xxhash carries (its
extension module exports xxhash's C functions; its `_dispatch` ones pick AVX2 or AVX-512 at run
time): 1.4x the speed of the system's libxxhash 0.8.1 on a page in L2 cache (BENCHMARKS.md), and
always there. Where that module does not export them, the system's libxxhash (a dependency of apt
on Debian and Ubuntu) is used. The library is built like the engine's kernels (kvstore.native).
When neither xxhash nor a compiler can be had, or the native digest of a test buffer differs from
python-xxhash's, `copier()` is None (one log line says why) and records are copied in Python,
more slowly, with the same checks.
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
HEADERS = (Path(__file__).with_name("copy_hash_fused.h"),)
FLAGS = ("-O2", "-std=c++17")
VERSION = 5   # kv_copy_hash_version() of the source
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
        lib.kv_copy_hash.argtypes = [p, ctypes.c_int, ctypes.c_int, i64, i64, p, p, p, p, p, i64, i64, p, p]
        lib.kv_copy_hash.restype = ctypes.c_int
        lib.kv_copy_hash_shared.argtypes = [p, ctypes.c_int, ctypes.c_int, i64, p, p, p, p, p, p, i64, i64, p, p]
        lib.kv_copy_hash_shared.restype = ctypes.c_int
        lib.kv_copy_publish.argtypes = [p, i64, ctypes.c_int]
        lib.kv_copy_publish.restype = None
        lib.kv_copy_blocks.argtypes = [p, p, i64, i64]
        lib.kv_copy_blocks.restype = None
        self.one_pass = lib.kv_copy_hash_fused_available()   # the widest one pass this CPU runs (ONE_PASS)

    def copy_blocks(self, dsts: np.ndarray, srcs: np.ndarray, nbytes: int) -> None:
        """nbytes from address srcs[i] to dsts[i] for every i (int64 arrays; the blocks must not
        overlap), streamed past the cache where this CPU has AVX2 or AVX-512 and the target is
        64-byte aligned; one call, the GIL released."""
        dsts, srcs = np.ascontiguousarray(dsts, np.int64), np.ascontiguousarray(srcs, np.int64)
        self.lib.kv_copy_blocks(dsts.ctypes.data, srcs.ctypes.data, len(dsts), nbytes)

    def copy_hash(self, values: np.ndarray, heads: np.ndarray, srcs: np.ndarray, dsts: np.ndarray, nbytes: int,
                  chunk: int, lmdb_file: tuple[int, int] | None = None,
                  one_pass: int | None = None) -> tuple[bytes, np.ndarray]:
        """Copy page i (nbytes at address srcs[i]) to dsts[i]; returns the xxh3-128 digest of each
        record's head (heads[i] up to srcs[i]) and copied page, 16 bytes each, and how each page was
        read (READ_ONE_PASS, READ_FILE or READ_MAP). With a one pass (`one_pass`, a key of ONE_PASS or 0
        for none; default self.one_pass, and never wider), a record whose head and page are contiguous,
        bound for a 64-byte aligned target, is read in one pass. Any other
        page is copied in chunks of `chunk` bytes: with `lmdb_file` (fd, page size) the records are
        values in an LMDB map of that file (values[i]: where record i starts), and a page in LMDB's
        overflow pages is read from the file (pread), any other from the map. The addresses must
        stay valid (and the targets unshared) until this returns."""
        n = len(srcs)
        digests = np.empty(16 * n, np.uint8)
        how = np.zeros(n, np.uint8)
        fd, psize = lmdb_file or (-1, 0)
        arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in (values, heads, srcs - heads, srcs, dsts)]
        level = self.one_pass if one_pass is None else min(one_pass, self.one_pass)
        rc = self.lib.kv_copy_hash(ctypes.addressof(self.functions), level, fd, psize, n,
                                   *(a.ctypes.data for a in arrays), nbytes, chunk, digests.ctypes.data,
                                   how.ctypes.data)
        if rc:
            raise MemoryError("xxhash could not allocate its state")
        return digests.tobytes(), how

    def batch(self, capacity: int, nbytes: int, chunk: int, lmdb_file: tuple[int, int] | None = None,
              one_pass: int | None = None) -> "CopyBatch":
        """A CopyBatch of up to `capacity` records whose pages are nbytes (copy_hash's other arguments)."""
        return CopyBatch(self, capacity, nbytes, chunk, lmdb_file, one_pass)


class CopyBatch:
    """copy_hash's records, filled by one thread while several copy them: `add` each record as it is
    checked, `publish` to hand those added so far to the copying threads, `close` once no more will
    come; each copying thread calls `drain` (the GIL released throughout), which copies published
    records one at a time until the batch is closed and none is left, waiting while the filler is
    behind. So the copying threads never take turns at the interpreter. The filler may drain too,
    once it has closed the batch. `results` once every drain has returned. The addresses added must
    stay valid (and the targets unshared) until then."""

    def __init__(self, native: NativeCopy, capacity: int, nbytes: int, chunk: int,
                 lmdb_file: tuple[int, int] | None, one_pass: int | None):
        self.native = native
        level = native.one_pass if one_pass is None else min(one_pass, native.one_pass)
        fd, psize = lmdb_file or (-1, 0)
        # one allocation: the five address rows (values, heads, head lengths, pages, targets), the
        # shared state (next to take, published, closed), then the digests and how each page was read
        table = np.zeros(5 * capacity + 3 + (17 * capacity + 7) // 8, np.int64)
        base = table.ctypes.data
        self.addresses = table[:5 * capacity].reshape(5, capacity)
        self.shared = table[5 * capacity:5 * capacity + 3]
        rest = table[5 * capacity + 3:].view(np.uint8)
        self.digests, self.how = rest[:16 * capacity], rest[16 * capacity:17 * capacity]
        self._shared_at = base + 8 * 5 * capacity
        rows = [base + 8 * capacity * r for r in range(5)]
        self._args = (ctypes.addressof(native.functions), level, fd, psize, self._shared_at, *rows, nbytes, chunk,
                      self._shared_at + 24, self._shared_at + 24 + 16 * capacity)
        self.count = 0
        self._added: tuple[list[int], ...] = ([], [], [], [])   # values, heads, pages, targets not yet published

    def add(self, value: int, head: int, src: int, dst: int) -> None:
        """The next record: it starts at address `value`, its head at `head`, its page at `src`, bound
        for `dst`; handed to the copying threads at the next publish."""
        for column, address in zip(self._added, (value, head, src, dst)):
            column.append(address)

    def publish(self, closed: bool = False) -> None:
        new = len(self._added[0])
        if new:
            at = slice(self.count, self.count + new)
            for row, column in zip((0, 1, 3, 4), self._added):
                self.addresses[row, at] = column
                column.clear()
            self.addresses[2, at] = self.addresses[3, at] - self.addresses[1, at]
            self.count += new
        self.native.lib.kv_copy_publish(self._shared_at, self.count, int(closed))

    def close(self) -> None:
        self.publish(closed=True)

    def drain(self) -> None:
        if self.native.lib.kv_copy_hash_shared(*self._args):
            raise MemoryError("xxhash could not allocate its state")

    def results(self) -> tuple[bytes, np.ndarray]:
        """copy_hash's (digests, how) of the records added, once every drain has returned."""
        return self.digests[:16 * self.count].tobytes(), self.how[:self.count]


READ_MAP, READ_FILE, READ_ONE_PASS = 0, 1, 2   # how copy_hash read a page
ONE_PASS = {2: "AVX-512", 1: "AVX2"}         # the one-pass reads, by the instruction set they use

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
    lib = ctypes.CDLL(str(build("copy_hash", "the native checksummed copy", [SOURCE], HEADERS, flags=FLAGS)))
    if lib.kv_copy_hash_version() != VERSION:
        raise NotBuilt(f"the native checksummed copy is version {lib.kv_copy_hash_version()}, expected {VERSION}")
    native = NativeCopy(lib, xxh)
    _self_test(native)
    return native


# (head, page) byte counts the self-test reads both ways: heads across a stripe's alignments (a
# multiple of 4 and not), pages of whole stripes and not, from the smallest the one pass takes.
SELF_TEST_SIZES = ((37, 65_547), (0, 4096), (64, 4096), (4, 128), (63, 129), (100, 1000), (130, 193), (5, 1024 - 5),
                   (200, 2048 - 200 + 1), (36, 737_280))


def _self_test(native: NativeCopy) -> None:
    """The native digest of a head and a page of each SELF_TEST_SIZES must be python-xxhash's, and the
    copy exact and within its target, read in chunks and in each one pass this CPU runs."""
    for head_bytes, page_bytes in SELF_TEST_SIZES:
        for level in range(native.one_pass + 1):
            if not check_copy(native, head_bytes, page_bytes, level):
                raise NotBuilt(f"the native checksummed copy disagrees with python-xxhash "
                               f"({ONE_PASS.get(level, 'chunked')}, {head_bytes} + {page_bytes} bytes)")


def check_copy(native: NativeCopy, head_bytes: int, page_bytes: int, one_pass: int) -> bool:
    """Whether copy_hash of a record of a head_bytes head and a page_bytes page (test data), with
    `one_pass` (a key of ONE_PASS this CPU runs, or 0), gives python-xxhash's digest and an exact copy,
    into a 64-byte aligned target, nothing written past it; and whether it was read in one pass
    exactly where one was asked for and the record fits it."""
    # bytes with no period: a misplaced stripe or word shows
    data = np.random.default_rng(head_bytes * 1_000_003 + page_bytes).integers(0, 256, head_bytes + page_bytes,
                                                                              dtype=np.uint8)
    room = np.full(page_bytes + 192, 0xA5, np.uint8)
    start = -room.ctypes.data % 64
    out = room[start:start + page_bytes]
    at = np.array([data.ctypes.data])
    digest, how = native.copy_hash(at, at, at + head_bytes, np.array([out.ctypes.data]), page_bytes, 4096,
                                   one_pass=one_pass)
    fits = one_pass > 0 and page_bytes >= 128 and head_bytes + page_bytes > 240
    return (digest == xxhash.xxh3_128(data.tobytes()).digest() and np.array_equal(out, data[head_bytes:])
            and not (room[:start] != 0xA5).any() and not (room[start + page_bytes:] != 0xA5).any()
            and (how[0] == READ_ONE_PASS) == fits)


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
