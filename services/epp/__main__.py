"""`python -m dynamo_lite.epp`: the Envoy endpoint picker (GIE Endpoint Picker Protocol over
ext_proc gRPC) that routes each request with the slot tracker and the indexer."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from dynamo_lite.routing.scheduling import SchedulerConfigError
from dynamo_lite.routing.scheduling.flags import add_scheduling_arguments, scheduler_config
from dynamo_lite.web.cli import (
    add_client_arguments,
    add_security_arguments,
    check_security_arguments,
    client_credentials_from,
    configure_logging,
    non_negative_float,
    non_negative_int,
    parse_args,
    positive_float,
    positive_int,
    serve,
    service_parser,
)

from .access_log import DEFAULT_SILENCE_SECS
from .app import DEFAULT_ENGINE_METRICS_SECS, DEFAULT_GRPC_PORT, DEFAULT_METRICS_PORT, EppConfig, create_app
from .disagg import DEFAULT_MIN_UNCACHED_TOKENS, DEFAULT_PREFILL_BUSY_FRAC, DisaggSettings
from .picker import (
    DEFAULT_FALLBACKS,
    DEFAULT_MAX_PROMPT_TOKENS,
    DEFAULT_OUTPUT_ESTIMATE_SECS,
    DEFAULT_PRIORITY_HEADER,
    DEFAULT_SESSION_HEADER,
    PickerSettings,
)
from .prefill_health import DEFAULT_PROBE_SECS
from .prompt import DEFAULT_TOKENIZER_THREADS
from .queue import QueuePolicy
from .state import IN_PROCESS, SERVICES, STATES

SERVICES_API_KEY_FLAG = "--services-api-key"


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port") from None
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port")
    return value


def _queue_threshold(text: str) -> float | None:
    if text.lower() in ("none", "off", ""):
        return None
    return positive_float(text)


def build_parser() -> argparse.ArgumentParser:
    parser = service_parser(
        "python -m dynamo_lite.epp",
        "Envoy endpoint picker: answers Envoy's ext_proc stream with the engine that should serve each "
        "LLM request, by KV cache overlap (indexer) and load (slot tracker), and books the request there.",
        DEFAULT_GRPC_PORT,
    )
    for action in parser._actions:  # the shared --port is the gRPC one here, as GIE's picker
        if action.dest == "port":
            action.help = ("gRPC port Envoy's ext_proc filter calls: ext_proc and gRPC health (liveness, "
                           "readiness, the ExternalProcessor service)")
        if action.dest == "host":
            action.help = ("address both the gRPC and the HTTP side bind (the gRPC side takes no key: a trusted "
                           "network, or mutual TLS with --cert, --key and --client-ca)")
    parser.add_argument("--metrics-port", type=_port, default=DEFAULT_METRICS_PORT,
                        help="HTTP port of /metrics, /health, /ready, /pool, /scheduler and POST /busy_threshold (with "
                        "--api-key: /pool, /scheduler and /metrics need a key, /busy_threshold a full one)")
    parser.add_argument("--cert", default=None, help="PEM certificate: serve gRPC over TLS (with --key)")
    parser.add_argument("--key", default=None, help="PEM private key of --cert")
    parser.add_argument("--client-ca", default=None,
                        help="PEM CA bundle: gRPC callers (Envoy) must present a certificate it signed (mutual "
                        "TLS; needs --cert). --cert, --key and this file are read again when they change")
    services = parser.add_argument_group("the services and the pool")
    services.add_argument("--pool", required=False, default=None, type=Path,
                          help="JSON or YAML list of endpoints {address, worker_id, dp_rank, model, block_size, "
                          "kv_events_endpoint?, replay_endpoint?, max_num_batched_tokens?, lora_names?, role?}; re-read "
                          "on change and on SIGHUP (required)")
    services.add_argument("--state", choices=STATES, default=SERVICES,
                          help=f"where the index and the loads live: '{SERVICES}', the slot tracker and the indexer "
                          f"(several pickers share them; two HTTP reads per pick); '{IN_PROCESS}', this picker's own "
                          "process (it subscribes to the engines' KV events itself and books on its own slot "
                          "tracker: the fastest pick, for one picker alone; --slot-tracker and --indexer unused)")
    services.add_argument("--slot-tracker", default="http://127.0.0.1:8091", help="slot tracker base URL")
    services.add_argument("--indexer", default="http://127.0.0.1:8090", help="indexer base URL")
    services.add_argument("--tokenizer", default=None,
                          help="tokenizer directory (tokenizer.json + tokenizer_config.json); default: the "
                          "engine stand-in's shipped tokenizer")
    services.add_argument("--render-url", default=None,
                          help="tokenize with vLLM's render endpoints at this base URL instead of locally")
    services.add_argument("--tokenizer-threads", type=non_negative_int, default=DEFAULT_TOKENIZER_THREADS,
                          help="threads tokenizing long prompts off the event loop that relays the answers (0: "
                          "tokenize every prompt on the loop)")
    services.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                          help="refuse longer prompts with 400 context_length_exceeded before asking any service "
                          f"(default: the shortest context length the engines report, else {DEFAULT_MAX_PROMPT_TOKENS:,})")
    services.add_argument("--pool-poll-secs", type=positive_float, default=1.0,
                          help="how often the pool file is checked for changes (and unregistered endpoints retried)")
    routing = parser.add_argument_group(
        "routing (the scheduling cycle: docs/routing.md; a flag given here overrides --scheduler-config)")
    add_scheduling_arguments(routing)
    routing.add_argument("--session-header", default=DEFAULT_SESSION_HEADER,
                         help="request header naming the conversation: its requests stay where its cache is while "
                         "that is not too costly ('' turns sessions off)")
    routing.add_argument("--session-affinity-ttl-secs", type=non_negative_float, default=None,
                         help="how long a session stays pinned after its last request (default 300)")
    routing.add_argument("--engine-metrics-secs", type=non_negative_float, default=DEFAULT_ENGINE_METRICS_SECS,
                         help="how often each engine's /metrics is read (KV capacity, inter-token latency) for the "
                         "scheduler; 0: never")
    routing.add_argument("--fallbacks", type=non_negative_int, default=DEFAULT_FALLBACKS,
                         help="next best endpoints handed to Envoy after the pick")
    routing.add_argument("--seed", type=int, default=None, help="seed of tie-breaking and sampling")
    disagg = parser.add_argument_group(
        "disaggregation (pools with role: prefill endpoints; docs/disaggregation.md)",
        "The request goes to a decode endpoint; it is prefilled on a prefill endpoint (named in the "
        "x-prefiller-host-port header, which the P/D sidecar beside the decode engine reads) when its prompt's "
        "uncached tokens there exceed --disagg-min-uncached-tokens and some prefill endpoint is not busy.")
    disagg.add_argument("--disagg-min-uncached-tokens", type=non_negative_int, default=DEFAULT_MIN_UNCACHED_TOKENS,
                        help="prefill on a prefill endpoint only prompts with more tokens than this not cached on the "
                        "chosen decode endpoint (Dynamo's effective-ISL threshold); shorter ones run aggregated there")
    disagg.add_argument("--disagg-prefill-busy-frac", type=_queue_threshold, default=DEFAULT_PREFILL_BUSY_FRAC,
                        help="a prefill endpoint with this fraction of its max_num_batched_tokens of prefill booked "
                        "is busy (as are those over the busy thresholds above); every one busy: the request runs "
                        "aggregated on the decode endpoint. 'none': the busy thresholds alone")
    disagg.add_argument("--prefill-probe-secs", type=non_negative_float, default=DEFAULT_PROBE_SECS,
                        help="ask each prefill endpoint's GET /health this often; one that does not answer 200 is "
                        "not named until it does (none up: requests run aggregated). 0: never asked, always named")
    queue = parser.add_argument_group("queue (when every candidate is busy)")
    queue.add_argument("--router-queue-threshold", type=_queue_threshold, default=2.0,
                       help="hold requests while every candidate's active prefill exceeds this fraction of its "
                       "max_num_batched_tokens (or it is busy); 'none': answer 429 at once instead")
    queue.add_argument("--router-queue-policy", choices=[policy.value for policy in QueuePolicy], default="fcfs",
                       help="fcfs: by (priority-adjusted) arrival, best tail TTFT; wspt: short and high-priority "
                       "first, best mean TTFT")
    queue.add_argument("--queue-max-wait-secs", type=positive_float, default=30.0,
                       help="a request waiting longer is answered 429 (dropped reason queue-timeout)")
    queue.add_argument("--queue-max-size", type=non_negative_int, default=1024,
                       help="requests beyond this many waiting are answered 429 (queue-full)")
    queue.add_argument("--priority-header", default=DEFAULT_PRIORITY_HEADER,
                       help="request header with a priority, in seconds a request may jump ahead in the queue "
                       "(Dynamo's latency_sensitivity)")
    answers = parser.add_argument_group(
        "answers the gateway hands back after their first chunk (deploy/envoy/envoy-access-log.yaml)",
        "With that Envoy file the picker sees each answer's first chunk only and learns its end from Envoy's "
        "gRPC access log (envoy.service.accesslog.v3, served on --port beside ext_proc: nothing to turn on "
        "here; not the HTTP --access-log above); the output in between is estimated. About 1.4 ms of picker "
        "CPU per answer whatever its length, against 10 ms for a 256-token answer relayed chunk by chunk "
        "(docs/gateway.md).")
    answers.add_argument("--access-log-silence-secs", type=non_negative_float, default=DEFAULT_SILENCE_SECS,
                         help="an answer whose end Envoy's access log has not reported, and whose stream it has not "
                         "listed among those still running, for this long ends 'lost' (its booking freed); keep it "
                         "above Envoy's access_log_flush_interval (10 s as shipped); 0: never")
    answers.add_argument("--output-estimate-secs", type=positive_float, default=DEFAULT_OUTPUT_ESTIMATE_SECS,
                         help="how often the output of such answers is re-estimated from their engine's decode step "
                         "(/output_blocks as it grows: shorter tracks the load closer and costs more calls)")
    parser.add_argument("--shutdown-grace-secs", type=non_negative_float, default=30.0,
                        help="on SIGTERM, how long streams in flight may take to finish")
    # The HTTP side's keys and TLS are the services' flags; the picker presents its first full
    # key to the services unless --services-api-key says otherwise (one fleet, one key).
    add_security_arguments(parser)
    add_client_arguments(parser, api_key_flag=SERVICES_API_KEY_FLAG,
                         default_key="the first full key of --api-key / --api-key-file")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parse_args(parser, argv)
    if args.pool is None:
        parser.error("--pool FILE is required (a JSON or YAML list of the engines to route to)")
    if (args.cert is None) != (args.key is None):
        parser.error("--cert and --key go together")
    if args.client_ca is not None and args.cert is None:
        parser.error("--client-ca needs --cert and --key (a client certificate is checked only over TLS)")
    check_security_arguments(parser, args)
    configure_logging(args.log_level, args.log_format)
    try:
        scheduler = scheduler_config(args, session_ttl_secs=args.session_affinity_ttl_secs)
    except SchedulerConfigError as exc:
        parser.error(str(exc))
    settings = PickerSettings(
        scheduler=scheduler, queue_threshold=args.router_queue_threshold,
        queue_policy=QueuePolicy(args.router_queue_policy), queue_max_wait_secs=args.queue_max_wait_secs,
        queue_max_size=args.queue_max_size, priority_header=args.priority_header.lower(),
        session_header=args.session_header.lower() or None, fallbacks=args.fallbacks, seed=args.seed,
        max_prompt_tokens=args.max_prompt_tokens, output_estimate_secs=args.output_estimate_secs,
        disagg=DisaggSettings(min_uncached_tokens=args.disagg_min_uncached_tokens,
                              prefill_busy_frac=args.disagg_prefill_busy_frac),
    )
    own_key = args.api_keys.write_keys[0] if args.api_keys is not None else None
    config = EppConfig(
        pool_file=args.pool, slot_tracker_url=args.slot_tracker, indexer_url=args.indexer, tokenizer=args.tokenizer,
        state=args.state,
        render_url=args.render_url, grpc_host=args.host, grpc_port=args.port, cert=args.cert, key=args.key,
        client_ca=args.client_ca, engine_metrics_secs=args.engine_metrics_secs,
        prefill_probe_secs=args.prefill_probe_secs,
        tokenizer_threads=args.tokenizer_threads, access_log_silence_secs=args.access_log_silence_secs,
        picker=settings, pool_poll_secs=args.pool_poll_secs, shutdown_grace_secs=args.shutdown_grace_secs,
        credentials=client_credentials_from(args, api_key_flag=SERVICES_API_KEY_FLAG,
                                            default_key=own_key.decode() if own_key else None),
    )
    log = logging.getLogger("dynamo_lite.epp")
    log.info("endpoint picker: gRPC on %s:%d%s, HTTP on port %d, pool %s, %s",
             args.host, args.port, (" (mutual TLS)" if args.client_ca else " (TLS)") if args.cert else "",
             args.metrics_port, args.pool, "index and loads in process" if args.state == IN_PROCESS else
             f"slot tracker {args.slot_tracker}, indexer {args.indexer}")
    log.info("routing: %s", scheduler.describe())
    args.port = args.metrics_port  # what `serve` binds: the HTTP side
    serve(create_app(config), args)


if __name__ == "__main__":
    main()
