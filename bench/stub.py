"""The ceiling of our serving path: the native server and `Service`, the same routes, no logic.

    python -m bench.stub --port P [--log-level warning]

Every benchmarked route of the services is an endpoint that decodes its JSON body with orjson
(the work any JSON service must do) and answers a canned response. The suite sets each canned
response to the very bytes our service answered for the same request
(`POST /__bench__/canned`), so payload sizes are equal in both directions. It is served by
`dynamo_lite.web.cli.serve`, exactly as our services are (same server, limits and garbage-collector
tuning): ours ÷ stub is what the services' own request work (validation, core, encoding) costs.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.routing import Route

from dynamo_lite.web.cli import configure_logging, serve, service_parser
from dynamo_lite.web.http import Answer, DirectEndpoint, PathEndpoint, PathParams, Service, health_route
from dynamo_lite.web.validation import decode_json

POST_ROUTES = (
    "/potential_loads", "/add", "/prefill_complete", "/free",  # slot tracker
    "/query_by_hash", "/events",  # indexer
    "/select_and_reserve",  # selection service
)
GET_ROUTES = ("/loads",)
# The selection service's reservation routes, by the path the canned answer is set for.
TEMPLATED_ROUTES = {
    "/reservations/{selection_id}/prefill_complete": "POST",
    "/reservations/{selection_id}/output_block": "POST",
    "/reservations/{selection_id}": "DELETE",
}
CANNED_PATH = "/__bench__/canned"
_JSON = b"application/json"
_MAX_BODY = 8 * 1024 * 1024


class CannedEndpoint(DirectEndpoint):
    def __init__(self, *, takes_body: bool) -> None:
        self.max_body = _MAX_BODY if takes_body else 0
        self.answer_bytes: Answer = (200, b'{"status":"ok"}', _JSON)

    def respond(self, query_string: bytes, body: bytes) -> Answer:
        if self.max_body:
            decode_json(body)
        return self.answer_bytes


class CannedPathEndpoint(PathEndpoint):
    """A templated route: its body, if any, decoded; one canned answer whatever the path holds."""

    optional_body = True

    def __init__(self, *, takes_body: bool) -> None:
        self.max_body = _MAX_BODY if takes_body else 0
        self.answer_bytes: Answer = (200, b'{"status":"ok"}', _JSON)

    def respond_at(self, params: PathParams, query_string: bytes, body: bytes) -> Answer:
        if body:
            decode_json(body)
        return self.answer_bytes


class SetCanned(DirectEndpoint):
    """Body: {"path": "/add", "status": 201, "body": "<the response text>"}."""

    max_body = _MAX_BODY

    def __init__(self, endpoints: dict[str, CannedEndpoint | CannedPathEndpoint]) -> None:
        self.endpoints = endpoints

    def respond(self, query_string: bytes, body: bytes) -> Answer:
        document: Any = orjson.loads(body)
        self.endpoints[document["path"]].answer_bytes = (int(document["status"]), document["body"].encode(), _JSON)
        return 204, b"", None


def create_app() -> Service:
    endpoints: dict[str, CannedEndpoint | CannedPathEndpoint] = {
        path: CannedEndpoint(takes_body=True) for path in POST_ROUTES}
    endpoints.update({path: CannedEndpoint(takes_body=False) for path in GET_ROUTES})
    endpoints.update({path: CannedPathEndpoint(takes_body=method == "POST") for path, method in TEMPLATED_ROUTES.items()})
    routes = [health_route()]
    routes += [Route(path, endpoints[path], methods=["POST"]) for path in POST_ROUTES]
    routes += [Route(path, endpoints[path], methods=["GET"]) for path in GET_ROUTES]
    routes += [Route(path, endpoints[path], methods=[method]) for path, method in TEMPLATED_ROUTES.items()]
    routes.append(Route(CANNED_PATH, SetCanned(endpoints), methods=["POST"]))
    return Service(routes=routes)


def main(argv: list[str] | None = None) -> None:
    parser = service_parser("python -m bench.stub", "Our serving path with canned answers and no logic.", 8099)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    serve(create_app(), args)


if __name__ == "__main__":
    main()
