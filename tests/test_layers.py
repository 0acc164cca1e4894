"""The layers go one way: app above engine above kvstore; plugins on kvstore alone; no cycles.

Every import statement counts, at module level, inside a function (a lazy import is still a
dependency) or under `if TYPE_CHECKING:` (a type hint still ties the modules together), read
from the source with ast.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

LAYERS = {"kvstore": set(), "engine": {"kvstore"}, "app": {"engine", "kvstore"}}   # package -> what it may import
PLUGINS = REPO / "plugins"


def modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of a package directory."""
    out = {}
    for file in sorted((root / package).rglob("*.py")):
        parts = file.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
    return out


def imports(file: Path, name: str) -> set[str]:
    """The absolute module names a file imports (relative imports resolved)."""
    found = set()
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return found


def graph() -> dict[str, set[str]]:
    mods = {}
    for package in LAYERS:
        mods.update(modules(REPO, package))
    return {m: {i for i in imports(f, m) if i in mods and i != m} for m, f in mods.items()}


def test_each_layer_imports_only_the_layers_below():
    wrong = []
    for package, allowed in LAYERS.items():
        for name, file in modules(REPO, package).items():
            for imported in imports(file, name):
                top = imported.split(".")[0]
                if top in LAYERS and top != package and top not in allowed:
                    wrong.append(f"{name} imports {imported}")
    assert not wrong, wrong


def test_plugins_depend_on_the_store_alone():
    wrong = [f"{file.relative_to(REPO)} imports {i}" for file in sorted(PLUGINS.rglob("*.py"))
             for i in imports(file, file.stem) if i.split(".")[0] in ("engine", "app")]
    assert not wrong, wrong


def test_no_layer_imports_another_inference_engine():
    """vLLM and SGLang plug into kvstore (plugins/), never the other way round (app's benchmarks run
    vLLM as the baseline they measure against)."""
    wrong = [f"{name} imports {i}" for package in ("kvstore", "engine") for name, file in modules(REPO, package).items()
             for i in imports(file, name) if i.split(".")[0] in ("vllm", "sglang", "kvstore_vllm", "kvstore_sglang")]
    assert not wrong, wrong


def test_no_import_cycles():
    deps = graph()
    state: dict[str, int] = {}      # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(deps[module]):
            # a package's own submodules are not a cycle with it (`import kvstore.x` runs kvstore/__init__)
            if dep.startswith(module + ".") or module.startswith(dep + "."):
                continue
            if state.get(dep) == 1:
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(deps):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles


def test_the_walk_sees_imports():
    """The checks above would pass on an empty graph: make sure they read real edges, lazy ones and
    type hints included."""
    deps = graph()
    assert "kvstore.config" in deps["engine.config"] and "engine.config" in deps["app.api.config"]
    assert "app.api.server" in deps["app.serve"]                    # imported inside run_serve
    assert "kvstore.store.core" in deps["kvstore.movement.pageio"]                  # the narrow core, not the store
    assert "kvstore.store.tiered" not in deps["kvstore.movement.pageio"]
    assert "torch" in imports(REPO / "kvstore/pages/spec.py", "kvstore.pages.spec")   # under TYPE_CHECKING


def test_readme_module_map_names_every_package():
    """README's module map has a line a package, and names no package that is gone."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Module map"):]
    section = section[:section.index("\n## ", 3)]
    listed = {line.split("`")[1].rstrip("/") for line in section.splitlines() if line.startswith("| `")}
    packages = {str(init.parent.relative_to(REPO)) for layer in LAYERS for init in (REPO / layer).rglob("__init__.py")}
    assert packages <= listed, sorted(packages - listed)
    assert all((REPO / p).is_dir() for p in listed), sorted(p for p in listed if not (REPO / p).is_dir())


def test_engine_has_no_http():
    """The OpenAI server is the application's (app/api/): the engine imports no HTTP framework."""
    wrong = [f"{name} imports {i}" for name, file in modules(REPO, "engine").items()
             for i in imports(file, name) if i.split(".")[0] in ("aiohttp", "http", "fastapi")]
    assert not wrong, wrong


def test_no_module_does_two_jobs():
    """A source module over 450 lines is doing two jobs; the step loop and the scheduler stay smaller."""
    limits = {"engine/scheduler.py": 220, "engine/llm.py": 260}
    over = []
    for root in (*LAYERS, "plugins"):
        for file in sorted((REPO / root).rglob("*.py")):
            path, lines = str(file.relative_to(REPO)), len(file.read_text().splitlines())
            if lines > limits.get(path, 450):
                over.append(f"{path}: {lines} lines")
    assert not over, over
