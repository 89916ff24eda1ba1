"""`python -m dynamo_lite.select_service`: run the selection service."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from dynamo_lite.durability.nats_connection import NatsSecurity, add_nats_arguments
from dynamo_lite.indexer.listeners import DEFAULT_REPLAY_TIMEOUT_SECS
from dynamo_lite.routing.scheduling import SchedulerConfigError
from dynamo_lite.routing.scheduling.flags import add_scheduling_arguments, scheduler_config
from dynamo_lite.web.cli import (
    add_security_arguments,
    check_security_arguments,
    configure_logging,
    non_negative_float,
    non_negative_int,
    parse_args,
    peer_credentials,
    peer_urls,
    positive_float,
    serve,
    service_parser,
)

from .affinity import MAX_TTL_SECS, MIN_TTL_SECS
from .app import DEFAULT_RECOVERY_DEADLINE_SECS, SelectServiceConfig, create_app, load_workers
from .core import DEFAULT_REQUEST_TTL_SECS, SelectionSettings
from .pending import DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES, DEFAULT_TTL_SECS
from .replicas import DEFAULT_BUCKET_PREFIX, DEFAULT_SUBJECT_PREFIX, ReplicaSettings

DEFAULT_PORT = 8092


def build_parser() -> argparse.ArgumentParser:
    parser = service_parser(
        "python -m dynamo_lite.select_service",
        "Worker selection in one call per request (Dynamo selection service API): a worker catalog whose KV "
        "events it subscribes to, /select, /select_and_reserve and the reservation lifecycle.",
        DEFAULT_PORT,
    )
    selection = parser.add_argument_group("selection (the scheduling cycle: docs/routing.md)")
    add_scheduling_arguments(selection)
    selection.add_argument("--no-router-track-prefill-tokens", dest="track_prefill_tokens", action="store_false",
                           help="do not book a request's prompt as prefill load until its first token")
    selection.add_argument("--no-router-assume-kv-reuse", dest="assume_kv_reuse", action="store_false",
                           help="count every booked block as the request's own (random hashes), as for decode "
                           "workers that do not reuse transferred blocks")
    selection.add_argument("--seed", type=int, default=None, help="seed of tie-breaking and sampling")
    sessions = parser.add_argument_group("sessions and pending selections")
    sessions.add_argument("--session-affinity-ttl-secs", type=_session_ttl, default=None,
                          help="bind each session (session_id of a request) to the rank its first booked request "
                          f"went to, until this long after its last request ended ({MIN_TTL_SECS:g} to "
                          f"{MAX_TTL_SECS:g} s; default: no session affinity)")
    sessions.add_argument("--selection-cache-ttl-secs", type=non_negative_float, default=DEFAULT_TTL_SECS,
                          help="how long a /select with a selection_id is kept for a POST /reservations to book")
    sessions.add_argument("--selection-cache-max-entries", type=non_negative_int, default=DEFAULT_MAX_ENTRIES,
                          help="at most this many pending selections (the oldest evicted first)")
    sessions.add_argument("--selection-cache-max-bytes", type=non_negative_int, default=DEFAULT_MAX_BYTES,
                          help="at most about this many bytes of pending selections (8 per block hash)")
    sessions.add_argument("--request-ttl-secs", type=positive_float, default=DEFAULT_REQUEST_TTL_SECS,
                          help="drop a booking this many seconds after it was made if it was never freed")
    index = parser.add_argument_group("workers, KV events and recovery")
    index.add_argument("--workers", type=Path, default=None, metavar="FILE",
                       help="JSON or YAML list of worker records (POST /workers bodies) registered at start-up")
    index.add_argument("--indexer-peers", type=peer_urls, default=(), metavar="URL[,URL...]",
                       help="at start-up, copy the index from the first of these (selection services or indexers) "
                       "that answers GET /dump; workers are not copied: register them again")
    index.add_argument("--recovery-timeout-secs", type=positive_float, default=DEFAULT_RECOVERY_DEADLINE_SECS,
                       help="how long to keep trying --indexer-peers before starting with an empty index")
    index.add_argument("--replay-timeout-secs", type=positive_float, default=DEFAULT_REPLAY_TIMEOUT_SECS,
                       help="how long to wait for an engine's replay of the batches a subscription missed")
    remote = parser.add_argument_group(
        "remote mode: many selectors on one state (docs/select-service.md)")
    remote.add_argument("--slot-tracker", type=_service_url, default=None, metavar="URL",
                        help="read loads from and book on this slot tracker instead of in-process (with --indexer)")
    remote.add_argument("--indexer", type=_service_url, default=None, metavar="URL",
                        help="read cached blocks from this indexer, which subscribes to the workers' KV events, "
                        "instead of in-process (with --slot-tracker)")
    remote.add_argument("--service-timeout-secs", type=positive_float, default=2.0,
                        help="remote mode: how long a call to the slot tracker or the indexer may take")
    group = add_nats_arguments(parser, subject_prefix=DEFAULT_SUBJECT_PREFIX,
                               what="the catalog and the bookings (remote mode: cached blocks and loads are the "
                               "slot tracker's and the indexer's, replicated on their own)")
    group.add_argument("--nats-bucket-prefix", default=DEFAULT_BUCKET_PREFIX,
                       help="prefix of the JetStream key-value bucket holding the catalog (<prefix>_catalog); "
                       "replicas of one fleet use the same one")
    add_security_arguments(parser)
    return parser


def _service_url(text: str) -> str:
    url = text.strip().rstrip("/")
    if not url.startswith(("http://", "https://")) or len(url) <= len("https://"):
        raise argparse.ArgumentTypeError(f"{text!r} is not an http:// or https:// base URL")
    return url


def _session_ttl(text: str) -> float:
    value = positive_float(text)
    if not MIN_TTL_SECS <= value <= MAX_TTL_SECS:
        raise argparse.ArgumentTypeError(f"{text} is not between {MIN_TTL_SECS:g} and {MAX_TTL_SECS:g}")
    return value


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parse_args(parser, argv)
    check_security_arguments(parser, args)
    if (args.slot_tracker is None) != (args.indexer is None):
        parser.error("remote mode takes both --slot-tracker and --indexer")
    if args.nats is not None and args.slot_tracker is None:
        parser.error("replicas (--nats) share loads and cached blocks through a slot tracker and an indexer: "
                     "give --slot-tracker and --indexer")
    if args.slot_tracker is not None and args.indexer_peers:
        parser.error("--indexer-peers recovers an in-process index: in remote mode the indexer holds it")
    configure_logging(args.log_level, args.log_format)
    try:
        scheduler = scheduler_config(args)
        workers = load_workers(args.workers) if args.workers is not None else ()
    except (SchedulerConfigError, ValueError) as exc:
        parser.error(str(exc))
    settings = SelectionSettings(
        scheduler=scheduler,
        selection_cache_ttl_secs=args.selection_cache_ttl_secs,
        selection_cache_max_entries=args.selection_cache_max_entries,
        selection_cache_max_bytes=args.selection_cache_max_bytes,
        session_affinity_ttl_secs=args.session_affinity_ttl_secs,
        request_ttl_secs=args.request_ttl_secs,
        track_prefill_tokens=args.track_prefill_tokens,
        assume_kv_reuse=args.assume_kv_reuse,
        seed=args.seed,
    )
    logging.getLogger("dynamo_lite.select_service").info(
        "starting selection service on %s:%d (cost %s, temperature %g, session affinity %s)%s", args.host, args.port,
        scheduler.cost, scheduler.temperature,
        f"{args.session_affinity_ttl_secs:g} s" if args.session_affinity_ttl_secs else "off",
        f" (index from peers: {', '.join(args.indexer_peers)})" if args.indexer_peers else "",
    )
    if args.slot_tracker is not None:
        logging.getLogger("dynamo_lite.select_service").info(
            "remote mode: slot tracker %s, indexer %s%s", args.slot_tracker, args.indexer,
            f"; replicas through NATS at {args.nats} (bucket {args.nats_bucket_prefix}_catalog, subjects "
            f"{args.nats_subject_prefix}.*)" if args.nats else "")
    serve(create_app(SelectServiceConfig(
        selection=settings,
        indexer_peers=args.indexer_peers,
        recovery_deadline_secs=args.recovery_timeout_secs,
        replay_timeout_secs=args.replay_timeout_secs,
        peer_credentials=peer_credentials(args),
        workers=workers,
        slot_tracker_url=args.slot_tracker,
        indexer_url=args.indexer,
        service_timeout_secs=args.service_timeout_secs,
        replicas=ReplicaSettings(args.nats, args.nats_subject_prefix, args.nats_bucket_prefix,
                                 NatsSecurity.from_args(args)) if args.nats else None,
    )), args)


if __name__ == "__main__":
    main()
