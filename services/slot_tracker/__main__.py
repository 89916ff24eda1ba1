"""`python -m dynamo_lite.slot_tracker`: run the slot tracker HTTP service."""

from __future__ import annotations

import logging
import sys

from dynamo_lite.cli import add_recovery_arguments, configure_logging, parse_args, positive_float, serve, service_parser

from .app import DEFAULT_SNAPSHOT_INTERVAL_SECS, SlotTrackerConfig, create_app
from .core import DEFAULT_REQUEST_TTL_SECS

DEFAULT_PORT = 8091


def main(argv: list[str] | None = None) -> None:
    parser = service_parser(
        "python -m dynamo_lite.slot_tracker",
        "Active-request load accounting for KV-aware LLM routers (Dynamo slot tracker API).",
        DEFAULT_PORT,
    )
    parser.add_argument(
        "--request-ttl-secs",
        type=positive_float,
        default=DEFAULT_REQUEST_TTL_SECS,
        help="free a request this many seconds after its /add if it was never freed",
    )
    add_recovery_arguments(parser, state="workers and active requests", peers="slot trackers",
                           snapshot_interval_secs=DEFAULT_SNAPSHOT_INTERVAL_SECS)
    args = parse_args(parser, argv)
    configure_logging(args.log_level, args.log_format)
    logging.getLogger("dynamo_lite.slot_tracker").info(
        "starting slot tracker on %s:%d (request TTL %ss)%s", args.host, args.port, args.request_ttl_secs,
        f" (peers: {', '.join(args.peers)})" if args.peers else "",
    )
    serve(create_app(SlotTrackerConfig(
        request_ttl_secs=args.request_ttl_secs,
        peers=args.peers,
        recovery_deadline_secs=args.recovery_timeout_secs,
        snapshot=args.snapshot,
        snapshot_interval_secs=args.snapshot_interval_secs,
        ignore_bad_snapshot=args.ignore_bad_snapshot,
    )), args)


if __name__ == "__main__":
    sys.exit(main())
