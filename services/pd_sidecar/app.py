"""The P/D sidecar's routes: a reverse proxy beside one decode engine, as llm-d's routing
sidecar (`llm-d-routing-sidecar`, its NIXL v2 protocol) behaves.

`POST /v1/completions` and `POST /v1/chat/completions` with an `x-prefiller-host-port: HOST:PORT`
header (the endpoint picker chose that prefill engine; several values, comma-separated or
repeated: the first) are disaggregated:

1. the request goes to `http://HOST:PORT` with `max_tokens: 1` (and `max_completion_tokens: 1`
   when it set that), `stream: false`, no `stream_options`, and vLLM's NixlConnector parameters
   `kv_transfer_params: {"do_remote_decode": true, "do_remote_prefill": false, "remote_*": null}`;
2. then, unchanged but for the `kv_transfer_params` the prefill answered (`do_remote_prefill`,
   `remote_block_ids`, `remote_engine_id`, `remote_host`, ...), to the decode engine, whose
   answer (streamed or not) is relayed as it comes, status and body unchanged.

Both calls carry the same `X-Request-Id` (the client's, else a new one). A prefill that fails,
answers no `kv_transfer_params` or takes longer than `--prefill-timeout-secs` falls back to a
local prefill: the request goes to the decode engine as it came. Without the header (or on the
other proxied routes) the request goes to the decode engine as it came.

A client that hangs up cancels what is in flight: the prefill call (its engine sees the
connection close and aborts it) or the decode call (the relay closes it: the decode engine
aborts the request and frees its blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.routing import Route

from dynamo_lite.web import http
from dynamo_lite.web.http import Answer, Headers, HeadersEndpoint, StreamAnswer, find_header

logger = logging.getLogger("dynamo_lite.pd_sidecar")

PREFILLER_HEADER = b"x-prefiller-host-port"
REQUEST_ID_HEADER = b"x-request-id"
MAX_BODY = 16 * 1024 * 1024
DEFAULT_PREFILL_TIMEOUT_SECS = 5.0
# Disaggregated with the header; every other proxied route goes to the decode engine as is.
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
PROXIED = (("GET", "/v1/models"), ("POST", "/tokenize"), ("POST", "/detokenize"),
           ("POST", "/v1/completions/render"), ("POST", "/v1/chat/completions/render"))
# Not forwarded either way (RFC 9110's hop-by-hop fields, and what the client library recomputes).
_HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length", PREFILLER_HEADER,
})
_ANSWER_SKIPPED = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"content-type",
                             b"date", b"server"})
PREFILL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def nixl_prefill_params() -> dict[str, Any]:
    """The `kv_transfer_params` a prefill request carries (vLLM's NixlConnector)."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prefill_body(request: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill engine gets it: one token, not streamed, with the connector's
    parameters."""
    body = dict(request)
    body["kv_transfer_params"] = nixl_prefill_params()
    body["stream"] = False
    body.pop("stream_options", None)
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    return body


def prefiller(headers: Headers) -> str | None:
    """The first `host:port` of the `x-prefiller-host-port` header(s); None without one."""
    for name, value in headers:
        if name == PREFILLER_HEADER:
            for part in value.decode("latin-1").split(","):
                if part.strip():
                    return part.strip()
    return None


def prefill_url(host_port: str, path: str) -> str:
    return f"{host_port}{path}" if host_port.startswith(("http://", "https://")) else f"http://{host_port}{path}"


def forwarded(headers: Headers, request_id: bytes | None = None) -> list[tuple[bytes, bytes]]:
    """The client's headers as sent upstream: hop-by-hop ones dropped, no compression asked
    that the client did not ask for, and `request_id` as `X-Request-Id` when given."""
    out = [(name, value) for name, value in headers
           if name not in _HOP_BY_HOP and not (request_id is not None and name == REQUEST_ID_HEADER)]
    if find_header(headers, b"accept-encoding") is None:
        out.append((b"accept-encoding", b"identity"))
    if request_id is not None:
        out.append((REQUEST_ID_HEADER, request_id))
    return out


@dataclass
class Counts:
    """What the sidecar did (`/metrics`)."""

    requests: dict[str, int] = field(default_factory=lambda: {"disaggregated": 0, "proxied": 0})
    prefills: int = 0  # prefill requests sent
    fallbacks: dict[str, int] = field(default_factory=lambda: {"timeout": 0, "error": 0, "status": 0,
                                                               "no_kv_transfer_params": 0})
    cancelled: int = 0  # clients that hung up before their whole answer
    decode_errors: int = 0  # the decode engine could not be reached (502)


class SidecarCollector(Collector):
    def __init__(self, counts: Counts) -> None:
        self.counts = counts

    def collect(self) -> Iterator[Metric]:
        counts = self.counts
        requests = CounterMetricFamily("dynamo_lite_pd_sidecar_requests",
                                       "Requests proxied: disaggregated (x-prefiller-host-port on a generation route) "
                                       "or proxied as they came.", labels=["mode"])
        for mode, value in counts.requests.items():
            requests.add_metric([mode], value)
        yield requests
        yield CounterMetricFamily("dynamo_lite_pd_sidecar_prefills", "Prefill requests sent to prefill engines.",
                                  value=counts.prefills)
        fallbacks = CounterMetricFamily("dynamo_lite_pd_sidecar_prefill_fallbacks",
                                        "Disaggregated requests prefilled by the decode engine instead, by why.",
                                        labels=["reason"])
        for reason, value in counts.fallbacks.items():
            fallbacks.add_metric([reason], value)
        yield fallbacks
        yield CounterMetricFamily("dynamo_lite_pd_sidecar_cancelled",
                                  "Requests whose client hung up before the whole answer (upstream calls cancelled).",
                                  value=counts.cancelled)
        yield CounterMetricFamily("dynamo_lite_pd_sidecar_decode_errors",
                                  "Requests the decode engine could not be reached for (answered 502).",
                                  value=counts.decode_errors)


class _Relay:
    """The decode engine's answer body as it arrives; closing it early (the client left) closes
    the upstream answer, which the decode engine sees as its client hanging up."""

    def __init__(self, response: httpx.Response, counts: Counts) -> None:
        self.response = response
        self.counts = counts
        self.chunks: AsyncIterator[bytes] | None = None
        self.done = False

    def __aiter__(self) -> _Relay:
        return self

    async def __anext__(self) -> bytes:
        if self.chunks is None:
            self.chunks = self.response.aiter_raw()
        try:
            return await self.chunks.__anext__()
        except StopAsyncIteration:
            self.done = True
            raise
        except httpx.HTTPError as exc:
            # The decode engine went away mid-answer: the client's answer ends unfinished too.
            raise RuntimeError(f"the decode engine's answer broke off: {exc}") from None

    async def aclose(self) -> None:
        if not self.done and not self.response.is_closed:
            self.counts.cancelled += 1
        await self.response.aclose()


def _answer_headers(response: httpx.Response) -> bytes:
    lines = [b"%s: %s\r\n" % (name, value) for name, value in response.headers.raw
             if name.lower() not in _ANSWER_SKIPPED]
    return b"".join(lines)


class ProxyEndpoint(HeadersEndpoint):
    """One proxied route; a generation route disaggregates when the header names a prefiller."""

    max_body = MAX_BODY
    optional_body = True
    cancel_on_disconnect = True  # a client that hangs up cancels the prefill or decode call in flight

    def __init__(self, sidecar: Sidecar, method: str, path: str) -> None:
        self.sidecar = sidecar
        self.method = method
        self.path = path
        self.disaggregates = path in GENERATION_PATHS

    def respond_with_headers(self, query_string: bytes, body: bytes, headers: Headers) -> Any:
        return asyncio.ensure_future(self.sidecar.serve(self.method, self.path, query_string, body, headers,
                                                        self.disaggregates))


@dataclass
class Sidecar:
    decode_url: str
    prefill_timeout_secs: float = DEFAULT_PREFILL_TIMEOUT_SECS
    counts: Counts = field(default_factory=Counts)
    client: httpx.AsyncClient | None = None
    prefill_observer: Any = None  # called with the seconds each successful prefill took

    async def serve(self, method: str, path: str, query_string: bytes, body: bytes, headers: Headers,
                    disaggregates: bool) -> Answer | StreamAnswer:
        try:
            host_port = prefiller(headers) if disaggregates else None
            request_id = None
            if host_port is not None:
                request = _json_object(body)
                if request is not None:
                    self.counts.requests["disaggregated"] += 1
                    given = find_header(headers, REQUEST_ID_HEADER)
                    request_id = given or uuid.uuid4().hex.encode()
                    params = await self._prefill(prefill_url(host_port, path), request, headers, request_id)
                    if params is not None:
                        body = orjson.dumps({**request, "kv_transfer_params": params})
                else:
                    host_port = None
            if host_port is None:
                self.counts.requests["proxied"] += 1
            return await self._decode(method, path, query_string, body, headers, request_id)
        except asyncio.CancelledError:
            self.counts.cancelled += 1  # the client hung up: the call in flight is cancelled with us
            raise

    async def _prefill(self, url: str, request: dict[str, Any], headers: Headers,
                       request_id: bytes) -> dict[str, Any] | None:
        """The prefill engine's `kv_transfer_params`, or None to prefill locally."""
        assert self.client is not None
        self.counts.prefills += 1
        started = time.monotonic()
        reason = "error"
        try:
            answer = await self.client.post(url, content=orjson.dumps(prefill_body(request)),
                                            headers=forwarded(headers, request_id),
                                            timeout=httpx.Timeout(self.prefill_timeout_secs))
            if answer.status_code != 200:
                reason = "status"
                raise ValueError(f"answered {answer.status_code}: {answer.text[:200]}")
            params = _json_object(answer.content)
            params = params.get("kv_transfer_params") if params is not None else None
            if not isinstance(params, dict) or not params:
                reason = "no_kv_transfer_params"
                raise ValueError("answered no kv_transfer_params (no KV connector?)")
        except httpx.TimeoutException:
            self.counts.fallbacks["timeout"] += 1
            logger.warning("prefill on %s took over %ss: the decode engine prefills itself", url,
                           self.prefill_timeout_secs)
            return None
        except (httpx.HTTPError, ValueError) as exc:
            self.counts.fallbacks[reason] += 1
            logger.warning("prefill on %s failed (%s): the decode engine prefills itself", url, exc)
            return None
        if self.prefill_observer is not None:
            self.prefill_observer(time.monotonic() - started)
        return params

    async def _decode(self, method: str, path: str, query_string: bytes, body: bytes, headers: Headers,
                      request_id: bytes | None) -> Answer | StreamAnswer:
        assert self.client is not None
        url = self.decode_url + path + (("?" + query_string.decode("latin-1")) if query_string else "")
        upstream = self.client.build_request(method, url, content=body if method != "GET" else None,
                                             headers=forwarded(headers, request_id))
        try:
            response = await self.client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            self.counts.decode_errors += 1
            logger.error("the decode engine at %s cannot be reached: %s", self.decode_url, exc)
            return 502, http.error_body(f"the decode engine cannot be reached: {type(exc).__name__}"), b"application/json"
        content_type = response.headers.get("content-type")
        return StreamAnswer(response.status_code, content_type.encode("latin-1") if content_type else None,
                            _Relay(response, self.counts), _answer_headers(response))


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def create_app(decode_url: str, prefill_timeout_secs: float = DEFAULT_PREFILL_TIMEOUT_SECS) -> http.Service:
    sidecar = Sidecar(decode_url.rstrip("/"), prefill_timeout_secs)

    @contextlib.asynccontextmanager
    async def lifespan(app: http.Service) -> AsyncIterator[None]:
        # No pool limit (a proxy's concurrency is its clients'); no read timeout on the decode
        # engine (a generation streams for as long as it runs).
        sidecar.client = httpx.AsyncClient(
            trust_env=False, timeout=httpx.Timeout(connect=5.0, read=None, write=None, pool=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        try:
            yield
        finally:
            await sidecar.client.aclose()
            sidecar.client = None

    routes = [http.health_route()]
    routes += [Route(path, ProxyEndpoint(sidecar, "POST", path), methods=["POST"]) for path in GENERATION_PATHS]
    routes += [Route(path, ProxyEndpoint(sidecar, method, path), methods=[method]) for method, path in PROXIED]
    app = http.Service(routes=routes, lifespan=lifespan, collectors=[SidecarCollector(sidecar.counts)])
    prefill_seconds = Histogram("dynamo_lite_pd_sidecar_prefill_seconds",
                                "Time from sending a prefill request to its kv_transfer_params (successful ones).",
                                buckets=PREFILL_BUCKETS, registry=app.metrics_registry)
    sidecar.prefill_observer = prefill_seconds.observe
    app.state.sidecar = sidecar
    return app


__all__ = ["GENERATION_PATHS", "PREFILLER_HEADER", "Sidecar", "create_app", "forwarded", "nixl_prefill_params",
           "prefill_body", "prefiller"]
