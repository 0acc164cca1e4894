"""DataDir: the data directory of one running store (`data_dir`), private to its owner.

- Private: every directory kvstore creates for it is born 0700 and every file 0600 (the
  cached pages are prompts). Modes are set at creation, never chmod-ed afterwards; a
  directory that exists already is left as it is.
- Locked: a running store holds an exclusive lock on `DIR/kvstore.lock` (flock: the kernel
  drops it when the process dies, however it dies), so a second process on the same
  directory is refused, and whatever the lock's last holder left behind (its shared-memory
  segment) is known to be stale once the lock is taken. Stores of one process share the lock.
- Named: `shm_name` is the warm tier's shared-memory segment of this directory,
  `kvstore-<hash of the resolved path>`, so a restart finds (and reclaims) what a killed
  predecessor left in /dev/shm.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading

import blake3

from kvstore.errors import KVStoreError

log = logging.getLogger("kvstore.datadir")

LOCK_FILE = "kvstore.lock"
DIR_MODE, FILE_MODE = 0o700, 0o600


def make_private_dirs(path: str | os.PathLike) -> None:
    """Create `path` and any missing parent, each 0700 (os.makedirs gives parents the umask's mode)."""
    path = os.path.abspath(os.fspath(path))
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for p in reversed(missing):
        try:
            os.mkdir(p, DIR_MODE)
        except FileExistsError:
            if not os.path.isdir(p):
                raise


class DataDir:
    _held: dict[str, tuple[int, int]] = {}     # resolved path -> (lock fd, holders in this process)
    _held_lock = threading.Lock()

    def __init__(self, path: str | os.PathLike):
        self.path = os.path.realpath(os.fspath(path))
        self._locked = False

    @property
    def shm_name(self) -> str:
        """The warm tier's shared-memory segment of this directory (no leading slash)."""
        return "kvstore-" + blake3.blake3(os.fsencode(self.path)).hexdigest()[:24]

    def create(self) -> "DataDir":
        try:
            make_private_dirs(self.path)
        except OSError as exc:
            raise KVStoreError(f"cannot create the data directory {self.path}: {exc.strerror}") from None
        return self

    def lock(self) -> "DataDir":
        """Take the directory's lock (created first if need be); KVStoreError if another process holds it."""
        self.create()
        with DataDir._held_lock:
            fd, holders = DataDir._held.get(self.path, (-1, 0))
            if fd < 0:
                fd = self._take()
            DataDir._held[self.path] = (fd, holders + 1)
        self._locked = True
        return self

    def _take(self) -> int:
        lock_path = os.path.join(self.path, LOCK_FILE)
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        except OSError as exc:
            raise KVStoreError(f"cannot open the lock file {lock_path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):   # a filesystem without locks
                log.warning("cannot lock %s (%s): nothing keeps a second process off this data directory",
                            lock_path, exc.strerror)
                return fd
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise KVStoreError(f"another kvstore process is using the data directory {self.path} "
                                   f"(it holds {LOCK_FILE}); stop it or choose another data_dir") from None
            raise KVStoreError(f"cannot lock {lock_path}: {exc.strerror}") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())   # for people: who holds it
        return fd

    def unlock(self) -> None:
        """Give the lock back (once per lock()); the last holder of this process releases it."""
        if not self._locked:
            return
        self._locked = False
        with DataDir._held_lock:
            fd, holders = DataDir._held.pop(self.path)
            if holders > 1:
                DataDir._held[self.path] = (fd, holders - 1)
            else:
                os.close(fd)
