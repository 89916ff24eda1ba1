"""Where the endpoint picker's time goes: its cProfile output, summed by what the code does.

`python -m bench.gateway` runs the picker once under `python -m cProfile -o FILE -m
dynamo_lite.epp` (py-spy is not available here) and reads FILE after the picker has exited.
Each function's own time (cProfile's `tottime`) goes to a category by the file it lives in; a
C builtin or a standard-library helper goes to the category of its dominant caller (a few
callers up if need be), so a `transport.write` or a `contextlib` manager inside the service
client counts as the service client.

cProfile sees Python only, slows Python code down several times and does not see gRPC's C-core
threads: the shares, not the seconds, are what to read.
"""

from __future__ import annotations

import pstats
from pathlib import Path
from typing import Any

# First match wins: (category, substrings of the file path).
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # The picker's service client: the lean HTTP/1.1 transport (httptools parses in C, seen
    # through its callbacks in lean_http.py), the typed answers' decoding, and httpx where a
    # client still uses it.
    ("slot tracker + indexer calls (service client)", ("/lean_http.py", "httptools", "/_client_base.py",
                                                      "/_async_client.py", "/shared/client/__init__.py",
                                                      "/dynamo_lite/client/__init__.py", "/httpx/", "/httpcore/", "/h11/",
                                                      "/anyio/", "/sniffio/")),
    ("ext_proc stream (grpc.aio, protobuf, grpc_server.py)", ("/grpc/", "/google/protobuf/", "/envoy/", "/xds/",
                                                             "/validate/", "/udpa/", "epp/grpc_server.py",
                                                             "epp/health.py")),
    ("picking and bookkeeping (picker, booking, hashing, routing)", ("epp/picker.py", "epp/booking.py",
                                                                     "epp/prompt.py", "epp/queue.py",
                                                                     "epp/endpoint.py", "hashing.py", "routing.py",
                                                                     "slot_tracker/core.py")),
    ("asyncio event loop", ("/asyncio/", "uvloop")),
    ("metrics and logging", ("/prometheus_client/", "/logging/", "epp/metrics.py")),
    ("start-up (imports)", ("<frozen importlib", "importlib")),
)
OTHER = "other"
STARTUP = "start-up (imports)"
# cProfile times the wall clock: waiting is the picker idle, not working, and stays out of the
# shares (a picker below 100% CPU waits a lot). Waits show as the event loop's epoll, or as a
# function whose own time exceeds its cumulative time, which real work cannot: cProfile's
# accounting of a suspended async generator (the HTTP app's lifespan, suspended at its `yield`
# for the picker's whole life, is charged seconds of own time).
IDLE = "idle (waiting)"
_ARTIFACT_SECS = 0.1  # own time beyond cumulative time that marks a wait, not work
_IDLE_FUNCTIONS = ("of 'select.epoll' objects>", "of 'select.poll' objects>", "<built-in method select.select>",
                   "of 'select.kqueue' objects>")


def _category(filename: str) -> str | None:
    for name, needles in CATEGORIES:
        if any(needle in filename for needle in needles):
            return name
    return None


def summarise(path: Path) -> dict[str, Any]:
    """{"total_s", "idle_s", "shares": {category: fraction of the profiled time, start-up and
    idle waiting excluded}}."""
    stats: dict[Any, Any] = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    memo: dict[Any, str] = {}

    def category_of(function: Any, depth: int = 0) -> str:
        """By the function's file; a builtin or a standard-library helper (contextlib, enum,
        weakref...) by its dominant caller's category, a few callers up."""
        if function in memo:
            return memo[function]
        filename, _, name = function
        if filename == "~" and name.endswith(_IDLE_FUNCTIONS):
            return IDLE
        found = STARTUP if name == "<module>" else _category(filename)
        if found is None:
            callers = stats.get(function, (0, 0, 0, 0, {}))[4]
            found = OTHER
            if callers and depth < 8:
                caller = max(callers.items(), key=lambda item: item[1][3])[0]  # by cumulative time
                found = category_of(caller, depth + 1)
        memo[function] = found
        return found

    seconds: dict[str, float] = {}
    for function, (_, _, tottime, cumtime, _) in stats.items():
        category = IDLE if tottime > cumtime + _ARTIFACT_SECS else category_of(function)
        seconds[category] = seconds.get(category, 0.0) + tottime
    seconds.pop(STARTUP, None)
    idle = seconds.pop(IDLE, 0.0)
    total = sum(seconds.values())
    shares = {name: value / total for name, value in sorted(seconds.items(), key=lambda item: -item[1])} if total else {}
    return {"total_s": total, "idle_s": idle, "shares": shares}
