"""The import graph of `dynamo_lite` reads top to bottom: no module imports one of a higher layer.

LAYERS lists the package's parts from the bottom up (docs/development.md says what each holds);
a module belongs to the layer naming it or the package holding it, the longest name winning.
Imports within one layer are free. Every import counts: at the top of a module, inside a
function (imported late to spare a start-up, still a dependency) and under `if TYPE_CHECKING`
(mypy follows it and the annotations name the type, so the lower module still has to know the
higher one). The graph is read from the source folders that [tool.setuptools] package-dir maps,
so it is the package as installed, without importing it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "dynamo_lite"

# Bottom first. `dynamo_lite` itself is its `__init__` only (it names no sub-module).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("dynamo_lite", "dynamo_lite.base", "dynamo_lite.hashing")),
    ("web", ("dynamo_lite.web",)),
    ("durability", ("dynamo_lite.durability",)),
    ("service cores", ("dynamo_lite.slot_tracker", "dynamo_lite.indexer")),
    ("clients", ("dynamo_lite.client",)),
    ("routing", ("dynamo_lite.routing",)),
    ("gateway side", ("dynamo_lite.epp", "dynamo_lite.select_service", "dynamo_lite.pd_sidecar")),
    ("developer tools", ("dynamo_lite.mock_engine", "dynamo_lite.kv_publishers", "dynamo_lite.stack",
                         "dynamo_lite.simulate", "dynamo_lite.probe")),
]


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (length of the matching name, layer)
    for rank, (_, names) in enumerate(LAYERS):
        for name in names:
            matches = module == name or (name != PACKAGE and module.startswith(name + "."))
            if matches and (best is None or len(name) > best[0]):
                best = (len(name), rank)
    return None if best is None else best[1]


def package_modules() -> dict[str, Path]:
    """Every module of the package (`__init__` files as their package), with its source file."""
    import tomllib  # Python 3.11+: the tests skip before

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    modules: dict[str, Path] = {}
    for package, folder in setuptools["package-dir"].items():
        for path in sorted((ROOT / folder).glob("*.py")):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def imported(module: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(module of the package, line) for each import in the source, relative ones resolved."""
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            # `from package import module` imports the module; `from module import name`, the module
            names = [f"{base}.{alias.name}" for alias in node.names]
            names = [name if name in known else base for name in names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.append((name, node.lineno))
    return found


@pytest.fixture(scope="module")
def modules() -> dict[str, Path]:
    if sys.version_info < (3, 11):
        pytest.skip("tomllib (reading package-dir) needs Python 3.11")
    return package_modules()


def test_every_module_has_a_layer(modules: dict[str, Path]) -> None:
    unplaced = sorted(name for name in modules if layer_of(name) is None)
    assert not unplaced, f"declare the layer of {unplaced} in LAYERS (tests/test_layers.py and docs/development.md)"


def test_no_module_imports_a_higher_layer(modules: dict[str, Path]) -> None:
    known = set(modules)
    upward: list[str] = []
    for name, path in sorted(modules.items()):
        own = layer_of(name)
        for target, line in imported(name, path, known):
            theirs = layer_of(target)
            if own is not None and theirs is not None and theirs > own:
                upward.append(f"{path.relative_to(ROOT)}:{line}: {name} ({LAYERS[own][0]}) imports {target} "
                              f"({LAYERS[theirs][0]})")
    assert not upward, "a lower layer imports a higher one:\n" + "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    # the test above passes on an empty graph too: this one shows it reads imports of each form
    source = tmp_path / "web_module.py"
    source.write_text("import dynamo_lite.client\n"
                      "def late():\n    from ..routing import KvRouter\n"
                      "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dynamo_lite import stack\n")
    known = {"dynamo_lite.web.web_module", "dynamo_lite.client", "dynamo_lite.routing", "dynamo_lite.stack"}
    found = imported("dynamo_lite.web.web_module", source, known)
    assert found == [("dynamo_lite.client", 1), ("dynamo_lite.routing", 3), ("dynamo_lite.stack", 6)]
    assert [layer_of(target) for target, _ in found] == [4, 5, 7]
