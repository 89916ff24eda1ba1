"""Where the tests find the runnable blocks of the documentation: the README and the docs site's
pages (docs/**/*.md). A block is found by the marker comment right before it
(`<!-- engine-walkthrough -->`) or by its first line, wherever it lives, so moving a block to
another page keeps it tested."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def pages() -> list[Path]:
    """The README, then every docs page in path order."""
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def marked_blocks(marker: str, language: str = "sh") -> list[tuple[Path, str]]:
    """Every ```language block right after `<!-- marker -->`, with its page; at least one."""
    found = [
        (page, block)
        for page in pages()
        for block in re.findall(rf"<!-- {re.escape(marker)} -->\n```{language}\n(.*?)```",
                                page.read_text(encoding="utf-8"), flags=re.S)
    ]
    assert found, f"no page has a block marked <!-- {marker} -->"
    return found


def block_starting_with(first_line: str, language: str = "sh") -> tuple[Path, str]:
    """The one ```language block whose first line is `first_line`."""
    found = [
        (page, block)
        for page in pages()
        for block in re.findall(rf"```{language}\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)
        if block.startswith(first_line + "\n")
    ]
    assert len(found) == 1, f"{len(found)} blocks start with {first_line!r}: {[str(page) for page, _ in found]}"
    return found[0]


def blocks(language: str) -> list[tuple[Path, str]]:
    return [
        (page, block)
        for page in pages()
        for block in re.findall(rf"```{language}\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)
    ]
