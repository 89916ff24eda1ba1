"""`python -m dynamo_lite.indexer`: run the KV indexer HTTP service."""

from __future__ import annotations

import logging
import sys

from dynamo_lite.cli import configure_logging, positive_float, serve, service_parser

from .app import create_app

DEFAULT_PORT = 8090


def main(argv: list[str] | None = None) -> None:
    parser = service_parser(
        "python -m dynamo_lite.indexer",
        "KV-cache indexer fed with block-hash events: which worker holds how much of a prompt.",
        DEFAULT_PORT,
    )
    parser.add_argument(
        "--peers",
        default="",
        help="comma-separated base URLs of indexers (ours or Dynamo's) to recover the index from "
        "at start-up, first reachable wins",
    )
    parser.add_argument(
        "--recovery-timeout-secs",
        type=positive_float,
        default=10.0,
        help="how long start-up keeps trying the peers before serving an empty index",
    )
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    peers = [url.strip() for url in args.peers.split(",") if url.strip()]
    logging.getLogger("dynamo_lite.indexer").info(
        "starting indexer on %s:%d%s", args.host, args.port, f" (peers: {', '.join(peers)})" if peers else ""
    )
    serve(create_app(peers=peers, recovery_deadline_secs=args.recovery_timeout_secs), args)


if __name__ == "__main__":
    sys.exit(main())
