"""What API keys and TLS cost (issue 28), for `python -m bench --only security`.

    python -m bench.security          # the key check, in process: a table
    python -m bench.security --json   # what `python -m bench` reads (it runs this on the server CPU)

The key check is measured on the native server's own path, in process, without sockets: a
`GET /loads` request (a READ route) fed to a connection of the slot tracker app, answered and
written to a transport that drops the bytes, 5,000 times per timing; the same bytes, `Authorization`
header included, go to an app without keys (the header is then ignored) and to apps with one and
with three full keys (the request's key last), in 20 interleaved rounds. The difference of the
best timings per request is what the key costs.

TLS is measured over the network: ours on the server CPU, once on http and once on https
(`--ssl-certfile`, a self-signed certificate made with `openssl`), wrk on the client CPU with
keep-alive connections, on the heavy routes (`/potential_loads` with a 512-hash query, 16 ranks;
`/query_by_hash` with 512 hashes, 16 workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson

from dynamo_lite.slot_tracker.app import create_app
from dynamo_lite.web.auth import Access, ApiKeys
from dynamo_lite.web.server import ConnectionLimits, HttpServer

from .cores import on_server_cpu, print_measured
from .runner import Results, progress
from .servers import CLIENT_CPU, SERVER_CPU, reference_server
from .wrk import WrkError, run_wrk

KEY = "k" * 43  # the length of `openssl rand -base64 32`
REQUESTS = 5_000  # per timing
ROUNDS = 20
TIMINGS = 5
KEY_CHECK_ROW = "API key check per request (keyed − open, native server, GET /loads)"
TLS_CONNECTIONS = (1, 64)


class MemoryTransport:
    """What a connection writes to, minus the socket: the bytes are dropped, or kept in
    `written` with `keep`."""

    def __init__(self, keep: bool = False) -> None:
        self.keep = keep
        self.written = b""

    def write(self, data: bytes) -> None:
        if self.keep:
            self.written += data

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


def _connection(keys: ApiKeys | None) -> Callable[[], None]:
    """One request through a connection of a slot tracker app (with `keys`), answered."""
    app = create_app()
    app.state.tracker.register(1, "m", "default", 16, 0, 16)
    if keys is not None:
        app.protect(keys)
    request = (b"GET /loads?model_name=m HTTP/1.1\r\nHost: bench\r\nUser-Agent: bench\r\n"
               b"Authorization: Bearer " + KEY.encode() + b"\r\n\r\n")
    server = HttpServer(app, ConnectionLimits())
    connection = server()
    connection.connection_made(MemoryTransport())  # type: ignore[arg-type]

    def one() -> None:
        connection.data_received(request)
        server.send_all()

    return one


async def _per_request_us(keyed: dict[str, ApiKeys | None]) -> dict[str, float]:
    """Best per-request time of each app, timed in interleaved rounds: a neighbour's load
    that slows one round slows every app's share of it, and the best round of each is kept."""
    requests = {name: _connection(keys) for name, keys in keyed.items()}
    best = dict.fromkeys(keyed, float("inf"))
    gc.collect()
    gc.disable()  # as the services run: rare young collections (`dynamo_lite.web.cli.tune_garbage_collector`)
    try:
        for _ in range(ROUNDS):
            for name, one in requests.items():
                started = time.perf_counter()
                for _ in range(REQUESTS):
                    one()
                best[name] = min(best[name], time.perf_counter() - started)
    finally:
        gc.enable()
    return {name: seconds / REQUESTS * 1e6 for name, seconds in best.items()}


def _check_us(keys: ApiKeys) -> float:
    header = b"Bearer " + KEY.encode()
    best = float("inf")
    for _ in range(TIMINGS):
        started = time.perf_counter()
        for _ in range(REQUESTS):
            keys.check(header, Access.READ)
        best = min(best, time.perf_counter() - started)
    return best / REQUESTS * 1e6


def measure_keys() -> dict[str, float]:
    one = ApiKeys.from_texts([KEY])
    three = ApiKeys.from_texts(["a" * 43, "b" * 43, KEY])
    timed = asyncio.run(_per_request_us({"open": None, "one": one, "three": three}))
    open_us, one_us, three_us = timed["open"], timed["one"], timed["three"]
    return {
        "GET /loads, native server, no keys": open_us,
        "GET /loads, native server, 1 key": one_us,
        "GET /loads, native server, 3 keys": three_us,
        KEY_CHECK_ROW: max(one_us - open_us, 0.0),
        "API key check per request, 3 keys (keyed − open)": max(three_us - open_us, 0.0),
        "ApiKeys.check alone, 1 key": _check_us(one),
        "ApiKeys.check alone, 3 keys": _check_us(three),
    }


# --- TLS over the network ---------------------------------------------------------------------


def _certificate(directory: Path) -> tuple[Path, Path]:
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", "key.pem", "-out", "cert.pem", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], cwd=directory, check=True, capture_output=True)
    return directory / "cert.pem", directory / "key.pem"


@contextlib.contextmanager
def _ours(service: str, *flags: str, scheme: str = "http") -> Iterator[str]:
    port = reference_server.free_port()
    argv = ["taskset", "-c", str(SERVER_CPU), sys.executable, "-m", f"dynamo_lite.{service}", "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning", *flags]
    with reference_server.running_server(argv, port, timeout=60, scheme=scheme, verify=False) as url:
        yield str(url)


def _seed(service: str, url: str) -> bytes:
    """16 ranks (or workers) and the 512-hash query body of the route measured."""
    hashes = list(range(1, 513))
    with httpx.Client(base_url=url, verify=False, timeout=30) as client:
        if service == "slot_tracker":
            client.post("/register", json={"worker_id": 1, "model_name": "m", "block_size": 16, "dp_start": 0,
                                           "dp_size": 16}).raise_for_status()
            return orjson.dumps({"model_name": "m", "sequence_hashes": hashes, "new_isl_tokens": 512})
        for worker in range(16):
            client.post("/register", json={"instance_id": worker, "model_name": "m",
                                           "block_size": 16}).raise_for_status()
        return orjson.dumps({"model_name": "m", "block_hashes": hashes})


def measure_tls(results: Results) -> None:
    settings = results.settings
    with tempfile.TemporaryDirectory(prefix="bench_tls_") as scratch:
        certfile, keyfile = _certificate(Path(scratch))
        for service, route in (("slot_tracker", "/potential_loads"), ("indexer", "/query_by_hash")):
            for scheme in ("http", "https"):
                flags = ("--ssl-certfile", str(certfile), "--ssl-keyfile", str(keyfile)) if scheme == "https" else ()
                with _ours(service, *flags, scheme=scheme) as url:
                    body_file = Path(scratch) / f"{service}.json"
                    body_file.write_bytes(_seed(service, url))
                    for connections in TLS_CONNECTIONS:
                        try:
                            if settings.warmup_s > 0:
                                run_wrk(url, "post_static.lua", [route, str(body_file)], connections=connections,
                                        duration_s=settings.warmup_s, cpu=CLIENT_CPU)
                            result = run_wrk(url, "post_static.lua", [route, str(body_file)],
                                             connections=connections, duration_s=settings.duration_s, cpu=CLIENT_CPU)
                        except WrkError as exc:
                            results.note(f"security: {scheme} {route} c={connections}: wrk failed: {exc}")
                            continue
                        results.security.append({"route": route, "scheme": scheme, "connections": connections,
                                                 "rps": result.rps, "p50_us": result.p50_us,
                                                 "errors": result.errors})
                        progress(f"security {route:<17} {scheme:<5} c={connections:<3} {result.rps:>10,.0f} req/s  "
                                 f"p50 {result.p50_us / 1000:7.3f} ms")


def run(results: Results, selected: set[str]) -> None:
    if "security" not in selected:
        return
    progress(f"security: the API key check in process on CPU {SERVER_CPU}")
    results.cores.extend({"name": name, "us": us} for name, us in on_server_cpu("bench.security").items())
    progress("security: TLS on the heavy routes, ours on http and on https")
    measure_tls(results)


def main() -> None:
    print_measured(measure_keys(), width=70, digits=2)


if __name__ == "__main__":
    main()
