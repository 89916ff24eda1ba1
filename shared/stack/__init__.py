"""The local gateway stack as a library: `Stack` (every part a real process on loopback, see
`dynamo_lite.stack.stack`), `Envoy` and its configuration variants (`dynamo_lite.stack.envoy`),
`Process` (`dynamo_lite.stack.processes`). `python -m dynamo_lite.stack` (`__main__`) is the
command built on it; the tests and the benchmarks build on it too."""

from .envoy import (
    LEAST_REQUEST,
    PICKER_ACCESS_LOG,
    PICKER_FULL,
    PICKER_HEADERS_ONLY,
    PICKER_OBSERVER,
    PICKER_OBSERVER_5S,
    ROUND_ROBIN,
    VARIANTS,
    Envoy,
    EnvoySettings,
    envoy_binary,
    envoy_config,
)
from .processes import LOOPBACK, Process, StackError, free_port, port_taken
from .stack import KV_BLOCKS, Engine, FixedPorts, Stack

__all__ = ["KV_BLOCKS", "LEAST_REQUEST", "LOOPBACK", "PICKER_ACCESS_LOG", "PICKER_FULL", "PICKER_HEADERS_ONLY",
           "PICKER_OBSERVER", "PICKER_OBSERVER_5S", "ROUND_ROBIN", "VARIANTS", "Engine", "Envoy", "EnvoySettings",
           "FixedPorts", "Process", "Stack", "StackError", "envoy_binary", "envoy_config", "free_port", "port_taken"]
