"""Test support: the library's `Stack` (dynamo_lite.stack) with the tests' defaults.

    with gateway_stack(engines=3) as stack:
        httpx.post(stack.url + "/v1/completions", ...)
        stack.kill("engine0"); stack.stop("picker"); stack.start("picker"); stack.wait_idle()

Engines at 50 times the default timing, worker ids from 100, the services logging warnings and
the picker info (its pool file read every 0.2 s, 5 s to drain), Envoy from
deploy/envoy/envoy-fallbacks.yaml checking the picker every 0.2 s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dynamo_lite.stack import Stack
from support.envoy_support import FALLBACKS_CONFIG, envoy_settings

BLOCK = 16
MODEL = "mock"
PICKER_FLAGS = ["--pool-poll-secs", "0.2", "--shutdown-grace-secs", "5", "--log-level", "info"]


def gateway_stack(*, engines: int = 3, speedup: float = 50.0, picker_flags: Sequence[str] = (),
                  failure_mode_allow: bool = False, envoy: dict[str, Any] | None = None, **stack_args: Any) -> Stack:
    """A `Stack` (enter it to start it); `envoy`: further `EnvoySettings` fields, `stack_args`
    further `Stack` arguments (`engine_flags`, `roles`, `state`, ...)."""
    settings = envoy_settings(config_file=FALLBACKS_CONFIG, failure_mode_allow=failure_mode_allow,
                              health_check_interval="0.2s", **(envoy or {}))
    return Stack(engines=engines, speedup=speedup, block_size=BLOCK, model=MODEL, first_worker_id=100,
                 log_level="warning", picker_flags=[*PICKER_FLAGS, *picker_flags], envoys={"envoy": settings},
                 **stack_args)
