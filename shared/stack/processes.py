"""One child process of the stack: started with its output in a log file, waited for until an
HTTP readiness URL answers, stopped gracefully or killed, started again.

Also the loopback port helpers: `free_port` (a port nothing listens on, never the same twice in
one process) and `port_taken` (whether a server could listen on a given port).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

LOOPBACK = "127.0.0.1"


class StackError(Exception):
    """A part of the stack did not start, died, or did not reach the state waited for."""


# --- ports ------------------------------------------------------------------------------------


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port free on all IPv4 interfaces, never handed out before in this process.

    Chosen below the kernel's ephemeral range: a port from that range (what binding port 0 hands
    out) can be taken by any outgoing connection between this call and the service's bind, which
    made multi-process runs fail now and then ("port already in use"). Never twice: a stack asks
    for thirty ports before it binds any, and two equal random picks among ~20,000 happened often
    enough to fail a run."""
    low = _ephemeral_low()
    candidates = range(10_000, low) if low > 11_000 else range(0)
    for port in random.sample(candidates, min(len(candidates), 50)):
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("0.0.0.0", 0))
        port = int(sock.getsockname()[1])
    _handed_out.add(port)
    return port


def port_taken(port: int, host: str = LOOPBACK) -> bool:
    """Whether a server could not listen on `host:port`: tried as the services bind (with
    SO_REUSEADDR, so a port in TIME_WAIT is free, one another process listens on is not)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


# --- a process --------------------------------------------------------------------------------


class Process:
    """One child: `argv` run in its own session (a terminal's Ctrl-C is the stack's to pass on,
    in order) with stdout and stderr appended to `log`; ready when `GET ready` answers 200 (and,
    with `expect`, that body). `cpu` pins it (`taskset -c`, which execs: the pid is the child's)."""

    def __init__(self, name: str, argv: Sequence[str], log: Path, *, ready: str, expect: str | None = None,
                 ports: tuple[int, ...] = (), cpu: int | None = None, env: dict[str, str] | None = None,
                 stop_grace: float = 5.0) -> None:
        self.name = name
        self.argv = [str(arg) for arg in argv]
        self.log = log
        self.ready = ready
        self.expect = expect
        self.ports = ports
        self.cpu = cpu
        self.env = env
        self.stop_grace = stop_grace
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def command(self) -> list[str]:
        return self.argv if self.cpu is None else ["taskset", "-c", str(self.cpu), *self.argv]

    @property
    def pid(self) -> int:
        if self.popen is None:
            raise StackError(f"{self.name} was never started")
        return self.popen.pid

    def launch(self) -> Process:
        """Start it without waiting (`wait_ready` waits): several can come up at once. A restart
        appends to the same log, so what the earlier run wrote stays."""
        if self.alive():
            raise StackError(f"{self.name} is running already")
        self.prepare()
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("NO_COLOR", "1")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as log:
            self.popen = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return self

    def prepare(self) -> None:
        """What must exist before the process starts (a configuration file); nothing here."""

    def wait_ready(self, timeout: float = 60.0) -> Process:
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        with httpx.Client(timeout=1.0) as client:
            while True:
                if not self.alive():
                    raise StackError(f"{self.name} exited before it was ready; its log: {self.log}\n{self.tail()}")
                try:
                    answer = client.get(self.ready)
                    if answer.status_code == 200 and (self.expect is None or answer.text.strip() == self.expect):
                        return self
                    last = f"{answer.status_code} {answer.text.strip()[:80]!r}"
                except httpx.HTTPError as error:
                    last = type(error).__name__
                if time.monotonic() > deadline:
                    raise StackError(f"{self.name} not ready after {timeout:.0f} s ({self.ready}: {last}); "
                                     f"its log: {self.log}\n{self.tail()}")
                time.sleep(0.05)

    def start(self, timeout: float = 60.0) -> Process:
        """`launch`, then `wait_ready`."""
        return self.launch().wait_ready(timeout)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self) -> None:
        """SIGINT, then SIGTERM, then SIGKILL, each after `stop_grace` seconds; reaped. SIGINT
        first: every service drains on it, and a profiler around one writes its file."""
        popen = self.popen
        if popen is None:
            return
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            if popen.poll() is not None:
                return
            with contextlib.suppress(ProcessLookupError):
                popen.send_signal(signum)
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(self.stop_grace)
        popen.wait()

    def kill(self) -> None:
        """SIGKILL, no grace (a crash), and reaped."""
        popen = self.popen
        if popen is not None and popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                popen.kill()
            popen.wait()

    def restart(self, timeout: float = 60.0) -> Process:
        """Stop it (gracefully, if it still runs) and start it again on the same ports."""
        self.stop()
        return self.start(timeout)

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> Process:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Process({self.name!r}, pid={self.popen.pid if self.popen else None})"
