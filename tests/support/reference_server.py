"""Test support: the Dynamo 1.6.1 reference service and running HTTP services in subprocesses.

* `reference_python()` returns the interpreter of a venv that has `ai-dynamo-runtime==1.6.1`
  installed (so `python -m dynamo.slot_tracker` works), creating it on first use, or `None` when
  it cannot be installed; `reference_unavailable_reason()` then says why.
  The venv lives at `$DYNAMO_LITE_REFERENCE_VENV`, default `~/.cache/dynamo_lite/ref-venv-1.6.1`.
  Creation happens under an exclusive file lock (`<venv>.lock`), so parallel test sessions on one
  machine wait for each other instead of installing into the same directory at once.
* `free_port()` picks a TCP port that is free on all IPv4 interfaces.
* `running_server(argv, port)` starts a service, waits until `GET /health` answers 200 on
  loopback, yields its base URL and stops and reaps it afterwards (SIGINT, then SIGTERM, then
  SIGKILL). The process output goes to a temporary log file that is printed on failure.

Environment knobs:

* `DYNAMO_LITE_REFERENCE_VENV` — where the reference venv lives.
* `DYNAMO_LITE_REFERENCE_INSTALL_TIMEOUT` — seconds allowed for `pip install` (default 1200).
* `DYNAMO_LITE_REQUIRE_REFERENCE=1` — tests that need the reference fail instead of skipping
  (see `require_reference_or_skip`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

# One port chooser for every process of a run: the stack library's (never the same port twice).
from dynamo_lite.stack import free_port  # noqa: F401 - re-exported for the tests

REFERENCE_REQUIREMENT = "ai-dynamo-runtime==1.6.1"
REFERENCE_MODULE = "dynamo.slot_tracker"
DEFAULT_REFERENCE_VENV = Path.home() / ".cache" / "dynamo_lite" / "ref-venv-1.6.1"
DEFAULT_INSTALL_TIMEOUT_SECS = 1200.0
_MARKER = ".dynamo_lite_reference_ok"

# Per-process memo: the install is attempted at most once per test session.
_cached: tuple[Path | None, str | None] | None = None


# --------------------------------------------------------------------------------------------
# The reference venv
# --------------------------------------------------------------------------------------------


def reference_venv_dir() -> Path:
    configured = os.environ.get("DYNAMO_LITE_REFERENCE_VENV")
    return Path(configured).expanduser() if configured else DEFAULT_REFERENCE_VENV


def _venv_python(venv_dir: Path) -> Path:
    return venv_dir / "bin" / "python"


def reference_unavailable_reason() -> str | None:
    """Why `reference_python()` returned None (None if it has not failed)."""
    return None if _cached is None else _cached[1]


def reference_python() -> Path | None:
    """The reference venv's interpreter, installing it if needed; None (reason recorded) on failure."""
    global _cached
    if _cached is None:
        try:
            _cached = (_ensure_reference_venv(reference_venv_dir()), None)
        except Exception as exc:  # noqa: BLE001 - any failure means "no reference", with its reason
            _cached = (None, f"{type(exc).__name__}: {exc}")
    return _cached[0]


def require_reference_or_skip() -> Path:
    """`reference_python()`, else pytest.skip (or pytest.fail with DYNAMO_LITE_REQUIRE_REFERENCE=1)."""
    import pytest

    python = reference_python()
    if python is not None:
        return python
    message = (
        f"!!! REFERENCE UNAVAILABLE: could not install {REFERENCE_REQUIREMENT} into "
        f"{reference_venv_dir()}: {reference_unavailable_reason()} !!! "
        "The differential tests against Dynamo 1.6.1 did NOT run."
    )
    if os.environ.get("DYNAMO_LITE_REQUIRE_REFERENCE") == "1":
        pytest.fail(message + " (DYNAMO_LITE_REQUIRE_REFERENCE=1)", pytrace=False)
    print(message, file=sys.stderr)
    pytest.skip(message)


def _verify(python: Path) -> str | None:
    """None when `python -m dynamo.slot_tracker --help` works in that interpreter, else the reason."""
    if not python.exists():
        return f"{python} does not exist"
    try:
        done = subprocess.run(
            [str(python), "-c", f"import {REFERENCE_MODULE}"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            return f"import {REFERENCE_MODULE} failed: {_tail(done.stderr)}"
        done = subprocess.run(
            [str(python), "-m", REFERENCE_MODULE, "--help"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"running {python} failed: {exc}"
    if done.returncode != 0 or "--port" not in done.stdout:
        return f"`{python} -m {REFERENCE_MODULE} --help` exited {done.returncode}: {_tail(done.stdout + done.stderr)}"
    return None


def _ensure_reference_venv(venv_dir: Path) -> Path:
    python = _venv_python(venv_dir)
    if (venv_dir / _MARKER).exists() and _verify(python) is None:
        return python  # fast path: no lock needed
    venv_dir.parent.mkdir(parents=True, exist_ok=True)
    timeout = float(os.environ.get("DYNAMO_LITE_REFERENCE_INSTALL_TIMEOUT", DEFAULT_INSTALL_TIMEOUT_SECS))
    lock_path = venv_dir.with_name(venv_dir.name + ".lock")
    with _file_lock(lock_path, timeout=timeout + 300):
        # Another session may have finished the job while we waited for the lock.
        problem = _verify(python)
        if problem is None:
            (venv_dir / _MARKER).touch()
            return python
        if venv_dir.exists():
            # Only ever delete something that is recognisably a (broken or partial) venv.
            if (venv_dir / "pyvenv.cfg").exists() or not any(venv_dir.iterdir()):
                print(f"reference_server: rebuilding {venv_dir} ({problem})", file=sys.stderr)
                shutil.rmtree(venv_dir)
            else:
                raise RuntimeError(f"{venv_dir} exists and is not a venv; refusing to touch it")
        started = time.monotonic()
        _run([sys.executable, "-m", "venv", str(venv_dir)], timeout=300, what="creating the venv")
        _run(
            [
                str(python), "-m", "pip", "install",
                "--disable-pip-version-check", "--no-input", "--timeout", "60", "--retries", "3",
                REFERENCE_REQUIREMENT,
            ],
            timeout=timeout,
            what=f"pip install {REFERENCE_REQUIREMENT}",
        )
        problem = _verify(python)
        if problem is not None:
            raise RuntimeError(f"installed {REFERENCE_REQUIREMENT} but it does not work: {problem}")
        (venv_dir / _MARKER).write_text(f"{REFERENCE_REQUIREMENT}\n")
        print(
            f"reference_server: installed {REFERENCE_REQUIREMENT} into {venv_dir} "
            f"in {time.monotonic() - started:.1f} s",
            file=sys.stderr,
        )
        return python


def _run(argv: list[str], *, timeout: float, what: str) -> None:
    try:
        done = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{what} timed out after {timeout:.0f} s") from exc
    if done.returncode != 0:
        raise RuntimeError(f"{what} exited {done.returncode}: {_tail(done.stdout + done.stderr)}")


def _tail(text: str, limit: int = 2000) -> str:
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


@contextlib.contextmanager
def _file_lock(path: Path, *, timeout: float) -> Iterator[None]:
    """Exclusive advisory lock (flock) on `path`, waiting at most `timeout` seconds."""
    with open(path, "a+") as handle:
        deadline = time.monotonic() + timeout
        announced = False
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() > deadline:
                    raise TimeoutError(f"waited {timeout:.0f} s for the lock {path}") from exc
                if not announced:
                    print(f"reference_server: waiting for {path} (another install runs)", file=sys.stderr)
                    announced = True
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


# --------------------------------------------------------------------------------------------
# Running services
# --------------------------------------------------------------------------------------------


def listening(port: int) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:`port`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


class ServerURL(str):
    """The base URL (a plain `str`), plus the process and its log for diagnostics."""

    process: subprocess.Popen[bytes]
    log_path: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_text(self, limit: int = 20_000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"<cannot read {self.log_path}: {exc}>"
        return _tail(text, limit)


def _print_log(argv: Sequence[str], log_path: Path, why: str) -> None:
    try:
        text = log_path.read_text(errors="replace")
    except OSError as exc:
        text = f"<cannot read {log_path}: {exc}>"
    print(f"----- {why}: output of {' '.join(argv)} -----\n{_tail(text, 50_000)}\n----- end of output -----")


def _stop(process: subprocess.Popen[bytes], grace: float) -> None:
    """SIGINT, then SIGTERM, then SIGKILL, each after `grace` seconds; always reaps."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        if process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(sig)
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue
    process.wait()


def wait_healthy(base_url: str, process: subprocess.Popen[Any], *, path: str = "/health", timeout: float = 30.0,
                 verify: Any = True, cert: Any = None) -> None:
    """Return once `GET base_url + path` answers 200; RuntimeError if `process` exits first or
    `timeout` seconds pass (the message says what the last attempt got)."""
    command = " ".join(str(a) for a in process.args) if isinstance(process.args, list) else str(process.args)
    deadline = time.monotonic() + timeout
    last_problem = "no answer yet"
    with httpx.Client(timeout=1.0, verify=verify, cert=cert) as client:
        while True:
            code = process.poll()
            if code is not None:
                raise RuntimeError(f"{command} exited with {code} before it was ready")
            try:
                answer = client.get(base_url + path)
                if answer.status_code == 200:
                    return
                last_problem = f"GET {path} -> {answer.status_code}"
            except httpx.HTTPError as exc:
                last_problem = f"GET {path}: {type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                raise RuntimeError(f"{command} not ready after {timeout:.0f} s ({last_problem})")
            time.sleep(0.05)


@contextlib.contextmanager
def running_server(
    argv: Sequence[str],
    port: int,
    ready_path: str = "/health",
    timeout: float = 30.0,
    *,
    env: dict[str, str] | None = None,
    stop_grace: float = 5.0,
    keep_log: bool = False,
    scheme: str = "http",
    verify: Any = True,
    cert: Any = None,
) -> Iterator[ServerURL]:
    """Run `argv` (a service that listens on `port`), yield `http://127.0.0.1:PORT` once ready.

    Ready means `GET ready_path` returned 200 within `timeout` seconds. The process output is
    written to a temporary log file, printed when startup fails or the body raises, and deleted
    afterwards unless `keep_log`. With `scheme="https"`, readiness is asked with httpx's
    `verify` and `cert`.
    """
    argv = [str(a) for a in argv]
    if listening(port):
        raise RuntimeError(f"port {port} is already in use; cannot start {' '.join(argv)}")
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    child_env.setdefault("NO_COLOR", "1")
    fd, log_name = tempfile.mkstemp(prefix="dynamo_lite_server_", suffix=".log")
    log_path = Path(log_name)
    base = f"{scheme}://127.0.0.1:{port}"
    with os.fdopen(fd, "wb") as log:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env,
            start_new_session=True,  # a terminal Ctrl-C is ours to forward, in order
        )
    failed = True
    try:
        wait_healthy(base, process, path=ready_path, timeout=timeout, verify=verify, cert=cert)
        url = ServerURL(base)
        url.process = process
        url.log_path = log_path
        yield url
        failed = False
    except BaseException as exc:
        _stop(process, stop_grace)
        _print_log(argv, log_path, f"failure ({type(exc).__name__}); log kept at {log_path}")
        raise
    finally:
        _stop(process, stop_grace)
        if not keep_log and not failed:
            with contextlib.suppress(OSError):
                log_path.unlink()


@contextlib.contextmanager
def running_service(service: str, *flags: str) -> Iterator[ServerURL]:
    """`python -m dynamo_lite.<service>` on a free loopback port, as `running_server` runs it."""
    port = free_port()
    argv = [sys.executable, "-m", f"dynamo_lite.{service}", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning", *flags]
    with running_server(argv, port) as url:
        yield url
