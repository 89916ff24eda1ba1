"""A scheduler declared once: which scorers with which weights, the picker's temperature, the
filters' thresholds, sessions, and the engines' timing. From a YAML file, a preset, or flags.

    # scheduler.yaml (`--scheduler-config scheduler.yaml`)
    cost: ttft                  # a preset to start from: ttft (the default) or dynamo
    scorers:                    # replaces the preset's scorers: name -> weight
      prefill_time: 1
      decode_interference: 1
      cache_pressure: 1
    temperature: 0              # 0: the cheapest rank; > 0: softmax over normalised costs
    busy:                       # Dynamo's busy thresholds (null: none)
      active_decode_blocks_threshold: null
      active_prefill_tokens_threshold: null
      active_prefill_tokens_threshold_frac: null
    kv_capacity_filter: true    # prefer ranks whose KV blocks in use fit their capacity
    sessions: {ttl_secs: 300, max_entries: 100000}
    timing:                     # the engines' timing before anything is learned
      prefill_secs_per_token: 3.2e-5
      decode_step_secs: 0.0068
      decode_secs_per_running: 6.0e-5
      learn: true               # fit each engine's rates to the times to first token observed

Unknown keys, unknown scorers and bad values raise `SchedulerConfigError` naming them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from dynamo_lite.base.timing import TimingModel

from .parts import SCORERS, BusyThresholds

DEFAULT_SESSION_TTL_SECS = 300.0
DEFAULT_SESSION_MAX_ENTRIES = 100_000
COSTS = ("ttft", "dynamo")
"""The presets `--cost` names: the default cost in predicted time, and Dynamo's in blocks."""


class SchedulerConfigError(ValueError):
    """A scheduler configuration that cannot be used; the message names the key."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """One scheduling cycle's parts (see the module docstring). `cost` names the preset the
    scorers came from ("custom" when a file replaced them)."""

    cost: str = "ttft"
    scorers: tuple[tuple[str, float], ...] = (("prefill_time", 1.0), ("decode_interference", 1.0),
                                              ("cache_pressure", 1.0))
    temperature: float = 0.0
    busy: BusyThresholds = field(default_factory=BusyThresholds)
    kv_capacity_filter: bool = True
    session_ttl_secs: float = DEFAULT_SESSION_TTL_SECS
    session_max_entries: int = DEFAULT_SESSION_MAX_ENTRIES
    timing: TimingModel = field(default_factory=TimingModel)
    learn_rates: bool = True

    def __post_init__(self) -> None:
        if not self.scorers:
            raise SchedulerConfigError("scorers: at least one scorer is needed")
        seen: set[str] = set()
        for name, weight in self.scorers:
            if name not in SCORERS:
                raise SchedulerConfigError(f"scorers: unknown scorer {name!r}; known: {', '.join(SCORERS)}")
            if name in seen:
                raise SchedulerConfigError(f"scorers: {name!r} is listed twice")
            seen.add(name)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (weight >= 0 and math.isfinite(weight)):
                raise SchedulerConfigError(f"scorers: the weight of {name!r} must be a finite number >= 0, not {weight!r}")
        units = {SCORERS[name][1] for name, weight in self.scorers if weight}
        if len(units) > 1:
            raise SchedulerConfigError(
                f"scorers: the weighted scorers mix units ({', '.join(sorted(units))}); a sum of seconds and "
                "blocks means nothing. Use the seconds scorers (prefill_time, decode_interference, cache_pressure) "
                "or Dynamo's block scorers (prefill_blocks, decode_blocks)")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise SchedulerConfigError("temperature must be a finite number >= 0")
        if not (self.session_ttl_secs >= 0 and math.isfinite(self.session_ttl_secs)):
            raise SchedulerConfigError("sessions.ttl_secs must be a finite number >= 0")
        if self.session_max_entries < 0:
            raise SchedulerConfigError("sessions.max_entries must be >= 0")

    @property
    def weights(self) -> dict[str, float]:
        """Each scorer's weight by name."""
        return dict(self.scorers)

    @property
    def overlap_score_weight(self) -> float | None:
        """Dynamo's overlap weight (the prefill_blocks scorer's weight), for the `dynamo` cost."""
        return self.weights.get("prefill_blocks") if self.cost == "dynamo" else None

    @property
    def predicts_time(self) -> bool:
        """Whether the cost is in seconds (every weighted scorer predicts time)."""
        return all(SCORERS[name][1] == "seconds" for name, weight in self.scorers if weight)

    def describe(self) -> str:
        """One line for the start-up log."""
        scorers = " + ".join(f"{weight:g} x {name}" for name, weight in self.scorers)
        thresholds = ", ".join(f"{name}={value}" for name, value in (
            ("active_decode_blocks_threshold", self.busy.active_decode_blocks_threshold),
            ("active_prefill_tokens_threshold", self.busy.active_prefill_tokens_threshold),
            ("active_prefill_tokens_threshold_frac", self.busy.active_prefill_tokens_threshold_frac)) if value is not None)
        return (f"cost {self.cost}: {scorers}; temperature {self.temperature:g}"
                + (f"; busy when {thresholds}" if thresholds else "")
                + f"; sessions {self.session_ttl_secs:g} s; rates {'learned' if self.learn_rates else 'fixed'} from "
                f"{self.timing.prefill_secs_per_token:.3g} s/token prefill, {self.timing.decode_step_secs:.3g} s decode step")


def ttft_config(**changes: Any) -> SchedulerConfig:
    """The default cost: the predicted time to first token plus the cache writes' cost to others."""
    return replace(SchedulerConfig(), **changes)


def dynamo_config(overlap_score_weight: float = 1.0, temperature: float = 0.0,
                  busy: BusyThresholds | None = None, **changes: Any) -> SchedulerConfig:
    """Dynamo 1.6.1's KV router cost: `overlap_score_weight x prefill_blocks + decode_blocks`,
    softmax at `temperature`, Dynamo's busy thresholds; no KV capacity filter, no sessions, no
    learned rates (it predicts no time)."""
    if not (overlap_score_weight >= 0 and math.isfinite(overlap_score_weight)):
        raise SchedulerConfigError("overlap_score_weight must be a finite number >= 0")
    return replace(SchedulerConfig(), cost="dynamo",
                   scorers=(("prefill_blocks", float(overlap_score_weight)), ("decode_blocks", 1.0)),
                   temperature=temperature, busy=busy or BusyThresholds(), kv_capacity_filter=False,
                   session_ttl_secs=0.0, learn_rates=False, **changes)


def preset(cost: str) -> SchedulerConfig:
    """The configuration `--cost` names (`COSTS`); SchedulerConfigError for another name."""
    if cost == "ttft":
        return ttft_config()
    if cost == "dynamo":
        return dynamo_config()
    raise SchedulerConfigError(f"cost: unknown cost {cost!r}; known: {', '.join(COSTS)}")


_KEYS = {"cost", "scorers", "temperature", "busy", "kv_capacity_filter", "sessions", "timing"}
_BUSY_KEYS = ("active_decode_blocks_threshold", "active_prefill_tokens_threshold",
              "active_prefill_tokens_threshold_frac")
_TIMING_KEYS = ("prefill_secs_per_token", "decode_step_secs", "decode_secs_per_running")


def parse_config(document: Any, *, source: str = "the scheduler configuration") -> SchedulerConfig:
    """A `SchedulerConfig` from a parsed YAML/JSON document (None or {} : the default)."""
    if document is None:
        return preset("ttft")
    if not isinstance(document, Mapping):
        raise SchedulerConfigError(f"{source}: must be a mapping of settings, not {type(document).__name__}")
    unknown = sorted(set(map(str, document)) - _KEYS)
    if unknown:
        raise SchedulerConfigError(f"{source}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_KEYS))}")
    cost = document.get("cost", "ttft")
    if not isinstance(cost, str):
        raise SchedulerConfigError(f"{source}: cost must be one of {', '.join(COSTS)}")
    try:
        config = preset(cost)
    except SchedulerConfigError as exc:
        raise SchedulerConfigError(f"{source}: {exc}") from None
    changes: dict[str, Any] = {}
    try:
        if "scorers" in document:
            scorers = document["scorers"]
            if not isinstance(scorers, Mapping) or not scorers:
                raise SchedulerConfigError("scorers must be a non-empty mapping of scorer name to weight")
            changes["scorers"] = tuple((str(name), _number(f"scorers.{name}", weight)) for name, weight in scorers.items())
            changes["cost"] = "custom"
        if "temperature" in document:
            changes["temperature"] = _number("temperature", document["temperature"])
        if "busy" in document:
            busy = _section("busy", document["busy"], _BUSY_KEYS)
            try:
                changes["busy"] = BusyThresholds(**busy)
            except (TypeError, ValueError) as exc:
                raise SchedulerConfigError(f"busy: {exc}") from None
        if "kv_capacity_filter" in document:
            value = document["kv_capacity_filter"]
            if not isinstance(value, bool):
                raise SchedulerConfigError("kv_capacity_filter must be true or false")
            changes["kv_capacity_filter"] = value
        if "sessions" in document:
            sessions = _section("sessions", document["sessions"], ("ttl_secs", "max_entries"))
            if "ttl_secs" in sessions:
                changes["session_ttl_secs"] = _number("sessions.ttl_secs", sessions["ttl_secs"])
            if "max_entries" in sessions:
                entries = sessions["max_entries"]
                if isinstance(entries, bool) or not isinstance(entries, int) or entries < 0:
                    raise SchedulerConfigError("sessions.max_entries must be an integer >= 0")
                changes["session_max_entries"] = entries
        if "timing" in document:
            timing = _section("timing", document["timing"], (*_TIMING_KEYS, "learn"))
            learn = timing.pop("learn", None)
            if learn is not None:
                if not isinstance(learn, bool):
                    raise SchedulerConfigError("timing.learn must be true or false")
                changes["learn_rates"] = learn
            values = {name: _number(f"timing.{name}", value) for name, value in timing.items()}
            try:
                changes["timing"] = replace(config.timing, **values)
            except ValueError as exc:
                raise SchedulerConfigError(f"timing: {exc}") from None
        return replace(config, **changes)
    except SchedulerConfigError as exc:
        raise SchedulerConfigError(f"{source}: {exc}") from None


def load_config(path: str | Path) -> SchedulerConfig:
    """Read a YAML (or JSON) scheduler configuration file."""
    path = Path(path)
    try:
        document = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise SchedulerConfigError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise SchedulerConfigError(f"{path}: not YAML ({exc})") from None
    return parse_config(document, source=str(path))


def _section(name: str, value: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SchedulerConfigError(f"{name} must be a mapping")
    unknown = sorted(set(map(str, value)) - set(keys))
    if unknown:
        raise SchedulerConfigError(f"{name}: unknown key(s) {', '.join(unknown)}; known: {', '.join(keys)}")
    return dict(value)


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value >= 0 and math.isfinite(value)):
        raise SchedulerConfigError(f"{name} must be a finite number >= 0, not {value!r}")
    return float(value)


__all__ = [
    "COSTS", "DEFAULT_SESSION_MAX_ENTRIES", "DEFAULT_SESSION_TTL_SECS", "SchedulerConfig", "SchedulerConfigError",
    "dynamo_config", "load_config", "parse_config", "preset", "ttft_config",
]
