"""The README's route examples answer exactly as the README says.

Each service's "### Routes" block of curl commands runs as written (bash, real curl), in order,
against a fresh service process; the base URL line (`B=http://localhost:8091`,
`I=http://localhost:8090`) is pointed at the test's port. A comment after a command states
what it answers: a status (`# 201`), a JSON document (on the same line, or on the `#` lines
right after it), or "the same answer" as the command before. Every other command must succeed.
Commands that talk to a host the README only imagines (`http://other-indexer:8090`) are not run.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from reference_server import running_service

README = Path(__file__).resolve().parent.parent / "README.md"
STATUS_MARK = "\n__status__="
IMAGINED_HOST = re.compile(r"curl\b[^|]*\s'?http://other-indexer")

pytestmark = pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")


@dataclass
class Command:
    text: str
    status: int | None = None
    body: Any = None
    same_as_before: bool = False


def routes_block(base_line: str) -> tuple[str, list[Command]]:
    """(variable lines, commands) of the README's sh block that starts with `base_line`."""
    blocks = re.findall(r"```sh\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    block = next(block for block in blocks if block.startswith(base_line))
    prelude: list[str] = []
    commands: list[Command] = []
    current: list[str] | None = None
    expectation: list[str] = []

    def finish() -> None:
        nonlocal current, expectation
        if current is not None:
            commands.append(_command(current, expectation))
        current, expectation = None, []

    for line in block.splitlines():
        if not line.strip():
            finish()
        elif line.startswith("#"):
            if current is not None:
                expectation.append(line.lstrip("#").strip())
            # otherwise a comment describing the next command
        elif re.match(r"^[A-Z]+=", line) and current is None:
            prelude.append(line)
        elif line.startswith("curl "):
            finish()
            current = [line]
        else:
            assert current is not None, f"README routes block: unexpected line {line!r}"
            current.append(line)
    finish()
    return "\n".join(prelude), commands


def _command(lines: list[str], following: list[str]) -> Command:
    last = lines[-1]
    inline = re.search(r"\s+#\s+(.*)$", last)
    comment_lines = following
    if inline:
        lines = [*lines[:-1], last[: inline.start()]]
        comment_lines = [inline.group(1), *following]
    command = Command("\n".join(lines))
    comment = " ".join(comment_lines).strip()
    if re.match(r"^\d{3}\b", comment):
        command.status = int(comment[:3])
    elif comment.startswith(("{", "[")):
        command.body = json.loads(comment)
    elif comment.startswith("the same answer"):
        command.same_as_before = True
    return command


@pytest.fixture(scope="module")
def slot_tracker() -> Iterator[str]:
    with running_service("slot_tracker") as url:
        yield str(url)


@pytest.fixture(scope="module")
def indexer() -> Iterator[str]:
    with running_service("indexer") as url:
        yield str(url)


def run_block(base_line: str, url: str, tmp_path: Path) -> int:
    prelude, commands = routes_block(base_line)
    variable = base_line.split("=")[0]
    prelude = prelude.replace(base_line, f"{variable}={url}")
    checked = 0
    previous_body: Any = None
    for command in commands:
        if IMAGINED_HOST.search(command.text):
            continue
        script = (f"{prelude}\ncurl() {{ command curl -sS -w '{STATUS_MARK.strip()}%{{http_code}}' \"$@\"; }}\n"
                  f"{command.text}\n")
        done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert done.returncode == 0, f"{command.text}\n{done.stderr}"
        output, _, status_text = done.stdout.rpartition("__status__=")
        status = int(status_text.strip())
        body_text = output.split("\n\n")[-1].strip()  # after the head, for `curl -i` (text mode turned its CRLFs into LFs)
        if command.status is not None:
            assert status == command.status, f"{command.text}\n-> {status} {body_text}"
        else:
            assert 200 <= status < 300, f"{command.text}\n-> {status} {body_text}"
        try:
            body = json.loads(body_text) if body_text else None
        except ValueError:
            pytest.fail(f"{command.text}\n-> {status}, not JSON: {body_text[:300]!r}")
        if command.body is not None:
            assert body == command.body, f"{command.text}\n-> {body_text}\nREADME says {json.dumps(command.body)}"
        if command.same_as_before:
            assert body == previous_body, f"{command.text}\n-> {body_text}"
        checked += command.status is not None or command.body is not None or command.same_as_before
        previous_body = body
    return checked


def test_slot_tracker_routes_block(slot_tracker: str, tmp_path: Path) -> None:
    assert run_block("B=http://localhost:8091", slot_tracker, tmp_path) >= 8


def test_indexer_routes_block(indexer: str, tmp_path: Path) -> None:
    assert run_block("I=http://localhost:8090", indexer, tmp_path) >= 5
