"""`python -m dynamo_lite.mock_engine`: an OpenAI-compatible engine stand-in that answers like
vLLM, keeps a real prefix cache and publishes vLLM's KV events over ZMQ."""

from __future__ import annotations

import argparse
import logging
import os

from dynamo_lite.base.timing import DECODE_SECS_PER_RUNNING, DECODE_STEP_SECS, PREFILL_SECS_PER_TOKEN, TimingModel
from dynamo_lite.kv_publishers import WireFormat
from dynamo_lite.routing.tokenizer import Tokenizer, TokenizerError
from dynamo_lite.web.cli import configure_logging, non_negative_float, parse_args, positive_float, serve, service_parser

from .app import create_app
from .engine import EngineConfig, KvEventsConfig, KvEventsConfigError
from .kv_transfer import (
    DEFAULT_BANDWIDTH_GBPS,
    DEFAULT_HOLD_SECS,
    DEFAULT_KV_BYTES_PER_TOKEN,
    KvTransferConfig,
    KvTransferConfigError,
    TransferModel,
)

DEFAULT_PORT = 8000
# On by default, where vLLM's own default endpoint is (and the replay socket next to it), so
# `--workers 1=tcp://127.0.0.1:5557+tcp://127.0.0.1:5558` on the indexer just works.
DEFAULT_KV_EVENTS_CONFIG = ('{"enable_kv_cache_events": true, "publisher": "zmq", '
                            '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}')


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = service_parser(
        "python -m dynamo_lite.mock_engine",
        "An engine stand-in: vLLM's OpenAI-compatible API with a real prefix cache, a timing model "
        "and vLLM's KV events over ZMQ; no GPU, no model weights.",
        DEFAULT_PORT,
    )
    model = parser.add_argument_group("model (named as vLLM names them)")
    model.add_argument("--served-model-name", default="mock", help="the model name requests must use")
    model.add_argument("--tokenizer", default=None,
                       help="a tokenizer directory (tokenizer.json + tokenizer_config.json with a chat_template); "
                       "default: the small tokenizer shipped with dynamo_lite")
    model.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME",
                       help="LoRA adapter names served beside the model (a request naming one hashes its blocks "
                       "with the adapter's name, as vLLM does); NAME=path is accepted, the path is ignored")
    model.add_argument("--max-model-len", type=_positive_int, default=8192,
                       help="longest prompt + output, in tokens (capped at the KV cache's size)")
    model.add_argument("--default-max-tokens", type=_positive_int, default=128,
                       help="max_tokens of a chat request that sets none (vLLM fills the context; a stand-in "
                       "should not); completions default to 16, as OpenAI's and vLLM's")
    model.add_argument("--seed", type=int, default=0, help="seed of the generated filler text")
    cache = parser.add_argument_group("KV cache and scheduler")
    cache.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV block")
    cache.add_argument("--num-blocks", "--num-gpu-blocks-override", dest="num_blocks", type=_positive_int,
                       default=8192, help="KV blocks per data-parallel rank")
    cache.add_argument("--max-num-seqs", type=_positive_int, default=256, help="most requests running in a batch")
    cache.add_argument("--max-num-batched-tokens", type=_positive_int, default=8192,
                       help="tokens one engine step computes at most (prefill chunks + one per decoding request)")
    cache.add_argument("--data-parallel-size", type=_positive_int, default=1,
                       help="ranks behind this one server, each with its own cache; rank r publishes on the "
                       "KV events ports + r and writes r as data_parallel_rank")
    timing = parser.add_argument_group(
        "timing model (defaults: Llama 3.1 8B on one H100, see dynamo_lite/base/timing.py)")
    timing.add_argument("--prefill-secs-per-token", type=non_negative_float, default=PREFILL_SECS_PER_TOKEN,
                        help="prefill time per uncached prompt token")
    timing.add_argument("--decode-step-secs", type=non_negative_float, default=DECODE_STEP_SECS,
                        help="one decode step with one running request")
    timing.add_argument("--decode-secs-per-running", type=non_negative_float, default=DECODE_SECS_PER_RUNNING,
                        help="added to a decode step for each further running request")
    timing.add_argument("--speedup-ratio", type=positive_float, default=1.0,
                        help="run this many times faster than the model says (tests, demos)")
    events = parser.add_argument_group("KV events")
    events.add_argument("--kv-events-config", default=DEFAULT_KV_EVENTS_CONFIG,
                        help="vLLM's JSON (fields enable_kv_cache_events, publisher, endpoint, replay_endpoint, "
                        "buffer_steps, hwm, max_queue_size, topic); the default publishes as Dynamo's vLLM worker "
                        "does out of the box; '{\"enable_kv_cache_events\": false}' publishes nothing")
    events.add_argument("--kv-events-format", choices=["vllm", "sglang"], default="vllm",
                        help="vllm: vLLM 0.33's byte layout; sglang: SGLang 0.5's (signed hashes, attn_dp_rank)")
    events.add_argument("--prefix-caching-hash-seed", default=None,
                        help="seed of vLLM's NONE_HASH (vLLM takes PYTHONHASHSEED); default: PYTHONHASHSEED, "
                        "else random per process, as vLLM")
    transfer = parser.add_argument_group(
        "prefill/decode disaggregation (vLLM's NixlConnector; see docs/disaggregation.md)")
    transfer.add_argument("--kv-transfer-config", default=None,
                          help="vLLM's JSON, e.g. '{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_both\"}' "
                          "(fields kv_connector, kv_role, engine_id read; vLLM's others accepted): requests' "
                          "kv_transfer_params then make this a prefill or a decode engine; default: no connector "
                          "(kv_transfer_params ignored)")
    transfer.add_argument("--kv-transfer-bandwidth-gbps", type=positive_float, default=DEFAULT_BANDWIDTH_GBPS,
                          help="gigabits per second a decode engine reads a prefill engine's blocks at; default: 200, "
                          "one 400 Gb/s RDMA NIC per GPU at half its line rate (fit it to your measurements)")
    transfer.add_argument("--kv-bytes-per-token", type=_positive_int, default=DEFAULT_KV_BYTES_PER_TOKEN,
                          help="KV bytes of one token (x --block-size: one block's transfer); default: 131072, Llama 3.1 "
                          "8B in BF16 (32 layers x 8 KV heads x 128 dims x K and V x 2 bytes)")
    transfer.add_argument("--kv-transfer-hold-secs", type=positive_float, default=DEFAULT_HOLD_SECS,
                          help="how long a prefill engine holds a finished prefill's blocks for the decode engine to "
                          "read before freeing them (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT)")
    return parser


def side_channel_host(bind_host: str) -> str:
    """The host a prefill answer names as `remote_host`: VLLM_NIXL_SIDE_CHANNEL_HOST (as vLLM),
    else the bound address, else (bound to every address) vLLM's default, localhost."""
    host = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST")
    if host:
        return host
    return "localhost" if bind_host in ("", "0.0.0.0", "::") else bind_host


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parse_args(parser, argv)
    configure_logging(args.log_level, args.log_format)
    log = logging.getLogger("dynamo_lite.mock_engine")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per read of remote blocks otherwise
    try:
        kv_events = KvEventsConfig.parse(args.kv_events_config)
    except KvEventsConfigError as exc:
        parser.error(str(exc))
    try:
        kv_transfer = None if args.kv_transfer_config is None else KvTransferConfig.parse(args.kv_transfer_config)
    except KvTransferConfigError as exc:
        parser.error(str(exc))
    try:
        tokenizer = Tokenizer.load(args.tokenizer)
    except TokenizerError as exc:
        parser.error(f"--tokenizer: {exc}")
    timing = TimingModel(args.prefill_secs_per_token, args.decode_step_secs,
                         args.decode_secs_per_running).scaled(args.speedup_ratio)
    lora_names = tuple(name.partition("=")[0] for name in args.lora_modules)
    config = EngineConfig(
        model=args.served_model_name, block_size=args.block_size, num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, data_parallel_size=args.data_parallel_size, timing=timing,
        kv_events=kv_events, kv_events_format=WireFormat.VLLM if args.kv_events_format == "vllm" else WireFormat.SGLANG,
        seed=args.seed, hash_seed=args.prefix_caching_hash_seed, kv_transfer=kv_transfer,
        transfer=TransferModel(args.kv_bytes_per_token, args.kv_transfer_bandwidth_gbps,
                               args.kv_transfer_hold_secs).scaled(args.speedup_ratio),
        side_channel_host=side_channel_host(args.host), side_channel_port=args.port,
    )
    try:
        app = create_app(config, tokenizer, default_max_tokens=args.default_max_tokens, lora_names=lora_names)
    except Exception as exc:  # noqa: BLE001 - a KV events port in use, a bad endpoint, a bad LoRA: all end the start
        log.error("cannot start: %s", exc)
        raise SystemExit(3) from None
    log.info(
        "engine stand-in for model %r: %d rank(s) x %d blocks of %d tokens, tokenizer %s; KV events %s",
        config.model, config.data_parallel_size, config.num_blocks, config.block_size, tokenizer.name,
        f"{args.kv_events_format} on {kv_events.endpoint}" + (f" (replay {kv_events.replay_endpoint})"
                                                            if kv_events.replay_endpoint else "")
        if kv_events.publishes else "off",
    )
    if kv_transfer is not None:
        log.info("KV connector %s, role %s, engine id %s: side channel http://%s:%d%s", kv_transfer.kv_connector,
                 kv_transfer.kv_role, kv_transfer.engine_id, config.side_channel_host, config.side_channel_port,
                 "/kv_transfer/read")
    serve(app, args)


if __name__ == "__main__":
    main()
