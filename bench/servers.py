"""Starting the servers under test, each pinned to the server CPU, and reading their memory.

Three servers per service: ours, Dynamo 1.6.1's (the reference, from its own venv) and the
bare Starlette stub (bench/stub.py); a role named `ours_<name>` is ours again with other flags
(the selection service's default cost beside `--cost dynamo`). Start-up, readiness
(`GET /health`) and shutdown reuse the test suite's `running_server` and the reference venv its
`reference_python` (which creates the venv on first use), so the suite and the tests run the
reference the same way.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

from support import reference_server  # noqa: E402  (tests/ is not a package; imported by path on purpose)

SERVER_CPU = 0
CLIENT_CPU = 1
ROLES = ("ours", "reference", "stub")
SERVICES = ("slot_tracker", "indexer", "select_service")


@dataclass(frozen=True)
class Server:
    role: str  # "ours" (or "ours_<name>"), "reference" or "stub"
    service: str  # one of SERVICES
    url: str
    pid: int

    @property
    def is_reference(self) -> bool:
        return self.role == "reference"


def pin_to_client_cpu() -> None:
    """Keep this process (seeding, publishing, polling) and its children off the server CPU."""
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setaffinity(0, {CLIENT_CPU})


def reference_python() -> Path:
    """The reference venv's interpreter, created on first use (several minutes)."""
    venv = reference_server.reference_venv_dir()
    if not (venv / "bin" / "python").exists():
        print(f"creating the reference venv {venv} (pip install {reference_server.REFERENCE_REQUIREMENT}); "
              "this takes a few minutes the first time...", flush=True)
    python = reference_server.reference_python()
    if python is None:
        raise RuntimeError(
            f"cannot install {reference_server.REFERENCE_REQUIREMENT} into {venv}: "
            f"{reference_server.reference_unavailable_reason()}"
        )
    return python


def argv_for(role: str, service: str, port: int, ref_python: Path) -> list[str]:
    if role == "ours" or role.startswith("ours_"):
        return [sys.executable, "-m", f"dynamo_lite.{service}", "--host", "127.0.0.1", "--port", str(port),
                "--log-level", "warning"]
    if role == "stub":
        return [sys.executable, "-m", "bench.stub", "--host", "127.0.0.1", "--port", str(port),
                "--log-level", "warning"]
    if role == "reference":
        # Default options: the indexer's --threads 4 is what a user gets (all on one CPU here).
        return [str(ref_python), "-m", f"dynamo.{service}", "--port", str(port)]
    raise ValueError(role)


@contextlib.contextmanager
def running_servers(service: str, ref_python: Path, roles: tuple[str, ...] = ROLES, *,
                    flags: Mapping[str, Sequence[str]] | None = None,
                    env: Mapping[str, Mapping[str, str]] | None = None) -> Iterator[dict[str, Server]]:
    """All `roles` for `service`, each on a free port, pinned with `taskset -c SERVER_CPU`;
    `flags` and `env` add to a role's command line and environment."""
    # `python -m bench.stub` must import this checkout's bench/ whatever the working directory.
    stub_env = dict(os.environ, PYTHONPATH=str(TESTS_DIR.parent))
    with contextlib.ExitStack() as stack:
        servers: dict[str, Server] = {}
        for role in roles:
            port = reference_server.free_port()
            argv = ["taskset", "-c", str(SERVER_CPU), *argv_for(role, service, port, ref_python),
                    *(flags or {}).get(role, ())]
            role_env: dict[str, str] | None = stub_env if role == "stub" else None
            if env and role in env:
                role_env = {**(role_env or os.environ), **env[role]}
            url = stack.enter_context(reference_server.running_server(argv, port, timeout=60, env=role_env))
            # taskset execs the server, so the pid is the server's own.
            servers[role] = Server(role, service, str(url), url.process.pid)
        yield servers


def rss_bytes(pid: int) -> int:
    """VmRSS of the process and all of its descendants (the reference may run helpers)."""
    total = 0
    for member in _process_tree(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{member}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


def _process_tree(pid: int) -> list[int]:
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            with contextlib.suppress(OSError):
                queue.extend(int(child) for child in (task / "children").read_text().split())
    return found
