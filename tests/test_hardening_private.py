"""The data directory is private to its owner: created 0700, every file in it 0600, whatever the umask."""

from __future__ import annotations

import os
import stat

import pytest

from kvstore.datadir import LOCK_FILE, DataDir
from kvstore.errors import KVStoreError
from storeutil import fill_and_commit, make_store, tokens_for


def modes_under(root) -> dict[str, int]:
    """path (relative to root) -> permission bits, for root and everything under it."""
    out = {".": stat.S_IMODE(os.stat(root).st_mode)}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = stat.S_IMODE(os.lstat(path).st_mode)
    return out


def assert_private(root) -> None:
    bad = {p: oct(m) for p, m in modes_under(root).items()
           if m != (0o700 if os.path.isdir(os.path.join(root, p)) else 0o600)}
    assert not bad, bad


@pytest.fixture
def permissive_umask():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_a_store_creates_its_data_dir_private(tmp_path, permissive_umask):
    root = tmp_path / "new"                          # it and its parents are created by the store
    s = make_store(root / "data")
    try:
        slots, keys = fill_and_commit(s, s.namespace(), tokens_for(1, 4))
        s.release(slots)
        s.evict(keys, to="cold")
        assert all(s.index.get(k).cold for k in keys)
    finally:
        s.close()
    assert_private(root)
    created = {"data", "data/cold", "data/cold/data.mdb", "data/cold/lock.mdb", f"data/{LOCK_FILE}"}
    assert created <= set(modes_under(root))


def test_a_second_process_cannot_use_a_locked_data_dir(tmp_path):
    import subprocess
    import sys

    from conftest import REPO, clean_env

    held = DataDir(tmp_path / "d").lock()
    try:
        again = DataDir(tmp_path / "d").lock()       # the same process: shared
        again.unlock()
        code = ("import sys\nfrom kvstore.datadir import DataDir\nfrom kvstore.errors import KVStoreError\n"
                "try:\n    DataDir(sys.argv[1]).lock()\nexcept KVStoreError as e:\n    print(e)\n    sys.exit(3)")
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "d")], capture_output=True, text=True,
                             env=clean_env(), cwd=REPO, timeout=60)
        assert out.returncode == 3 and "another kvstore process is using the data directory" in out.stdout
    finally:
        held.unlock()
    with pytest.raises(KVStoreError, match="cannot create the data directory"):
        DataDir(tmp_path / "d" / LOCK_FILE / "x").create()
