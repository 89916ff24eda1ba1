"""`python -m dynamo_lite.slot_tracker`: run the slot tracker HTTP service."""

from __future__ import annotations

import logging
import sys

from dynamo_lite.cli import configure_logging, parse_args, positive_float, serve, service_parser

from .app import create_app
from .core import DEFAULT_REQUEST_TTL_SECS, SlotTracker

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
    args = parse_args(parser, argv)
    configure_logging(args.log_level, args.log_format)
    logging.getLogger("dynamo_lite.slot_tracker").info(
        "starting slot tracker on %s:%d (request TTL %ss)", args.host, args.port, args.request_ttl_secs
    )
    serve(create_app(SlotTracker(request_ttl_secs=args.request_ttl_secs)), args)


if __name__ == "__main__":
    sys.exit(main())
