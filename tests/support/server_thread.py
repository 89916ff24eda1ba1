"""An in-process dynamo_lite.web.http server on a thread, serving a small app with waiting (awaited) answers."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import orjson

from dynamo_lite.base.errors import Conflict
from dynamo_lite.web import http
from dynamo_lite.web.server import ConnectionLimits, HttpServer


def make_app() -> http.Service:
    async def slow(seconds: float, answer: Any) -> http.HandlerResult:
        await asyncio.sleep(seconds)
        return 200, answer

    def wait(body: Any) -> Any:
        if body.get("fail") == "conflict":
            async def conflict() -> http.HandlerResult:
                await asyncio.sleep(0.01)
                raise Conflict("taken")
            return conflict()
        if body.get("fail") == "crash":
            async def crash() -> http.HandlerResult:
                raise RuntimeError("boom")
            return crash()
        return slow(body["seconds"], {"echo": body["echo"]})

    def now(body: Any) -> http.HandlerResult:
        return 200, {"echo": body["echo"]}

    return http.Service(routes=[http.post("/wait", wait), http.post("/now", now), http.health_route()])


class ServerThread:
    """The native server on its own event loop in a thread (no signal handling needed)."""

    def __init__(self, app: http.Service | None = None) -> None:
        self.app = app if app is not None else make_app()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def start() -> None:
            self.server = HttpServer(self.app, ConnectionLimits())
            self.listener = await self.loop.create_server(self.server, "127.0.0.1", 0)
            self.url = f"http://127.0.0.1:{self.listener.sockets[0].getsockname()[1]}"
            self.ready.set()

        self.loop.run_until_complete(start())
        self.loop.run_forever()

    def shut_down(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.shut_down(grace_secs=5), self.loop).result(10)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def body(**fields: Any) -> bytes:
    return orjson.dumps(fields)
