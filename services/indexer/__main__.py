"""`python -m dynamo_lite.indexer`: run the KV indexer HTTP service."""

from __future__ import annotations

import argparse
import logging
import sys

from dynamo_lite.cli import configure_logging, parse_args, positive_float, serve, service_parser

from .app import create_app

DEFAULT_PORT = 8090


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


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
    parser.add_argument(
        "--max-blocks",
        type=_non_negative_int,
        default=0,
        help="per (model, tenant) partition: keep at most this many device (worker, block) pairs, and "
        "this many blocks per lower tier, evicting the least recently used; 0 = unlimited",
    )
    parser.add_argument(
        "--snapshot",
        default=None,
        metavar="PATH",
        help="load the index from this file at start-up (when it exists) and write it there "
        "atomically, in the /dump format, periodically and at shutdown",
    )
    parser.add_argument(
        "--snapshot-interval-secs",
        type=positive_float,
        default=30.0,
        help="seconds between two snapshots",
    )
    parser.add_argument(
        "--ignore-bad-snapshot",
        action="store_true",
        help="when the snapshot cannot be read, move it to PATH.bad and start empty instead of "
        "refusing to start",
    )
    args = parse_args(parser, argv)
    configure_logging(args.log_level, args.log_format)
    peers = [url.strip() for url in args.peers.split(",") if url.strip()]
    logging.getLogger("dynamo_lite.indexer").info(
        "starting indexer on %s:%d%s", args.host, args.port, f" (peers: {', '.join(peers)})" if peers else ""
    )
    app = create_app(
        peers=peers,
        recovery_deadline_secs=args.recovery_timeout_secs,
        max_blocks=args.max_blocks,
        snapshot=args.snapshot,
        snapshot_interval_secs=args.snapshot_interval_secs,
        ignore_bad_snapshot=args.ignore_bad_snapshot,
    )
    serve(app, args)


if __name__ == "__main__":
    sys.exit(main())
