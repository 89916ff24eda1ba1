"""The endpoint picker process: the gRPC ext_proc server Envoy asks, and an HTTP side for
operations (`/health`, `/ready`, `/metrics`, `/busy_threshold`, `/pool`, `/scheduler`).

Both run on one event loop. The HTTP app's lifespan starts everything: the two service clients,
the pool watcher (which registers the pool with both services and re-reads the file on change
or SIGHUP), the picker and the gRPC server. At shutdown the gRPC server stops taking streams
and lets the ones in flight finish (their answers stream to the end and are freed), then the
picker's bookkeeping calls are awaited.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson
from starlette.routing import Route

from dynamo_lite.base.errors import InvalidArgument
from dynamo_lite.client import AsyncIndexerClient, AsyncSlotTrackerClient
from dynamo_lite.routing.tokenizer import Tokenizer
from dynamo_lite.web import http
from dynamo_lite.web.credentials import ClientCredentials
from dynamo_lite.web.http import Answer
from dynamo_lite.web.validation import decode_json

from .access_log import DEFAULT_SILENCE_SECS
from .engine_metrics import EngineMetricsReader
from .grpc_server import EppServer
from .metrics import EppMetrics
from .picker import KvPicker, PickerSettings
from .prefill_health import DEFAULT_PROBE_SECS, PrefillHealth
from .prompt import DEFAULT_TOKENIZER_THREADS, PromptReader
from .registration import PoolRegistrar
from .state import IN_PROCESS, SERVICES, LocalState, PickerState, RemoteState
from .watcher import PoolWatcher

logger = logging.getLogger("dynamo_lite.epp")

DEFAULT_GRPC_PORT = 9002
DEFAULT_METRICS_PORT = 9003
SERVICE_TIMEOUT_SECS = 2.0
DEFAULT_ENGINE_METRICS_SECS = 10.0
THRESHOLDS = ("active_decode_blocks_threshold", "active_prefill_tokens_threshold",
              "active_prefill_tokens_threshold_frac")


@dataclass(frozen=True)
class EppConfig:
    pool_file: Path
    state: str = SERVICES  # IN_PROCESS: the picker holds the index and the loads itself (state.LocalState)
    slot_tracker_url: str = "http://127.0.0.1:8091"
    indexer_url: str = "http://127.0.0.1:8090"
    tokenizer: str | None = None  # None: the engine stand-in's shipped tokenizer
    render_url: str | None = None
    grpc_host: str = "0.0.0.0"
    grpc_port: int = DEFAULT_GRPC_PORT
    cert: str | None = None
    key: str | None = None
    client_ca: str | None = None  # callers of the gRPC port present a certificate this CA signed
    picker: PickerSettings = field(default_factory=PickerSettings)
    pool_poll_secs: float = 1.0
    shutdown_grace_secs: float = 30.0
    engine_metrics_secs: float = DEFAULT_ENGINE_METRICS_SECS  # 0: the engines' /metrics are not read
    prefill_probe_secs: float = DEFAULT_PROBE_SECS  # 0: prefill endpoints are named without asking
    tokenizer_threads: int = DEFAULT_TOKENIZER_THREADS
    # An answer handed to Envoy's access log and not heard of this long ends "lost" (0: never).
    access_log_silence_secs: float = DEFAULT_SILENCE_SECS
    # The key and TLS settings the picker presents to both services.
    credentials: ClientCredentials = field(default_factory=ClientCredentials.from_env)


# What the picker's own routes answer until the picker and the pool watcher are up.
STARTING: Answer = (503, http.error_body("starting"), b"application/json")


class _PickerRoute(http.DirectEndpoint):
    """A route of the picker's HTTP port reading the parts `run` puts in `holder` once up."""

    def __init__(self, holder: dict[str, Any]) -> None:
        self.holder = holder


class BusyThresholdEndpoint(_PickerRoute):
    """`POST /busy_threshold`: change busy thresholds at run time (Dynamo's frontend has the same
    route): `{"active_decode_blocks_threshold": 512}` sets one, a null turns one off, `{}`
    changes nothing; the answer is the thresholds in force."""

    max_body = 64 * 1024

    def respond(self, query_string: bytes, body: bytes) -> Answer:
        picker: KvPicker | None = self.holder.get("picker")
        if picker is None:
            return STARTING
        changes = decode_json(body)
        if not isinstance(changes, dict):
            raise InvalidArgument("the body must be an object naming thresholds to change")
        if changes:
            unknown = sorted(set(changes) - set(THRESHOLDS))
            if unknown:
                raise InvalidArgument(f"unknown threshold(s) {', '.join(unknown)}; known: {', '.join(THRESHOLDS)}")
            for name, value in changes.items():
                if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                    raise InvalidArgument(f"{name} must be a number >= 0 or null")
                if name != "active_prefill_tokens_threshold_frac" and value is not None and value != int(value):
                    raise InvalidArgument(f"{name} must be an integer")
            picker.set_thresholds(**{name: (value if value is None or name.endswith("frac") else int(value))
                                     for name, value in changes.items()})
            logger.info("busy thresholds changed: %s", changes)
        busy = picker.busy_thresholds
        return 200, orjson.dumps({name: getattr(busy, name) for name in THRESHOLDS}), b"application/json"


class PoolEndpointList(_PickerRoute):
    """`GET /pool`: the endpoints in force and whether both services know them."""

    def respond(self, query_string: bytes, body: bytes) -> Answer:
        watcher: PoolWatcher | None = self.holder.get("watcher")
        if watcher is None:
            return STARTING
        endpoints = [asdict(endpoint) for endpoint in watcher.pool]
        return 200, orjson.dumps({"ready": watcher.ready, "endpoints": endpoints}), b"application/json"


class SchedulerState(_PickerRoute):
    """`GET /scheduler`: the scheduling cycle in force and what it has learned per rank (the
    engines' rates fitted to the times to first token, their KV capacity, the share of the recent
    cache writes each took), for an operator asking why a request went where it went."""

    def respond(self, query_string: bytes, body: bytes) -> Answer:
        picker: KvPicker | None = self.holder.get("picker")
        if picker is None:
            return STARTING
        return 200, orjson.dumps(picker.scheduler_state()), b"application/json"


def create_app(config: EppConfig) -> http.Service:
    holder: dict[str, Any] = {}
    metrics_holder: dict[str, EppMetrics] = {}
    local = LocalState() if config.state == IN_PROCESS else None

    @contextlib.asynccontextmanager
    async def lifespan(app: http.Service) -> AsyncIterator[None]:
        tokenizer = Tokenizer.load(config.tokenizer) if config.render_url is None or config.tokenizer else None
        prompts = PromptReader(tokenizer=tokenizer, render_url=config.render_url, threads=config.tokenizer_threads)
        state: PickerState
        if local is None:
            # The lean transport: httpx cost ~1 ms of CPU per call, 87 % of the picker's time
            # (bench.gateway); it needs plain http:// URLs.
            lean = all(url.startswith("http://") for url in (config.slot_tracker_url, config.indexer_url))
            slot_tracker = AsyncSlotTrackerClient(config.slot_tracker_url, timeout=SERVICE_TIMEOUT_SECS, lean=lean,
                                                  credentials=config.credentials)
            indexer = AsyncIndexerClient(config.indexer_url, timeout=SERVICE_TIMEOUT_SECS, lean=lean,
                                         credentials=config.credentials)
            state = RemoteState(slot_tracker, indexer)
            watcher = PoolWatcher(config.pool_file, PoolRegistrar(slot_tracker, indexer), interval=config.pool_poll_secs)
        else:
            state = local
            watcher = PoolWatcher(config.pool_file, local.registrar, interval=config.pool_poll_secs)
        picker = KvPicker(pool=watcher.pool, state=state, prompts=prompts, metrics=metrics_holder["metrics"],
                          settings=config.picker)
        watcher.on_change.append(picker.set_pool)
        holder.update(picker=picker, watcher=watcher)
        app.state.not_ready = lambda: None if watcher.ready else (
            "the pool is not registered yet (see the log)")
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, watcher.reload)
        watch = loop.create_task(watcher.run(), name="pool-watcher")
        background = [watch]
        if config.engine_metrics_secs > 0:
            reader = EngineMetricsReader(lambda: picker.pool, picker.scheduler, config.engine_metrics_secs,
                                         on_context_length=picker.set_context_length)
            background.append(loop.create_task(reader.run(), name="engine-metrics"))
        if config.prefill_probe_secs > 0:
            prefill_health = PrefillHealth(lambda: picker.pool, config.prefill_probe_secs)
            picker.prefill_up = prefill_health.up
            background.append(loop.create_task(prefill_health.run(), name="prefill-health"))
        server = EppServer(picker, host=config.grpc_host, port=config.grpc_port, cert=config.cert, key=config.key,
                           client_ca=config.client_ca, ready=lambda: watcher.ready,
                           access_log_silence_secs=config.access_log_silence_secs, metrics=metrics_holder["metrics"])
        try:
            await server.start()
        except Exception as exc:
            for task in background:
                task.cancel()
            raise RuntimeError(f"cannot serve gRPC on {config.grpc_host}:{config.grpc_port}: {exc}") from exc
        # What start-up built (modules, the tokenizer, the pool) lives as long as the process:
        # out of the collector's sight, full collections scan only what requests leave behind
        # (they were 2 % of the picker's CPU under load, bench.gateway).
        gc.freeze()
        try:
            yield
        finally:
            logger.info("stopping: finishing the streams in flight (up to %.0f s)", config.shutdown_grace_secs)
            await server.stop(config.shutdown_grace_secs)
            await picker.settle()
            for task in background:
                task.cancel()
            for task in background:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            loop.remove_signal_handler(signal.SIGHUP)
            await picker.aclose()
            await state.aclose()

    app = http.Service(
        routes=[
            http.health_route(),
            Route("/busy_threshold", BusyThresholdEndpoint(holder), methods=["POST"]),
            Route("/pool", PoolEndpointList(holder), methods=["GET"]),
            Route("/scheduler", SchedulerState(holder), methods=["GET"]),
        ],
        lifespan=lifespan,
        collectors=local.collectors() if local is not None else (),
    )
    metrics_holder["metrics"] = EppMetrics(app.metrics_registry)
    app.state.holder = holder
    return app


__all__ = ["DEFAULT_ENGINE_METRICS_SECS", "DEFAULT_GRPC_PORT", "DEFAULT_METRICS_PORT", "EppConfig", "create_app"]
