"""The ceiling of our stack: stock Starlette + uvicorn + orjson, the same routes, no logic.

    python -m bench.stub --port P [--log-level warning]

Every benchmarked route of both services is a plain Starlette `Route` whose handler reads the
body, parses it with orjson (the work any JSON service must do) and answers a canned response.
The suite sets each canned response to the very bytes our service answered for the same
request (`POST /__bench__/canned`), so payload sizes are equal in both directions.
It is served by `dynamo_lite.cli.serve`, exactly as our services are (same uvicorn settings,
same garbage-collector tuning).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from dynamo_lite.cli import configure_logging, serve, service_parser

POST_ROUTES = (
    "/potential_loads", "/add", "/prefill_complete", "/free",  # slot tracker
    "/query_by_hash", "/events",  # indexer
)
GET_ROUTES = ("/loads",)
CANNED_PATH = "/__bench__/canned"


@dataclass
class Canned:
    status: int
    body: bytes


def create_app() -> Starlette:
    canned: dict[str, Canned] = {path: Canned(200, b'{"status":"ok"}') for path in (*POST_ROUTES, *GET_ROUTES)}

    async def post_route(request: Request) -> Response:
        orjson.loads(await request.body())
        answer = canned[request.url.path]
        return Response(answer.body, answer.status, media_type="application/json")

    async def get_route(request: Request) -> Response:
        answer = canned[request.url.path]
        return Response(answer.body, answer.status, media_type="application/json")

    async def health(request: Request) -> Response:
        return Response(b"", 200)

    async def set_canned(request: Request) -> Response:
        """Body: {"path": "/add", "status": 201, "body": "<the response text>"}."""
        document = orjson.loads(await request.body())
        canned[document["path"]] = Canned(int(document["status"]), document["body"].encode())
        return Response(b"", 204)

    routes = [Route("/health", health, methods=["GET"])]
    routes += [Route(path, post_route, methods=["POST"]) for path in POST_ROUTES]
    routes += [Route(path, get_route, methods=["GET"]) for path in GET_ROUTES]
    routes.append(Route(CANNED_PATH, set_canned, methods=["POST"]))  # last: never matched first
    return Starlette(routes=routes)


def main(argv: list[str] | None = None) -> None:
    parser = service_parser("python -m bench.stub", "Bare Starlette stub with canned answers.", 8099)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    serve(create_app(), args)


if __name__ == "__main__":
    sys.exit(main())
