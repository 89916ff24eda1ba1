"""`python -m dynamo_lite.slot_tracker`: run the slot tracker HTTP service."""

from __future__ import annotations

import argparse
import logging

from dynamo_lite.durability.nats_connection import NatsSecurity, add_nats_arguments
from dynamo_lite.web.cli import (
    add_recovery_arguments,
    add_security_arguments,
    check_security_arguments,
    configure_logging,
    non_negative_float,
    parse_args,
    peer_credentials,
    positive_float,
    serve,
    service_parser,
)

from .app import DEFAULT_SNAPSHOT_INTERVAL_SECS, SlotTrackerConfig, create_app
from .core import DEFAULT_REQUEST_TTL_SECS
from .nats_replica import DEFAULT_JOIN_TIMEOUT_SECS, DEFAULT_PUBLISH_TIMEOUT_SECS, DEFAULT_SUBJECT_PREFIX, NatsSettings

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
    add_replica_arguments(parser)
    add_security_arguments(parser)
    args = parse_args(parser, argv)
    check_security_arguments(parser, args)
    if args.nats and args.peers:
        parser.error("--peers does not go with --nats: a replica joining takes the state of a running one "
                     "through NATS (and loads --snapshot only when none answers)")
    configure_logging(args.log_level, args.log_format)
    logging.getLogger("dynamo_lite.slot_tracker").info(
        "starting slot tracker on %s:%d (request TTL %ss)%s%s", args.host, args.port, args.request_ttl_secs,
        f" (peers: {', '.join(args.peers)})" if args.peers else "",
        f" (replicas through NATS at {args.nats}, subjects {args.nats_subject_prefix}.*)" if args.nats else "",
    )
    serve(create_app(SlotTrackerConfig(
        request_ttl_secs=args.request_ttl_secs,
        peers=args.peers,
        recovery_deadline_secs=args.recovery_timeout_secs,
        snapshot=args.snapshot,
        snapshot_interval_secs=args.snapshot_interval_secs,
        ignore_bad_snapshot=args.ignore_bad_snapshot,
        nats=nats_settings(args),
        peer_credentials=peer_credentials(args),
    )), args)


def add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    group = add_nats_arguments(parser, subject_prefix=DEFAULT_SUBJECT_PREFIX, what="workers and active requests")
    group.add_argument(
        "--nats-join-timeout-secs", type=positive_float, default=DEFAULT_JOIN_TIMEOUT_SECS,
        help="at start-up, how long to wait for a running replica to send its state; when none answers, "
        "this replica starts as the first, from --snapshot if given, else empty. --peers does not go with --nats",
    )
    group.add_argument(
        "--nats-publish-timeout-secs", type=non_negative_float, default=DEFAULT_PUBLISH_TIMEOUT_SECS,
        help="a write's answer waits until the NATS server has it (so an answered write survives this "
        "replica's crash), at most this long; while NATS is unreachable it is answered at once and sent later. "
        "0: answer at once (more writes per second; a write answered just before a crash may not reach the others)",
    )


def nats_settings(args: argparse.Namespace) -> NatsSettings | None:
    if not args.nats:
        return None
    return NatsSettings(url=args.nats, subject_prefix=args.nats_subject_prefix,
                        join_timeout_secs=args.nats_join_timeout_secs,
                        publish_timeout_secs=args.nats_publish_timeout_secs, security=NatsSecurity.from_args(args))


if __name__ == "__main__":
    main()
