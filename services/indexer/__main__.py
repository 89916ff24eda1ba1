"""`python -m dynamo_lite.indexer`: run the KV indexer HTTP service."""

from __future__ import annotations

import argparse
import logging

from dynamo_lite.base.errors import InvalidArgument
from dynamo_lite.base.integers import U32_MAX, U64_MAX
from dynamo_lite.durability.nats_connection import NatsSecurity, add_nats_arguments
from dynamo_lite.web.cli import (
    YOUNG_ONLY_GC_THRESHOLDS,
    add_recovery_arguments,
    add_security_arguments,
    check_security_arguments,
    configure_logging,
    non_negative_float,
    non_negative_int,
    parse_args,
    peer_credentials,
    positive_float,
    serve,
    service_parser,
)

from .app import DEFAULT_APPROX_MAX_BLOCKS, DEFAULT_APPROX_TTL_SECS, IndexerConfig, create_app
from .endpoints import EndpointRules
from .listeners import DEFAULT_REPLAY_TIMEOUT_SECS, REPLAY_ATTEMPTS, Subscription, validate_endpoint
from .nats_replica import (
    DEFAULT_READY_MAX_LAG,
    DEFAULT_RETENTION_SECS,
    DEFAULT_SNAPSHOT_INTERVAL_SECS,
    DEFAULT_SNAPSHOT_THRESHOLD,
    DEFAULT_STREAM,
    DEFAULT_SUBJECT_PREFIX,
    StreamSettings,
)

DEFAULT_PORT = 8090



def parse_workers(text: str, *, model_name: str, tenant_id: str, block_size: int | None) -> list[Subscription]:
    """`--workers id[:dp]=endpoint[+replay_endpoint],...` as subscriptions of one partition.

    The same syntax as Dynamo's `--workers`, plus an optional replay endpoint after a `+`.
    Raises ValueError with a message naming the bad entry.
    """
    entries = [entry.strip() for entry in text.split(",") if entry.strip()]
    if not entries:
        return []
    if block_size is None:
        raise ValueError("--block-size is required when --workers is given")
    subscriptions: list[Subscription] = []
    seen: set[tuple[int, int]] = set()
    for entry in entries:
        worker, equals, endpoints = entry.partition("=")
        if not equals or not endpoints:
            raise ValueError(f"--workers entry {entry!r}: expected id[:dp_rank]=endpoint[+replay_endpoint]")
        instance, colon, rank = worker.partition(":")
        try:
            worker_id = int(instance)
            dp_rank = int(rank) if colon else 0
        except ValueError:
            raise ValueError(f"--workers entry {entry!r}: the instance id and dp rank must be integers") from None
        if not 0 <= worker_id <= U64_MAX or not 0 <= dp_rank <= U32_MAX:
            raise ValueError(f"--workers entry {entry!r}: instance id must be a u64 and dp rank a u32")
        if (worker_id, dp_rank) in seen:
            raise ValueError(f"--workers entry {entry!r}: instance {worker_id} dp_rank {dp_rank} is listed twice")
        seen.add((worker_id, dp_rank))
        endpoint, plus, replay = endpoints.partition("+")
        try:
            validate_endpoint(endpoint)
            if plus:
                validate_endpoint(replay, "replay endpoint")
        except InvalidArgument as error:  # its message is the explanation
            raise ValueError(f"--workers entry {entry!r}: {error}") from None
        subscriptions.append(
            Subscription(model_name, tenant_id, block_size, worker_id, dp_rank, endpoint, replay if plus else None)
        )
    return subscriptions



def add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    group = add_nats_arguments(parser, subject_prefix=DEFAULT_SUBJECT_PREFIX, what="one index")
    group.add_argument("--nats-stream", default=DEFAULT_STREAM,
                       help="JetStream stream of the replicas' writes (created when missing); its snapshots go to "
                       "the object store bucket <stream>_snapshots")
    group.add_argument("--nats-retention-secs", type=positive_float, default=DEFAULT_RETENTION_SECS,
                       help="how long the stream keeps a message; a replica starting loads the newest snapshot and "
                       "needs the messages after it")
    group.add_argument("--nats-snapshot-interval-secs", type=positive_float, default=DEFAULT_SNAPSHOT_INTERVAL_SECS,
                       help="a replica renews the snapshot in the object store when it is this old and the index "
                       "changed since (at most half of --nats-retention-secs)")
    group.add_argument("--nats-snapshot-threshold", type=_positive_int, default=DEFAULT_SNAPSHOT_THRESHOLD,
                       help="... or when this many stream messages were applied since the snapshot")
    group.add_argument("--nats-ready-max-lag", type=non_negative_int, default=DEFAULT_READY_MAX_LAG,
                       help="/ready answers 503 while the replica is more than this many stream messages behind")
    group.add_argument("--nats-replica-name", default=None,
                       help="name of this replica's durable consumer; unique per replica (default: host name, "
                       "process id and a random part)")
    group.add_argument("--reset-state", action="store_true",
                       help="purge the stream and delete the snapshot before starting. Only for the first replica: "
                       "replicas already running keep their index and disagree with the new ones")


def stream_settings(args: argparse.Namespace) -> StreamSettings | None:
    """The replica settings of `--nats`, or None; ValueError for flags that do not go together."""
    if args.nats is None:
        if args.reset_state:
            raise ValueError("--reset-state needs --nats")
        return None
    if args.snapshot or args.peers:
        raise ValueError("--nats keeps the index in the stream and its object store: "
                         "leave out --snapshot and --peers")
    settings = StreamSettings(
        url=args.nats,
        subject_prefix=args.nats_subject_prefix,
        stream=args.nats_stream,
        retention_secs=args.nats_retention_secs,
        snapshot_interval_secs=args.nats_snapshot_interval_secs,
        snapshot_threshold=args.nats_snapshot_threshold,
        ready_max_lag=args.nats_ready_max_lag,
        replica_name=args.nats_replica_name,
        reset_state=args.reset_state,
        security=NatsSecurity.from_args(args),
    )
    settings.check()
    return settings


def _endpoint_rules(text: str) -> EndpointRules:
    try:
        return EndpointRules.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def main(argv: list[str] | None = None) -> None:
    parser = service_parser(
        "python -m dynamo_lite.indexer",
        "KV-cache indexer fed with block-hash events: which worker holds how much of a prompt.",
        DEFAULT_PORT,
    )
    parser.add_argument(
        "--max-blocks",
        type=non_negative_int,
        default=0,
        help="per (model, tenant) partition: keep at most this many device (worker, block) pairs, and "
        "this many blocks per lower tier, evicting the least recently used; 0 = unlimited",
    )
    parser.add_argument(
        "--approx-ttl-secs",
        type=positive_float,
        default=DEFAULT_APPROX_TTL_SECS,
        help="how long the blocks of a request reported to POST /routed count for the rank it was "
        "routed to (approximate indexing of engines that publish no KV events); routing it again "
        "restarts it",
    )
    parser.add_argument(
        "--approx-max-blocks",
        type=non_negative_int,
        default=DEFAULT_APPROX_MAX_BLOCKS,
        help="per (model, tenant) partition: keep at most this many (rank, block) approximations, "
        "dropping those that expire first; 0 = unlimited",
    )
    add_recovery_arguments(parser, state="index", peers="indexers (ours or Dynamo's)", snapshot_interval_secs=30.0)
    parser.add_argument(
        "--full-gc-interval-secs",
        type=non_negative_float,
        default=300.0,
        help="seconds between two full garbage collections (0: never). Between them only young "
        "objects are collected; index nodes are never scanned, so a full one pauses the "
        "service for about 1 ms per million indexed blocks",
    )
    engines = parser.add_argument_group(
        "engines", "subscribe at start-up to engines that publish KV events over ZMQ (vLLM, SGLang); "
        "POST /register with an endpoint does the same while running"
    )
    engines.add_argument(
        "--workers",
        default="",
        metavar="ID[:DP]=ENDPOINT[+REPLAY],...",
        help="engines to subscribe to, e.g. '7:0=tcp://10.0.0.7:5557+tcp://10.0.0.7:5600,"
        "7:1=tcp://10.0.0.7:5558+tcp://10.0.0.7:5601': instance id, data-parallel rank (default 0), the "
        "engine's PUB endpoint and, after '+', its replay (ROUTER) endpoint. Rank r publishes on the PUB "
        "port + r and replays on the replay port + r: keep the two port ranges apart",
    )
    engines.add_argument("--block-size", type=_positive_int, default=None,
                         help="tokens per KV block of the --workers' model (required with --workers)")
    engines.add_argument("--model-name", default="default", help="model of the --workers")
    engines.add_argument("--tenant-id", "--routing-group", dest="tenant_id", default="default",
                         help="tenant (Dynamo: routing group) of the --workers")
    engines.add_argument(
        "--allowed-endpoints", type=_endpoint_rules, default=None, metavar="RULE[,RULE...]",
        help="engine endpoints POST /register may subscribe to, e.g. '10.0.0.0/8,*.engines.svc.cluster.local:5557,"
        "ipc:///run/vllm/*': CIDRs or addresses, host name patterns (not resolved), each with an optional "
        ":port or :low-high, or scheme://patterns; others are a 400 naming the rules. Default: any",
    )
    engines.add_argument(
        "--replay-timeout-secs",
        type=positive_float,
        default=DEFAULT_REPLAY_TIMEOUT_SECS,
        help="how long a listener waits for the next answer to a replay request (time this process is "
        f"stopped does not count) before it asks again; after {REPLAY_ATTEMPTS} requests the batches still "
        "missing count as lost",
    )
    add_replica_arguments(parser)
    add_security_arguments(parser)
    args = parse_args(parser, argv)
    check_security_arguments(parser, args)
    try:
        workers = parse_workers(args.workers, model_name=args.model_name, tenant_id=args.tenant_id,
                                block_size=args.block_size)
        nats = stream_settings(args)
    except ValueError as error:
        parser.error(str(error))
    configure_logging(args.log_level, args.log_format)
    peers = args.peers
    logging.getLogger("dynamo_lite.indexer").info(
        "starting indexer on %s:%d%s", args.host, args.port, f" (peers: {', '.join(peers)})" if peers else ""
    )
    app = create_app(IndexerConfig(
        max_blocks=args.max_blocks,
        approx_ttl_secs=args.approx_ttl_secs,
        approx_max_blocks=args.approx_max_blocks,
        peers=tuple(peers),
        recovery_deadline_secs=args.recovery_timeout_secs,
        snapshot=args.snapshot,
        snapshot_interval_secs=args.snapshot_interval_secs,
        ignore_bad_snapshot=args.ignore_bad_snapshot,
        workers=tuple(workers),
        replay_timeout_secs=args.replay_timeout_secs,
        full_gc_interval_secs=args.full_gc_interval_secs,
        nats=nats,
        peer_credentials=peer_credentials(args),
        allowed_endpoints=args.allowed_endpoints,
    ))
    serve(app, args, gc_thresholds=YOUNG_ONLY_GC_THRESHOLDS)


if __name__ == "__main__":
    main()
