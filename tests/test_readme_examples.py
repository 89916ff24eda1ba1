"""The documentation's curl blocks answer exactly as they say.

Each service's routes block (docs/slot-tracker.md, docs/indexer.md) and the routing
walkthrough (`<!-- routing-walkthrough -->`, in the README and docs/getting-started.md) run as
written (bash, real curl), in order, against fresh service processes; the base URL lines
(`B=http://localhost:8091`, `I=http://localhost:8090`) are pointed at the test's ports. A
comment after a command states what it answers: a status (`# 201`), a JSON document (on the
same line, or on the `#` lines right after it), or "the same answer" as the command before.
Every other command must succeed. Runnable blocks hold only commands that run: a host the
docs only imagine (`http://other-indexer:8090`) appears in the text, never in a block.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.docs_support import block_starting_with, blocks, marked_blocks
from support.reference_server import listening, running_service

STATUS_MARK = "\n__status__="

pytestmark = pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")


@dataclass
class Command:
    text: str
    status: int | None = None
    body: Any = None
    same_as_before: bool = False


def parse_block(block: str) -> tuple[str, list[Command]]:
    """(variable lines, commands) of a block of curl commands."""
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
            assert current is not None, f"curl block: unexpected line {line!r}"
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


def run_block(block: str, urls: dict[str, str], tmp_path: Path) -> int:
    """Run the block's commands with each variable of `urls` (`B`, `I`) pointed at its service;
    the number of answers checked against the block's comments."""
    prelude, commands = parse_block(block)
    for variable, url in urls.items():
        prelude, count = re.subn(rf"^{variable}=\S+", f"{variable}={url}", prelude, flags=re.M)
        assert count == 1, f"the block sets {variable} {count} times"
    checked = 0
    previous_body: Any = None
    for command in commands:
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


@pytest.mark.process
def test_slot_tracker_routes_block(slot_tracker: str, tmp_path: Path) -> None:
    page, block = block_starting_with("B=http://localhost:8091")
    assert page.name == "slot-tracker.md"
    assert run_block(block, {"B": slot_tracker}, tmp_path) >= 8


@pytest.mark.process
def test_indexer_routes_block(indexer: str, tmp_path: Path) -> None:
    page, block = block_starting_with("I=http://localhost:8090")
    assert page.name == "indexer.md"
    assert run_block(block, {"I": indexer}, tmp_path) >= 5
    assert_left_clean(slot_tracker=None, indexer=indexer)


@pytest.mark.process
@pytest.mark.parametrize("page", ["README.md", "getting-started.md"])
def test_the_routing_walkthrough_answers_as_written_and_leaves_the_services_as_they_were(
        page: str, slot_tracker: str, indexer: str, tmp_path: Path) -> None:
    walkthroughs = {path.name: block for path, block in marked_blocks("routing-walkthrough")}
    assert set(walkthroughs) == {"README.md", "getting-started.md"}
    assert len(set(walkthroughs.values())) == 1, "the README's walkthrough and the getting-started page's differ"
    assert run_block(walkthroughs[page], {"B": slot_tracker, "I": indexer}, tmp_path) >= 8
    assert_left_clean(slot_tracker, indexer)


@pytest.mark.unit
def test_no_runnable_block_talks_to_an_imagined_host() -> None:
    for page, block in [*blocks("sh"), *blocks("bash")]:
        assert "other-indexer" not in block, f"{page}: a block a reader would paste names an imagined host"


def assert_left_clean(slot_tracker: str | None, indexer: str | None) -> None:
    if slot_tracker:
        assert httpx.get(slot_tracker + "/workers").json() == []
    if indexer:
        assert httpx.get(indexer + "/workers").json() == []


@pytest.mark.process
def test_the_readme_set_up_starts_both_services_for_the_walkthrough_and_the_examples(tmp_path: Path) -> None:
    """A newcomer's first minutes: the README's first set-up command (its install part aside: the
    project is installed) starts both services on their default ports; the walkthrough, then an
    example, run against them as written; Ctrl-C stops both."""
    setup = next(block for page, block in blocks("sh") if page.name == "README.md")
    command = setup.strip().split(" && ")[-1]
    assert command == ".venv/bin/python -m dynamo_lite.stack --services-only", setup
    for port in (8090, 8091):
        if listening(port):
            pytest.skip(f"port {port} is taken (another service runs on this machine)")
    process = subprocess.Popen([sys.executable, "-m", "dynamo_lite.stack", "--services-only", "--workdir", str(tmp_path)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 60
        assert process.stdout is not None
        while not any(line.startswith("the slot tracker:") for line in lines):
            assert time.monotonic() < deadline and process.poll() is None, "".join(lines)
            lines.append(process.stdout.readline())
        ((_, walkthrough), *_) = marked_blocks("routing-walkthrough")
        assert run_block(walkthrough, {}, tmp_path) >= 8
        defaults = {name: value for name, value in os.environ.items() if name not in ("SLOT_TRACKER_URL", "INDEXER_URL")}
        done = subprocess.run([sys.executable, "examples/quickstart.py"], capture_output=True, text=True, timeout=60,
                              cwd=Path(__file__).resolve().parent.parent, env=defaults)
        assert done.returncode == 0 and "chosen: worker 5" in done.stdout, done
        assert_left_clean("http://localhost:8091", "http://localhost:8090")
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)
    assert process.returncode == 0


@pytest.mark.process
def test_the_readme_set_up_on_a_taken_port_says_so_in_one_line_and_starts_nothing(tmp_path: Path) -> None:
    """A service of an earlier run still holds 8091: the set-up command ends at once with one line
    naming the port, status 1, before it starts anything (its readiness probe would otherwise be
    answered by whoever holds the port, and it would report a service ready that had failed)."""
    with contextlib.ExitStack() as stack:
        if not listening(8091):
            holder = stack.enter_context(socket.socket())
            holder.bind(("127.0.0.1", 8091))
            holder.listen()
        indexer_was_up = listening(8090)
        done = subprocess.run([sys.executable, "-m", "dynamo_lite.stack", "--services-only", "--workdir", str(tmp_path)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 1, done
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
        assert "8091 (slot_tracker)" in done.stderr and "already in use" in done.stderr and done.stdout == "", done
        assert indexer_was_up or not listening(8090)
        assert list(tmp_path.glob("*.log")) == []
        # Without --workdir the stack makes its own folder; a refused start leaves none behind.
        scratch = tmp_path / "tmp"
        scratch.mkdir()
        done = subprocess.run([sys.executable, "-m", "dynamo_lite.stack", "--services-only"], capture_output=True,
                              text=True, timeout=60, env=dict(os.environ, TMPDIR=str(scratch)))
        assert done.returncode == 1 and "already in use" in done.stderr, done
        assert list(scratch.iterdir()) == []


@pytest.mark.unit
def test_the_readme_shows_the_design_cards_command_for_one_service() -> None:
    """The design card starts a service as `python -m dynamo_lite.slot_tracker --port 8091`: a user
    looking for how to start one service alone finds that command in the README."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    for command in ("python -m dynamo_lite.slot_tracker --port 8091", "python -m dynamo_lite.indexer --port 8090"):
        assert command in readme, command
