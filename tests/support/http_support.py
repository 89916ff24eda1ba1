"""Helpers shared by the in-process HTTP tests of both services."""

from __future__ import annotations

import json

import httpx
from starlette.testclient import TestClient

JSON = {"content-type": "application/json"}


def post(client: TestClient, path: str, body: object, headers: dict[str, str] = JSON):
    return client.post(path, content=json.dumps(body), headers=headers)  # stdlib: any int size


def assert_error(response, status: int, message: str | None = None) -> None:
    """A JSON `{"error": "<non-empty>"}` with this status (and this message, when given)."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert list(body) == ["error"] and isinstance(body["error"], str) and body["error"]
    if message is not None:
        assert body["error"] == message


def in_process(app) -> httpx.AsyncClient:
    """An async httpx client that calls `app` directly (no socket), for the async clients."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://service")
