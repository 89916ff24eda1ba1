"""Both services word their errors the same way, as real processes answer them: a JSON
`{"error": "..."}` whose message starts in lower case (Dynamo's framework messages, which axum
capitalises, included: docs/differences.md), names a field in backticks as serde does
(`missing field `model_name``), quotes a value the same way (never Python's `'...'`), and says
a missing or mistyped field in the same words on every route of either service."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest
from support.reference_server import running_service

pytestmark = pytest.mark.process

JSON = {"content-type": "application/json"}

# (service, method, path, body or None, headers, status): one request per kind of refusal.
BadRequest = tuple[str, str, str, bytes | None, dict[str, str], int]
BAD_REQUESTS: list[BadRequest] = [
    ("slot_tracker", "POST", "/register", b"{}", JSON, 422),
    ("indexer", "POST", "/register", b"{}", JSON, 422),
    ("slot_tracker", "POST", "/add", b'{"model_name": 5}', JSON, 422),
    ("indexer", "POST", "/query_by_hash", b'{"model_name": 5}', JSON, 422),
    ("slot_tracker", "POST", "/free", b"{", JSON, 400),
    ("indexer", "POST", "/query", b"{", JSON, 400),
    ("slot_tracker", "POST", "/free", b"{}", {"content-type": "text/plain"}, 415),
    ("indexer", "POST", "/query", b"{}", {}, 415),
    ("slot_tracker", "GET", "/loads?model_name=a&model_name=b", None, {}, 400),
    ("indexer", "GET", "/workers?model_name=a&model_name=b", None, {}, 400),
    ("slot_tracker", "GET", "/loads?model=a", None, {}, 400),
    ("indexer", "GET", "/workers?model=a", None, {}, 400),
    ("slot_tracker", "POST", "/register",
     b'{"worker_id": 1, "model_name": "m", "block_size": 16, "dp_start": 0, "dp_size": 1, "tenant_id": "a", '
     b'"routing_group": "b"}', JSON, 400),
    ("indexer", "POST", "/register", b'{"instance_id": 1, "model_name": "m", "block_size": 16, "tenant_id": "a:b"}',
     JSON, 400),
    ("indexer", "POST", "/register_peer", b'{"url": "other-indexer:8090"}', JSON, 400),
    ("indexer", "POST", "/register", b'{"instance_id": 1, "model_name": "m", "block_size": 0}', JSON, 400),
    ("slot_tracker", "POST", "/free", b'{"model_name": "nobody", "request_id": "r"}', JSON, 404),
    ("indexer", "POST", "/unregister", b'{"instance_id": 9, "model_name": "nobody"}', JSON, 404),
    ("slot_tracker", "GET", "/nowhere", None, {}, 404),
    ("indexer", "DELETE", "/workers", None, {}, 405),
]


@pytest.fixture(scope="module")
def services() -> Iterator[dict[str, str]]:
    with running_service("slot_tracker") as slot_tracker, running_service("indexer") as indexer:
        yield {"slot_tracker": str(slot_tracker), "indexer": str(indexer)}


def message(services: dict[str, str], service: str, method: str, path: str, body: bytes | None,
            headers: dict[str, str], status: int) -> str:
    answer = httpx.request(method, services[service] + path, content=body, headers=headers)
    assert answer.status_code == status, f"{service} {method} {path}: {answer.status_code} {answer.text}"
    document = answer.json()
    assert list(document) == ["error"] and isinstance(document["error"], str), answer.text
    return str(document["error"])


@pytest.mark.parametrize("request_", BAD_REQUESTS, ids=lambda r: f"{r[0]}-{r[1]}-{r[2].split('?')[0]}-{r[5]}")
def test_every_message_starts_in_lower_case_and_quotes_with_backticks(
        services: dict[str, str], request_: BadRequest) -> None:
    text = message(services, *request_)
    assert re.match(r"[a-z`]", text), f"capitalised: {text!r}"
    assert not re.search(r"'[^'\s]*'", text), f"a value in Python's quotes: {text!r}"


def test_a_missing_or_mistyped_field_is_named_in_the_same_words_by_both_services(services: dict[str, str]) -> None:
    missing = {service: message(services, service, "POST", path, b"{}", JSON, 422)
               for service, path in (("slot_tracker", "/add"), ("indexer", "/query_by_hash"))}
    assert missing == {"slot_tracker": "missing field `model_name`", "indexer": "missing field `model_name`"}
    mistyped = {service: message(services, service, "POST", path, b'{"model_name": 5}', JSON, 422)
                for service, path in (("slot_tracker", "/add"), ("indexer", "/query_by_hash"))}
    assert set(mistyped.values()) == {"model_name: invalid type: integer 5, expected a string"}, mistyped
    unknown = {service: message(services, service, "GET", path, None, {}, 400)
               for service, path in (("slot_tracker", "/loads?model=a"), ("indexer", "/workers?model=a"))}
    assert all(text.startswith("unknown query parameter `model`; accepted: ") for text in unknown.values()), unknown
