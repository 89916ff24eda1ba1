"""The documentation site builds with `mkdocs build --strict` (no broken link or anchor, every page
in the navigation), and its generated pages match what they are generated from: the services'
argument parsers (docs/configuration.md) and OpenAPI documents (docs/reference/*-api.md)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs"))

import generate_configuration  # noqa: E402  (docs/ is not a package)


def test_mkdocs_builds_the_site_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")
    pytest.importorskip("material", reason="the docs extra is not installed (pip install -e '.[docs]')")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=300, env={"NO_MKDOCS_2_WARNING": "1",
                                                                                         "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()


@pytest.mark.parametrize("generator", ["generate_configuration.py", "generate_routes.py"])
def test_the_generated_pages_are_up_to_date(generator: str) -> None:
    result = subprocess.run([sys.executable, str(ROOT / "docs" / generator), "--check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (
        f"a generated page is stale: run `python docs/{generator}`:\n{result.stdout}{result.stderr}"
    )


@pytest.mark.parametrize("program", generate_configuration.PROGRAMS, ids=lambda program: program.script)
def test_every_flag_of_a_service_is_in_the_configuration_page(program: generate_configuration.Program) -> None:
    """Read from the service's --help, independently of the generator: every long option and the
    environment variable the help names for it are in the service's table."""
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    section = page.split(f"## {program.title}\n", 1)[1].split("\n## ", 1)[0]
    help_text = subprocess.run([sys.executable, "-m", program.module, "--help"], capture_output=True, text=True,
                               timeout=60, check=True).stdout
    parser = generate_configuration.service_parser(program.module)
    flags = [flag for action in parser._actions for flag in action.option_strings
             if flag.startswith("--") and not isinstance(action, argparse._HelpAction)]
    assert len(flags) >= 20
    for flag in flags:
        assert flag in help_text and f"`{flag}`" in section, flag
    variables = set(re.findall(r"\[env\s+(DYNAMO_LITE_\w+)\]", help_text))
    assert len(variables) == len(flags) - sum(flag.startswith("--no-") or flag == "--routing-group" for flag in flags)
    for variable in variables:
        assert f"`{variable}`" in section, variable


def test_the_console_scripts_are_named_in_the_docs() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    docs = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    for script in ("dynamo-lite-slot-tracker", "dynamo-lite-indexer"):
        assert f"{script} = " in pyproject and f"`{script}`" in docs
