"""`python -m dynamo_lite.probe`: exit 0 when a local service answers a probe path with 200.

The container health check: the image runs either service, on a port that flags or
`DYNAMO_LITE_PORT` may change, so the probe follows the same variable and otherwise tries
both services' default ports. Standard library only, so it costs a few milliseconds of
start-up and nothing of the service's own process.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

DEFAULT_PORTS = (8091, 8090)  # slot tracker, indexer


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
        help="port to probe (repeatable; default: $DYNAMO_LITE_PORT, else 8091 then 8090)",
    )
    parser.add_argument("--path", default="/health", help="route to probe: /health (alive) or /ready")
    parser.add_argument("--host", default="127.0.0.1", help="address to probe")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for each answer")
    args = parser.parse_args(argv)
    ports = args.port or ([int(os.environ["DYNAMO_LITE_PORT"])] if os.environ.get("DYNAMO_LITE_PORT") else DEFAULT_PORTS)
    for port in ports:
        if probe(f"http://{args.host}:{port}{args.path}", args.timeout):
            return 0
    print(f"no service answered {args.path} with 200 on {args.host} port(s) {', '.join(map(str, ports))}",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
