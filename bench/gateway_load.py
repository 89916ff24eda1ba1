"""The load generator of `python -m bench.gateway`: streamed OpenAI completions over raw HTTP/1.1.

A hand-written keep-alive client on asyncio streams (run under uvloop) rather than httpx or the
openai client: at hundreds of streamed answers per second a general-purpose client's own CPU
time would be what limits the run, and it would blur the timings. Each answer is read as it
arrives, so the time to its first content chunk (TTFT) is seen as a client sees it; the usage
chunk at the end gives the prompt and cached token counts.

Two ways to send:

* `open_loop`: each request at its own time (a schedule), whatever the answers do, as users
  arrive; a late start (the generator itself behind) is recorded, not hidden.
* `closed_loop`: `concurrency` workers, each sending its next request when its answer has
  ended, for a fixed time: what the system sustains.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import orjson

CONNECT_TIMEOUT_SECS = 5.0
ANSWER_TIMEOUT_SECS = 120.0


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request as the client saw it (times from `time.perf_counter`)."""

    status: int  # 0: no HTTP answer (connection failed, timeout)
    sent: float
    first_token: float | None  # the first chunk carrying generated text
    ended: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    late: float = 0.0  # open loop: how long after its scheduled time it was sent
    token_gaps: tuple[float, ...] = ()  # seconds between consecutive chunks carrying generated text

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def latency(self) -> float:
        return self.ended - self.sent


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        self.writer.close()


class Client:
    """Keep-alive HTTP/1.1 connections to one host; a request takes an idle one or opens one."""

    def __init__(self, base_url: str):
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self._idle: list[_Connection] = []

    async def close(self) -> None:
        while self._idle:
            self._idle.pop().close()

    async def _connection(self) -> _Connection:
        if self._idle:
            return self._idle.pop()
        reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), CONNECT_TIMEOUT_SECS)
        return _Connection(reader, writer)

    async def post(self, path: str, body: bytes, *, late: float = 0.0) -> Outcome:
        """POST a JSON body; read a streamed (SSE) or whole answer to its end."""
        head = (f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode()
        sent = time.perf_counter()
        connection: _Connection | None = None
        try:
            connection = await self._connection()
            sent = time.perf_counter()  # a fresh connection's handshake is not the gateway's time
            connection.writer.write(head + body)
            outcome, reusable = await asyncio.wait_for(self._read(connection.reader, sent, late), ANSWER_TIMEOUT_SECS)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ValueError) as exc:
            if connection is not None:
                connection.close()
            return Outcome(0, sent, None, time.perf_counter(), error=f"{type(exc).__name__}: {exc}", late=late)
        if reusable:
            self._idle.append(connection)
        else:
            connection.close()
        return outcome

    async def _read(self, reader: asyncio.StreamReader, sent: float, late: float) -> tuple[Outcome, bool]:
        status_line = await reader.readuntil(b"\r\n")
        status = int(status_line.split(b" ", 2)[1])
        chunked = False
        length = 0
        keep_alive = True
        while True:
            line = await reader.readuntil(b"\r\n")
            if line == b"\r\n":
                break
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            value = value.strip().lower()
            if name == b"transfer-encoding" and b"chunked" in value:
                chunked = True
            elif name == b"content-length":
                length = int(value)
            elif name == b"connection" and value == b"close":
                keep_alive = False
        first_token: float | None = None
        last_token = 0.0
        gaps: list[float] = []
        parts: list[bytes] = []
        if chunked:
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")  # no trailers are expected: the final CRLF
                    break
                data = (await reader.readexactly(size + 2))[:-2]
                if b'"choices":[{' in data:
                    now = time.perf_counter()
                    if first_token is None:
                        first_token = now
                    else:
                        gaps.append(now - last_token)
                    last_token = now
                parts.append(data)
        elif length:
            data = await reader.readexactly(length)
            if b'"choices":[{' in data:
                first_token = time.perf_counter()
            parts.append(data)
        ended = time.perf_counter()
        body = b"".join(parts)
        if status != 200:
            return Outcome(status, sent, None, ended, error=body[:200].decode("utf-8", "replace"), late=late), keep_alive
        prompt, cached, completion, error = _usage(body)
        return Outcome(status, sent, first_token, ended, prompt, cached, completion, error, late,
                       tuple(gaps)), keep_alive


def _usage(body: bytes) -> tuple[int, int, int, str | None]:
    """(prompt, cached, completion tokens, error) from the usage chunk (or a whole JSON answer)."""
    at = body.rfind(b'"usage":{')
    if at < 0:
        return 0, 0, 0, "no usage in the answer"
    start = body.rfind(b"data: ", 0, at)
    event = body[start + 6:body.index(b"\n\n", at)] if start >= 0 else body
    try:
        usage = orjson.loads(event)["usage"]
        details = usage.get("prompt_tokens_details") or {}
        return usage["prompt_tokens"], details.get("cached_tokens") or 0, usage["completion_tokens"], None
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        return 0, 0, 0, f"bad usage chunk: {exc}"


@dataclass(frozen=True, slots=True)
class Planned:
    at: float  # seconds after the start
    path: str
    body: bytes


async def open_loop(base_url: str, plan: Sequence[Planned]) -> tuple[list[Outcome], float]:
    """Send each planned request at its time; (outcomes in plan order, wall seconds)."""
    client = Client(base_url)
    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks: list[asyncio.Task[Outcome]] = []
    for item in plan:
        delay = start + item.at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(loop.create_task(client.post(item.path, item.body, late=max(0.0, -delay))))
    outcomes = list(await asyncio.gather(*tasks))
    wall = loop.time() - start
    await client.close()
    return outcomes, wall


async def closed_loop(base_url: str, concurrency: int, seconds: float,
                      request: Callable[[int], tuple[str, bytes]],
                      on_start: Callable[[], None] | None = None, on_end: Callable[[], None] | None = None,
                      warmup: float = 0.0) -> tuple[list[Outcome], float]:
    """`concurrency` workers back to back for `seconds` (after `warmup` s not counted);
    `on_start` / `on_end` are called as the measured window opens and closes (before the
    requests still running drain). (outcomes sent in the window, the window's seconds)."""
    client = Client(base_url)
    loop = asyncio.get_running_loop()
    counter = iter(range(1 << 62))
    window: dict[str, float] = {}
    outcomes: list[Outcome] = []

    async def worker() -> None:
        while "end" not in window:
            path, body = request(next(counter))
            outcome = await client.post(path, body)
            if "start" in window and outcome.sent >= window["start_perf"] and "end" not in window:
                outcomes.append(outcome)

    workers = [loop.create_task(worker()) for _ in range(concurrency)]
    await asyncio.sleep(warmup)
    if on_start is not None:
        on_start()
    window["start"], window["start_perf"] = loop.time(), time.perf_counter()
    await asyncio.sleep(seconds)
    window["end"] = loop.time()
    if on_end is not None:
        on_end()
    measured = window["end"] - window["start"]
    await asyncio.gather(*workers)
    await client.close()
    return outcomes, measured


@dataclass(frozen=True)
class Summary:
    """What a run of outcomes amounts to (times in milliseconds)."""

    requests: int
    errors: int
    error_samples: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    latency_p50_ms: float | None = None
    latency_p99_ms: float | None = None
    late_max_ms: float = 0.0

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarise(outcomes: Sequence[Outcome]) -> Summary:
    good = [o for o in outcomes if o.ok]
    bad = [o for o in outcomes if not o.ok]
    ttfts = [o.ttft * 1000 for o in good if o.ttft is not None]
    latencies = [o.latency * 1000 for o in good]
    samples = sorted({f"{o.status}: {o.error}" for o in bad})[:5]
    return Summary(
        requests=len(outcomes), errors=len(bad), error_samples=samples,
        prompt_tokens=sum(o.prompt_tokens for o in good), cached_tokens=sum(o.cached_tokens for o in good),
        completion_tokens=sum(o.completion_tokens for o in good),
        ttft_p50_ms=percentile(ttfts, 50), ttft_p99_ms=percentile(ttfts, 99),
        latency_p50_ms=percentile(latencies, 50), latency_p99_ms=percentile(latencies, 99),
        late_max_ms=max((o.late for o in outcomes), default=0.0) * 1000,
    )
