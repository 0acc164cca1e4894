"""Errors a user or a caller can act on. Each message is one line."""


class KVStoreError(Exception):
    """Base class of every error kvstore raises on purpose."""


class ConfigError(KVStoreError):
    """A config key or value is invalid. The message names the key, the value and what is allowed."""

    def __init__(self, key: str, value: object, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key} = {value!r}: {allowed}")


class OutOfCapacity(KVStoreError):
    """A tier cannot hold the pages asked for, even after evicting what may be evicted. `pending`:
    room will come once write-behind has written dirty pages (wait; preempting nobody helps)."""

    def __init__(self, message: str, pending: bool = False):
        self.pending = pending
        super().__init__(message)


class NotBuilt(KVStoreError):
    """A part of kvstore that this version does not include."""


class DamagedStore(KVStoreError):
    """The cold store's LMDB file is damaged: it cannot be opened or read safely (never mapped
    blindly: a file cut short would fault). `file` names it, `reason` says what is wrong."""

    def __init__(self, file: str, reason: str, remedy: str = ""):
        self.file, self.reason = file, reason
        super().__init__(f"the cold store file {file} is damaged: {reason}" + (f"; {remedy}" if remedy else ""))
