"""The scheduling cycle's command-line flags, shared by every service that schedules (the
endpoint picker, the selection service): which cost, from which file, with which overrides."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from dynamo_lite.web.cli import non_negative_float, non_negative_int

from .config import COSTS, SchedulerConfig, SchedulerConfigError, load_config, preset


def add_scheduling_arguments(group: argparse._ArgumentGroup) -> None:
    """--cost, --scheduler-config, --overlap-score-weight, --router-temperature and the busy
    thresholds, into `group`."""
    group.add_argument("--cost", choices=COSTS, default=None,
                       help="ttft (default): the least predicted time to first token plus what the request's cache "
                       "writes cost later requests; dynamo: Dynamo's overlap_weight * prefill_blocks + decode_blocks")
    group.add_argument("--scheduler-config", type=Path, default=None, metavar="FILE",
                       help="YAML file naming the scorers and their weights, the temperature, busy thresholds, "
                       "sessions and the engines' timing (docs/routing.md); --cost picks a preset instead")
    group.add_argument("--overlap-score-weight", "--router-kv-overlap-score-weight", dest="overlap_score_weight",
                       type=non_negative_float, default=None,
                       help="with --cost dynamo: cost = weight * prefill_blocks + decode_blocks (default 1; 0 "
                       "ignores the cache)")
    group.add_argument("--router-temperature", type=non_negative_float, default=None,
                       help="0 (default): the cheapest rank; higher: softmax sampling over normalised costs")
    group.add_argument("--active-decode-blocks-threshold", type=non_negative_int, default=None,
                       help="a rank whose decode blocks with this request would exceed this is busy")
    group.add_argument("--active-prefill-tokens-threshold", type=non_negative_int, default=None,
                       help="a rank with more active prefill tokens than this is busy")
    group.add_argument("--active-prefill-tokens-threshold-frac", type=non_negative_float, default=None,
                       help="... or more than this fraction of its max_num_batched_tokens")


def scheduler_config(args: argparse.Namespace, *, session_ttl_secs: float | None = None) -> SchedulerConfig:
    """The scheduling cycle from --scheduler-config or --cost, then the flags given on top
    (`session_ttl_secs`: the service's own session flag, when it has one)."""
    if args.scheduler_config is not None and args.cost is not None:
        raise SchedulerConfigError("--cost and --scheduler-config go one or the other (the file may say `cost:`)")
    config = load_config(args.scheduler_config) if args.scheduler_config is not None else preset(args.cost or "ttft")
    changes: dict[str, Any] = {}
    if args.overlap_score_weight is not None:
        if "prefill_blocks" not in config.weights:
            raise SchedulerConfigError(
                f"--overlap-score-weight is a weight of Dynamo's cost (--cost dynamo); the {config.cost!r} cost in "
                "force has no prefill_blocks scorer (docs/routing.md)")
        changes["scorers"] = tuple((name, args.overlap_score_weight if name == "prefill_blocks" else weight)
                                   for name, weight in config.scorers)
    if args.router_temperature is not None:
        changes["temperature"] = args.router_temperature
    thresholds = {name: getattr(args, name) for name in ("active_decode_blocks_threshold",
                  "active_prefill_tokens_threshold", "active_prefill_tokens_threshold_frac")
                  if getattr(args, name) is not None}
    if thresholds:
        changes["busy"] = replace(config.busy, **thresholds)
    if session_ttl_secs is not None:
        changes["session_ttl_secs"] = session_ttl_secs
    return replace(config, **changes) if changes else config


__all__ = ["add_scheduling_arguments", "scheduler_config"]
