"""Name -> implementation registries; plugins add entries through entry point groups."""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Callable, Generic, TypeVar

from kvstore.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Built-ins register with the decorator; plugins through `entry_point_group`, loaded lazily."""

    def __init__(self, kind: str, entry_point_group: str):
        self.kind, self.group = kind, entry_point_group
        self._items: dict[str, T] = {}
        self._plugins_loaded = False

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            self._items[name] = obj
            return obj
        return deco

    def _load_plugins(self) -> None:
        if self._plugins_loaded:
            return
        self._plugins_loaded = True
        for ep in entry_points(group=self.group):
            if ep.name not in self._items:
                self._items[ep.name] = ep.load()

    def names(self) -> list[str]:
        self._load_plugins()
        return sorted(self._items)

    def get(self, name: str) -> T:
        if name not in self._items:
            self._load_plugins()
        if name not in self._items:
            raise ConfigError(self.kind, name, f"must be one of {', '.join(self.names())}")
        return self._items[name]
