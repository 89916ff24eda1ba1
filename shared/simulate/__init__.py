"""Fleet simulator: replays a Mooncake request trace against the running slot tracker and
indexer over HTTP, with simulated workers, and reports how well each routing policy did.

The services are real; the workers, their KV caches and time are simulated. `trace` expands
Mooncake hash ids into Dynamo block hashes, `fleet` models each rank's LRU prefix cache and the
KV events it publishes, `policies` are the routers compared, `engine` is the discrete-event
replay, `metrics`/`calls` measure load and call latency, `report` prints the results.
Run it with `python -m dynamo_lite.simulate --trace FILE`.
"""

from .engine import PolicyResult, Simulation
from .fleet import Fleet, FleetConfig, RankCache
from .policies import POLICY_NAMES
from .trace import SimRequest, TraceError, TraceRecord, expand_trace, load_trace

__all__ = [
    "POLICY_NAMES",
    "Fleet",
    "FleetConfig",
    "PolicyResult",
    "RankCache",
    "SimRequest",
    "Simulation",
    "TraceError",
    "TraceRecord",
    "expand_trace",
    "load_trace",
]
