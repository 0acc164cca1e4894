"""The config's field kinds: each key's parser from YAML, environment and command-line values to
its typed value (sizes such as 512MiB, booleans, numbers, mappings), `opt` that declares a key,
and `format_size` for showing a size back.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import field
from typing import Any, Callable

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any) -> int:
    """Bytes from an int or a string such as '512MiB', '2GiB', '40GB'. Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError
    if isinstance(value, int):
        if value < 0:
            raise ValueError
        return value
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


# Field kinds: a parser from YAML/env/CLI values to the typed value, and what is allowed.
def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError


def _int(v: Any) -> int:
    if isinstance(v, bool):
        raise ValueError
    if isinstance(v, float) and not v.is_integer():
        raise ValueError
    return int(str(v).strip()) if isinstance(v, str) else int(v)


def _float(v: Any) -> float:
    if isinstance(v, bool):
        raise ValueError
    return float(v)


def _pool(v: Any) -> float | int:
    """A byte size, or a fraction in (0, 1] of the free device memory."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return parse_size(v)
    if 0 < f <= 1 and not (isinstance(v, int) and f == 1):
        return f
    return parse_size(v if isinstance(v, (int, str)) else int(f))


def _str(v: Any) -> str:
    if isinstance(v, (dict, list)):
        raise ValueError
    return str(v)


def opt(default: Any, parse: Callable[[Any], Any], allowed: str,
        check: Callable[[Any], bool] = lambda v: True, help: str = ""):
    """A config key: its default (a mapping's is a fresh dict in every instance), parser, what is
    allowed and a check."""
    meta = {"parse": parse, "allowed": allowed, "check": check, "help": help}
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)


def default_of(f: dataclasses.Field) -> Any:
    """A key's default value."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _unit(v: float) -> bool:
    return 0 < v <= 1



def mapping(parse_value: Callable[[Any], Any]) -> Callable[[Any], dict]:
    """A field kind: a YAML mapping, or 'a=1,b=2' from the environment or --set; values parsed."""
    def parse(v: Any) -> dict:
        if isinstance(v, str):
            v = dict(item.split("=", 1) for item in v.split(",") if item.strip()) if v.strip() else {}
        if not isinstance(v, dict):
            raise ValueError
        return {str(k).strip(): parse_value(n) for k, n in v.items()}
    return parse

