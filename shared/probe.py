"""`python -m dynamo_lite.probe`: exit 0 when a local service answers a probe path with 200.

The container health check: the image runs any of the services, on a port that flags or
`DYNAMO_LITE_PORT` may change, so the probe follows the same variable and otherwise tries
every service's default HTTP port. The endpoint picker is the exception: its
`DYNAMO_LITE_PORT` is the gRPC port, and its HTTP side (`/health`, `/ready`) listens on
`--metrics-port`, so `DYNAMO_LITE_METRICS_PORT`, when set, comes first (no other service
reads it). Standard library only, so it costs a few milliseconds of start-up and nothing of
the service's own process.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence

# Slot tracker, indexer, endpoint picker's HTTP side (--metrics-port), engine stand-in.
DEFAULT_PORTS = (8091, 8090, 9003, 8000)


def default_ports(environ: Mapping[str, str] | None = None) -> list[int]:
    """The ports to probe without --port: $DYNAMO_LITE_METRICS_PORT (the picker's HTTP side),
    else $DYNAMO_LITE_PORT, else every service's default port."""
    env = os.environ if environ is None else environ
    for name in ("DYNAMO_LITE_METRICS_PORT", "DYNAMO_LITE_PORT"):
        if env.get(name):
            return [int(env[name])]
    return list(DEFAULT_PORTS)


def probe(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - loopback only
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dynamo_lite.probe",
        description="Exit 0 if a dynamo_lite service on this host answers PATH with 200, else 1.",
    )
    parser.add_argument(
        "--port", type=int, action="append",
        help="port to probe (repeatable; default: $DYNAMO_LITE_METRICS_PORT (the endpoint picker's "
             "HTTP side), else $DYNAMO_LITE_PORT, else 8091, 8090, 9003 and 8000 in turn)",
    )
    parser.add_argument("--path", default="/health", help="route to probe: /health (alive) or /ready")
    parser.add_argument("--host", default="127.0.0.1", help="address to probe")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for each answer")
    args = parser.parse_args(argv)
    ports = args.port or default_ports()
    for port in ports:
        if probe(f"http://{args.host}:{port}{args.path}", args.timeout):
            return 0
    print(f"no service answered {args.path} with 200 on {args.host} port(s) {', '.join(map(str, ports))}",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
