"""LmdbFile: an LMDB data file (data.mdb) read with plain file reads, never mapped.

Handing a damaged file to liblmdb hands it the damage: a file cut short faults with SIGBUS on
the first read past its end, and a malformed B-tree page trips an assertion that aborts the
process. This reader never maps the file and checks every offset before it follows it, so:

- `check()` verifies the file before liblmdb opens it: both meta pages are meta pages with
  LMDB's magic and data version and one page size; the newer one (higher txnid, what LMDB
  opens) counts pages 0..last_pgno, and the file holds them; every page of every B-tree
  (main, free list and each named database) is a branch or leaf page that stores its own
  number, with its nodes, keys and values inside the page and its children and overflow
  values inside the committed pages, each page reached once. It reads the tree pages only,
  not the values: O(tree pages), a few MB for a million records. Failing, it raises
  DamagedStore, never a signal.
- `records(name)` walks a named database and yields every (key, value) it can still read,
  skipping what is damaged (`problems` lists it): `kvstore fsck --repair` copies what
  verifies from it into a fresh store.
- `entries(name)`: the record count a named database's descriptor claims (None if unreadable).

Layout (LMDB 0.9, 64-bit, little-endian, mdb.c): a page starts with a 16-byte header (pgno
u64, pad u16, flags u16, lower u16, upper u16; an overflow page's count of pages is lower and
upper read as one u32), then `lower - 16` bytes of u16 node offsets. A node is lo u16, hi u16,
flags u16, key size u16, the key, then its data: in a branch, lo | hi << 16 | flags << 32 is the
child's page number; in a leaf, lo | hi << 16 is the data size and the data is inline, or with
F_BIGDATA a u64 page number of overflow pages that hold it after their header. A meta page
holds, after the page header, magic u32, version u32, address u64, mapsize u64, the free-list
and main database descriptors (48 bytes each: pad u32 (the page size, in the free one), flags
u16, depth u16, branch, leaf and overflow pages, entries and root u64), last pgno u64, txnid u64.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Iterator

from kvstore.errors import DamagedStore

MAGIC = 0xBEEFC0DE
DATA_VERSION = 1            # LMDB 0.9's on-disk format
PAGE_HEADER = 16
P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_DIRTY, P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
P_INVALID = (1 << 64) - 1
_HEADER = struct.Struct("<QHHHH")        # pgno, pad, flags, lower, upper
_META = struct.Struct("<IIQQ")           # magic, version, address, mapsize
_DB = struct.Struct("<IHHQQQQQ")         # pad, flags, depth, branch, leaf, overflow, entries, root
_NODE = struct.Struct("<HHHH")           # lo, hi, flags, key size
_U64 = struct.Struct("<Q")
_MAX_DEPTH = 32
_SHOW_PROBLEMS = 3
_SCAN_BYTES = 4 << 20      # overflow_runs reads the file in chunks of this size


@dataclass(frozen=True)
class Meta:
    page: int          # 0 or 1
    psize: int
    free_root: int
    main_root: int
    last_pgno: int
    txnid: int


@dataclass
class _Walk:
    meta: Meta
    problems: list[str]
    seen: set[int] = field(default_factory=set)


class LmdbFile:
    """A read-only view of `<path>/data.mdb` through pread (see the module docstring)."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        self.file = os.path.join(self.path, "data.mdb")
        self.problems: list[str] = []   # damage `records` stepped over
        self.values_read: set[int] = set()   # first pages of the overflow values `records` read
        self.size = 0
        self._fd = -1
        self._page_size = 0

    def __enter__(self) -> "LmdbFile":
        self._fd = os.open(self.file, os.O_RDONLY)
        self.size = os.fstat(self._fd).st_size
        return self

    def __exit__(self, *exc) -> None:
        os.close(self._fd)
        self._fd = -1

    def _read(self, offset: int, n: int) -> bytes | None:
        if offset < 0 or offset + n > self.size:
            return None
        data = os.pread(self._fd, n, offset)
        return data if len(data) == n else None

    # meta pages
    def _meta(self, page: int, psize: int) -> Meta | str:
        """Meta page `page` (at page * psize), or what is wrong with it."""
        raw = self._read(page * psize, PAGE_HEADER + _META.size + 2 * _DB.size + 16)
        if raw is None:
            return f"meta page {page} lies past the end of the file ({self.size} bytes)"
        _, _, flags, _, _ = _HEADER.unpack_from(raw)
        magic, version, _, _ = _META.unpack_from(raw, PAGE_HEADER)
        if not flags & P_META or magic != MAGIC:
            return f"meta page {page} is not an LMDB meta page"
        if version != DATA_VERSION:
            return f"meta page {page} has data version {version}, not {DATA_VERSION}"
        free = _DB.unpack_from(raw, PAGE_HEADER + _META.size)
        main = _DB.unpack_from(raw, PAGE_HEADER + _META.size + _DB.size)
        last, txnid = struct.unpack_from("<QQ", raw, PAGE_HEADER + _META.size + 2 * _DB.size)
        if not _page_size_ok(free[0]):
            return f"meta page {page} has an impossible page size {free[0]}"
        return Meta(page, free[0], free[7], main[7], last, txnid)

    def metas(self) -> list[Meta]:
        """The meta pages that parse, newest (the committed state) first; DamagedStore if none does."""
        if self.size == 0:
            raise DamagedStore(self.file, "it is empty (0 bytes): it holds no LMDB meta pages")
        first = self._meta(0, 1)
        # meta page 1 sits one page in: at meta 0's page size, or the system's when meta 0 is unreadable
        second = self._meta(1, first.psize if isinstance(first, Meta) else os.sysconf("SC_PAGE_SIZE"))
        found = [m for m in (first, second) if isinstance(m, Meta)]
        if not found:
            raise DamagedStore(self.file, f"{first}; {second}")
        return sorted(found, key=lambda m: -m.txnid)

    def check(self) -> Meta:
        """Raise DamagedStore unless the file is safe for liblmdb (see the module docstring);
        returns the committed meta."""
        metas = self.metas()
        if len(metas) < 2:
            other = self._meta(1 - metas[0].page, metas[0].psize)
            raise DamagedStore(self.file, str(other))
        meta = metas[0]
        if metas[1].psize != meta.psize:
            raise DamagedStore(self.file, f"its meta pages disagree on the page size ({metas[1].psize} "
                                          f"and {meta.psize})")
        need = (meta.last_pgno + 1) * meta.psize
        if meta.last_pgno < 1 or self.size < need:
            raise DamagedStore(self.file, f"it is truncated: {self.size} bytes, its last committed transaction "
                                          f"needs {need} ({meta.last_pgno + 1} pages of {meta.psize} bytes)")
        walk = _Walk(meta, [])
        for _ in self._tree(walk, meta.free_root, "the free list"):
            pass
        for key, nflags, raw, doff, dsize in self._tree(walk, meta.main_root, "the main database"):
            if nflags & F_SUBDATA:
                db = self._descriptor(nflags, raw, doff, dsize, meta.psize)
                if db is None:
                    walk.problems.append(f"the descriptor of database {_name(key)} is malformed")
                    continue
                for _ in self._tree(walk, db[7], f"database {_name(key)}"):
                    pass
        if walk.problems:
            more = len(walk.problems) - _SHOW_PROBLEMS
            raise DamagedStore(self.file, "its B-tree is damaged: " + "; ".join(walk.problems[:_SHOW_PROBLEMS])
                               + (f" (and {more} more problems)" if more > 0 else ""))
        return meta

    # B-trees
    def _tree(self, walk: _Walk, root: int, what: str) -> Iterator[tuple[bytes, int, bytes, int, int]]:
        """(key, node flags, leaf page, data offset, data size) of every leaf node of the tree at `root`
        that is sound; what is not is added to walk.problems and stepped over."""
        if root == P_INVALID:
            return
        psize, last = walk.meta.psize, walk.meta.last_pgno
        stack = [(root, 0)]
        while stack:
            pgno, depth = stack.pop()
            where = f"page {pgno} of {what}"
            if pgno < 2 or pgno > last or depth > _MAX_DEPTH:
                walk.problems.append(f"{where} is outside the committed pages")
                continue
            if pgno in walk.seen:
                walk.problems.append(f"{where} is reached twice")
                continue
            walk.seen.add(pgno)
            raw = self._read(pgno * psize, psize)
            if raw is None:
                walk.problems.append(f"{where} lies past the end of the file")
                continue
            stored, _, flags, lower, upper = _HEADER.unpack_from(raw)
            kind = flags & (P_BRANCH | P_LEAF | P_OVERFLOW | P_META | P_LEAF2)
            if kind not in (P_BRANCH, P_LEAF) or stored != pgno:
                walk.problems.append(f"{where} is not the B-tree page it should be "
                                     f"(it says page {stored}, flags {flags:#06x})")
                continue
            if not PAGE_HEADER <= lower <= upper <= psize or (lower - PAGE_HEADER) % 2:
                walk.problems.append(f"{where} has impossible bounds (lower {lower}, upper {upper})")
                continue
            n = (lower - PAGE_HEADER) // 2
            if n == 0 and kind == P_BRANCH:
                walk.problems.append(f"{where} is a branch page without children")
                continue
            children = []
            for i, off in enumerate(struct.unpack_from(f"<{n}H", raw, PAGE_HEADER)):
                if off < upper or off + _NODE.size > psize:
                    walk.problems.append(f"{where}: node {i} lies outside the page")
                    break
                lo, hi, nflags, ksize = _NODE.unpack_from(raw, off)
                start = off + _NODE.size
                if start + ksize > psize:
                    walk.problems.append(f"{where}: the key of node {i} runs past the page")
                    break
                if kind == P_BRANCH:
                    children.append(lo | hi << 16 | nflags << 32)
                    continue
                dsize, doff = lo | hi << 16, start + ksize
                if nflags & F_BIGDATA:
                    value_page = _U64.unpack_from(raw, doff)[0] if doff + 8 <= psize else 0
                    end = value_page * psize + PAGE_HEADER + dsize
                    if value_page < 2 or value_page > last or end > (last + 1) * psize:
                        walk.problems.append(f"{where}: the value of node {i} lies outside the committed pages")
                        continue
                elif doff + dsize > psize:
                    walk.problems.append(f"{where}: the value of node {i} runs past the page")
                    continue
                yield raw[start:start + ksize], nflags, raw, doff, dsize
            stack.extend((child, depth + 1) for child in reversed(children))

    def _descriptor(self, nflags: int, raw: bytes, doff: int, dsize: int, psize: int) -> tuple | None:
        if not nflags & F_SUBDATA or nflags & F_BIGDATA or dsize != _DB.size or doff + dsize > psize:
            return None
        return _DB.unpack_from(raw, doff)

    def _value(self, nflags: int, raw: bytes, doff: int, dsize: int, psize: int) -> bytes | None:
        if not nflags & F_BIGDATA:
            return raw[doff:doff + dsize]
        pgno = _U64.unpack_from(raw, doff)[0]
        head = self._read(pgno * psize, PAGE_HEADER)
        if head is None:
            return None
        stored, _, flags, _, _ = _HEADER.unpack_from(head)
        if stored != pgno or not flags & P_OVERFLOW:
            return None
        self.values_read.add(pgno)
        return self._read(pgno * psize + PAGE_HEADER, dsize)

    def _psize(self) -> int:
        """The page size, as the meta pages say (the system's when neither reads)."""
        if not self._page_size:
            try:
                self._page_size = self.metas()[0].psize
            except DamagedStore:
                self._page_size = os.sysconf("SC_PAGE_SIZE")
        return self._page_size

    def _database(self, name: bytes) -> tuple[_Walk, int] | None:
        """A walk under the newest meta whose main database names `name`, and that database's root."""
        try:
            metas = self.metas()
        except DamagedStore:
            return None
        for meta in metas:
            walk = _Walk(meta, [])
            for key, nflags, raw, doff, dsize in self._tree(walk, meta.main_root, "the main database"):
                db = self._descriptor(nflags, raw, doff, dsize, meta.psize) if key == name else None
                if db is not None:
                    return walk, db
        return None

    def entries(self, name: bytes) -> int | None:
        """The record count of a named database as the committed state's descriptor says (None: unreadable)."""
        found = self._database(name)
        return found[1][6] if found and found[0].meta == self.metas()[0] else None

    def records(self, name: bytes) -> Iterator[tuple[bytes, bytes | None]]:
        """(key, value) of every record of a named database found in sound pages; value None when
        its bytes cannot be read (its overflow pages are damaged). Damage goes to `problems`."""
        found = self._database(name)
        if found is None:
            self.problems.append(f"database {_name(name)} is not found under either meta page")
            return
        walk, db = found
        walk.problems = self.problems
        for key, nflags, raw, doff, dsize in self._tree(walk, db[7], f"database {_name(name)}"):
            if nflags & (F_SUBDATA | F_DUPDATA):
                continue
            yield key, self._value(nflags, raw, doff, dsize, walk.meta.psize)

    def overflow_runs(self, skip: bool = False) -> Iterator[tuple[int, int]]:
        """(page number, pages) of every page of the file that reads as the first page of an overflow
        value, referenced or not: where the trees are lost, a record may still be whole there.
        With `skip`, the pages of a run found are not looked at (one small read per value, not a
        read of the whole file: for counting)."""
        psize = self._psize()
        if skip:
            pgno = 2
            while (head := self._read(pgno * psize, PAGE_HEADER)) is not None:
                stored, _, flags, lower, upper = _HEADER.unpack_from(head)
                pages = lower | upper << 16
                if stored == pgno and flags & ~P_DIRTY == P_OVERFLOW and pages and (pgno + pages) * psize <= self.size:
                    yield pgno, pages
                    pgno += pages
                else:
                    pgno += 1
            return
        chunk = max(psize, _SCAN_BYTES // psize * psize)
        for base in range(2 * psize, self.size - self.size % psize, chunk):
            raw = os.pread(self._fd, min(chunk, self.size - base), base)
            for off in range(0, len(raw) - PAGE_HEADER + 1, psize):
                stored, _, flags, lower, upper = _HEADER.unpack_from(raw, off)
                pgno, pages = (base + off) // psize, lower | upper << 16
                if stored == pgno and flags & ~P_DIRTY == P_OVERFLOW and pages and (pgno + pages) * psize <= self.size:
                    yield pgno, pages

    def value_at(self, pgno: int, pages: int, n: int) -> bytes | None:
        """The first n bytes of the overflow value at `pgno` (a run of `pages`); None past the run or the file."""
        psize = self._psize()
        return self._read(pgno * psize + PAGE_HEADER, n) if PAGE_HEADER + n <= pages * psize else None

    def tree_pages(self, name: bytes) -> list[tuple[int, str]]:
        """(page number, "branch" or "leaf") of every page of a named database's B-tree (diagnostics, tests)."""
        found = self._database(name)
        if found is None:
            return []
        walk, db = found
        walk.seen.clear()
        for _ in self._tree(walk, db[7], ""):
            pass
        out = []
        for pgno in sorted(walk.seen):
            raw = self._read(pgno * walk.meta.psize, PAGE_HEADER)
            out.append((pgno, "branch" if raw is not None and _HEADER.unpack_from(raw)[2] & P_BRANCH else "leaf"))
        return out


def _page_size_ok(psize: int) -> bool:
    return 512 <= psize <= 65536 and not psize & (psize - 1)


def _name(key: bytes) -> str:
    return repr(key.decode("ascii", "replace"))


def check_data_file(path: str, tries: int = 3) -> None:
    """Raise DamagedStore if the cold store at `path` has a data.mdb liblmdb must not open.

    A writer committing meanwhile (fsck next to a running store) may reuse pages the check is
    walking: a failed check is repeated while the committed transaction keeps changing."""
    try:
        with LmdbFile(path) as f:
            for attempt in range(tries):
                txnid = f.metas()[0].txnid
                try:
                    f.check()
                    return
                except DamagedStore:
                    f.size = os.fstat(f._fd).st_size
                    if attempt + 1 == tries or f.metas()[0].txnid == txnid:
                        raise
    except FileNotFoundError:
        return   # a new store
    except OSError as exc:
        raise DamagedStore(os.path.join(path, "data.mdb"), f"it cannot be read ({exc.strerror})") from None
