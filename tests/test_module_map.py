"""README's module map is the tree's: a row for every package of the layers, naming each of its
modules, and nothing in it that is gone."""

from __future__ import annotations

import re

from conftest import REPO

LAYERS = ("kvstore", "engine", "app")


def rows() -> dict[str, str]:
    """Module map row text by the path it describes (`kvstore/store`, `tests`, ...)."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Module map"):]
    section = section[:section.index("\n## ", 3)]
    return {line.split("`")[1].rstrip("/"): line for line in section.splitlines() if line.startswith("| `")}


def packages() -> list[str]:
    return sorted(str(init.parent.relative_to(REPO)) for layer in LAYERS for init in (REPO / layer).rglob("__init__.py"))


def test_every_package_has_a_row():
    missing = sorted(set(packages()) - set(rows()))
    assert not missing, missing


def test_each_row_names_every_module_of_its_package():
    unnamed = []
    for package in packages():
        named = set(re.findall(r"`([\w./]+?)(?:\.py)?`", rows().get(package, "")))
        unnamed += [f"{package}/{f.name}" for f in sorted((REPO / package).glob("*.py"))
                    if f.stem not in ("__init__", "__main__") and f.stem not in named]
    assert not unnamed, unnamed


def test_the_map_names_nothing_that_is_gone():
    gone = [path for path in rows() if not (REPO / path).exists()]
    for package, row in rows().items():
        if package in packages():
            gone += [f"{package}/{name}.py" for name in re.findall(r"`(\w+)\.py`", row)
                     if not (REPO / package / f"{name}.py").exists()]
    assert not gone, gone
