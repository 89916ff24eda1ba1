"""Routes beyond one method on one exact path (`dynamo_lite.web.http`): several methods on a path,
each its own endpoint; templated paths (`/items/{item_id}/done`) whose parameters reach the
handler; a POST whose body is optional. Both entry points (the native server and ASGI) route
with the same table, so every case runs on both."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient
from support.server_thread import ServerThread

from dynamo_lite.base.errors import NotFound
from dynamo_lite.web import http
from dynamo_lite.web.auth import Access, ApiKeys
from dynamo_lite.web.validation import U32, RequestBody, decoder

pytestmark = pytest.mark.unit


class Item(RequestBody, kw_only=True):
    name: str
    size: U32 = 1


def make_app() -> http.Service:
    items: dict[str, dict[str, Any]] = {}
    read_item = decoder(Item)

    def create(request: Item) -> http.HandlerResult:
        items[request.name] = {"name": request.name, "size": request.size, "done": False}
        return 201, items[request.name]

    def listing(params: http.QueryParams) -> http.HandlerResult:
        return 200, sorted(items)

    def found(item_id: str) -> dict[str, Any]:
        if item_id not in items:
            raise NotFound(f"item {item_id} not found")
        return items[item_id]

    def patch(params: http.PathParams, changes: Any) -> http.HandlerResult:
        found(params["item_id"]).update(changes)
        return 200, items[params["item_id"]]

    def delete(params: http.PathParams, query: http.QueryParams) -> http.HandlerResult:
        return 200, items.pop(found(params["item_id"])["name"])

    def show(params: http.PathParams, query: http.QueryParams) -> http.HandlerResult:
        async def later() -> http.HandlerResult:  # an answer that waits, as a replica's does
            await asyncio.sleep(0)
            return 200, found(params["item_id"])
        return later()

    def done(params: http.PathParams, options: Any) -> http.HandlerResult:
        item = found(params["item_id"])
        item["done"] = options.get("how", True) if options else True
        return 200, item

    def read_options(body: bytes) -> Any:
        return http.decode_json(body) if body else None

    return http.Service(routes=[
        http.health_route(),
        http.post("/items", create, read=read_item),
        http.get("/items", listing),
        http.get("/items/{item_id}", show),
        http.post("/items/{item_id}", patch, method="PATCH"),
        http.get("/items/{item_id}", delete, method="DELETE"),
        http.post("/items/{item_id}/done", done, read=read_options, optional_body=True),
    ])


class Native:
    def __init__(self) -> None:
        self.thread = ServerThread(make_app())
        self.client = httpx.Client(base_url=self.thread.url)

    def close(self) -> None:
        self.client.close()
        self.thread.stop()


@pytest.fixture(params=["native", "asgi"])
def client(request: pytest.FixtureRequest) -> Iterator[httpx.Client | TestClient]:
    if request.param == "native":
        native = Native()
        yield native.client
        native.close()
    else:
        with TestClient(make_app()) as test_client:
            yield test_client


JSON = {"content-type": "application/json"}


def test_each_method_of_a_path_reaches_its_own_endpoint(client: httpx.Client) -> None:
    assert client.post("/items", content=b'{"name": "a"}', headers=JSON).status_code == 201
    assert client.post("/items", content=b'{"name": "b", "size": 3}', headers=JSON).status_code == 201
    assert client.get("/items").json() == ["a", "b"]
    assert client.head("/items").status_code == 200
    refused = client.put("/items", content=b"{}", headers=JSON)
    assert refused.status_code == 405 and refused.headers["allow"] == "GET, HEAD, POST"
    assert refused.json() == {"error": "method not allowed"}


def test_a_templated_path_hands_its_parameters_to_the_handler(client: httpx.Client) -> None:
    client.post("/items", content=b'{"name": "x y"}', headers=JSON)
    assert client.get("/items/x%20y").json() == {"name": "x y", "size": 1, "done": False}
    assert client.patch("/items/x%20y", content=b'{"size": 5}', headers=JSON).json()["size"] == 5
    missing = client.get("/items/nope")
    assert missing.status_code == 404 and missing.json() == {"error": "item nope not found"}
    assert client.post("/items/x%20y/done", content=b'{"how": "fully"}', headers=JSON).json()["done"] == "fully"
    assert client.delete("/items/x%20y").json()["name"] == "x y"
    assert client.get("/items").json() == []
    client.post("/items", content=b'{"name": "a/b"}', headers=JSON)  # an encoded slash stays in its segment
    assert client.post("/items/a%2Fb/done").json()["name"] == "a/b"
    assert client.delete("/items/a%2Fb").status_code == 200
    # a segment more, a segment less, an empty parameter: no route
    for path in ("/items/a/done/more", "/items//done", "/item/a"):
        answer = client.get(path)
        assert answer.status_code == 404 and answer.json() == {"error": "route not found"}, path
    answer = client.post("/items/a", content=b"{}", headers=JSON)
    assert answer.status_code == 405 and answer.headers["allow"] == "DELETE, GET, HEAD, PATCH"


def test_an_optional_body_may_be_left_out_but_not_sent_as_another_type(client: httpx.Client) -> None:
    client.post("/items", content=b'{"name": "c"}', headers=JSON)
    answer = client.post("/items/c/done")
    assert answer.status_code == 200 and answer.json()["done"] is True
    wrong = client.post("/items/c/done", content=b"how=1", headers={"content-type": "text/plain"})
    assert wrong.status_code == 415
    assert client.post("/items/c/done?x=1").status_code == 400  # no query parameters here either


def test_keys_protect_templated_and_shared_paths_by_method() -> None:
    app = make_app()
    app.protect(ApiKeys.from_texts(["w"]))
    access = {(path, method): entry.access for path, entry in app.entries() for method in entry.methods}
    assert access[("/items", "GET")] is Access.READ and access[("/items", "POST")] is Access.WRITE
    assert access[("/items/{item_id}", "GET")] is Access.READ
    assert access[("/items/{item_id}", "DELETE")] is Access.WRITE
    assert access[("/items/{item_id}", "PATCH")] is Access.WRITE
    with TestClient(app) as client:
        assert client.get("/items/a").status_code == 401
        assert client.get("/items/a", headers={"authorization": "Bearer w"}).status_code == 404


def test_two_endpoints_for_one_method_and_path_are_refused() -> None:
    with pytest.raises(ValueError, match="two routes answer (GET|HEAD) /x"):
        http.Service(routes=[http.get("/x", lambda params: (200, 1)), http.get("/x", lambda params: (200, 2))])
