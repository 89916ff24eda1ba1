"""ruff and mypy over the project, as CI runs them (configuration in pyproject.toml).

mypy checks the package as it is installed (`-p dynamo_lite`): the repository keeps one folder
per concern and [tool.setuptools] package-dir assembles `dynamo_lite` from them, a mapping mypy
cannot read. The test builds that package as a tree of links in a temporary folder and points
mypy at it; errors are reported with the repository's paths.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PACKAGE = "dynamo_lite"


def _tool(name: str) -> Path:
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{name} is not installed in {BIN}: `pip install -e '.[test]'` installs it")
    return path


def _link_package(into: Path) -> dict[str, Path]:
    """`into/dynamo_lite/...` linking each source file of the package-dir mapping; returns the
    link folders with the repository folder each stands for, longest first."""
    import tomllib  # Python 3.11+: the caller skips before

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders: dict[str, Path] = {}
    for package, source in setuptools["package-dir"].items():
        target = into.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for module in (ROOT / source).glob("*.py"):
            (target / module.name).symlink_to(module)
        if (ROOT / source / "py.typed").exists():
            (target / "py.typed").symlink_to(ROOT / source / "py.typed")
        folders[target.relative_to(into).as_posix()] = ROOT / source
    return dict(sorted(folders.items(), key=lambda item: -len(item[0])))


def _repository_paths(output: str, folders: dict[str, Path]) -> str:
    for linked, source in folders.items():
        output = output.replace(linked + "/", str(source.relative_to(ROOT)) + "/")
    return output


def test_ruff_finds_nothing() -> None:
    result = subprocess.run([_tool("ruff"), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_finds_nothing(tmp_path: Path) -> None:
    if sys.version_info < (3, 11):
        pytest.skip("tomllib (reading package-dir) needs Python 3.11")
    folders = _link_package(tmp_path / "src")
    result = subprocess.run(
        [_tool("mypy"), "--config-file", str(ROOT / "pyproject.toml"), "--python-executable", sys.executable,
         "--cache-dir", str(tmp_path / "cache"), "-p", PACKAGE],
        cwd=tmp_path / "src", env={**os.environ, "MYPYPATH": str(tmp_path / "src")}, capture_output=True, text=True,
    )
    assert result.returncode == 0, _repository_paths(result.stdout + result.stderr, folders)
