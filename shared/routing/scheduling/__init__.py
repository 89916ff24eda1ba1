"""One scheduling cycle for every entry point: filters, scorers and a picker, declared once.

`KvRouter` (`dynamo_lite.routing`), the endpoint picker (`dynamo_lite.epp`) and the simulator
(`dynamo_lite.simulate`) all run `Scheduler.schedule`. The default cost predicts time: for each
candidate rank, the seconds until the request's first token there (the prefill queued ahead plus
its own uncached tokens at the engine's prefill rate, plus the running decode batch's share of
those steps) plus the seconds its cache writes are expected to cost later requests. `dynamo` is
Dynamo 1.6.1's KV router cost, `overlap_score_weight x prefill_blocks + decode_blocks`. See
docs/routing.md.
"""

from .config import (
    COSTS,
    SchedulerConfig,
    SchedulerConfigError,
    dynamo_config,
    load_config,
    parse_config,
    preset,
    ttft_config,
)
from .cycle import Scheduler
from .model import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    AllBusy,
    NoWorkerAvailable,
    RankCost,
    RankInfo,
    RankState,
    SchedulingRequest,
    Selection,
)
from .parts import SCORERS, BusyThresholds

__all__ = [
    "AllBusy", "BusyThresholds", "COSTS", "DEFAULT_MAX_NUM_BATCHED_TOKENS", "NoWorkerAvailable", "RankCost", "RankInfo",
    "RankState", "SCORERS", "Scheduler", "SchedulerConfig", "SchedulerConfigError", "SchedulingRequest",
    "Selection", "dynamo_config", "load_config", "parse_config", "preset", "ttft_config",
]
