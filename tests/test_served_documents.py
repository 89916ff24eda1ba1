"""schemathesis, as a user runs it, against the API document each service serves: every check
(`--checks all`) and every phase, started without a key and with one. The document follows the
configuration: without a key it declares no security (a request without `Authorization` is
then right to be accepted), with keys every route but the probes needs one; and its links read
only fields every valid body has."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from support.reference_server import running_service

TESTS = Path(__file__).resolve().parent
KEY = "served-documents-key"


@pytest.mark.parametrize("keyed", [False, True], ids=["open", "keyed"])
@pytest.mark.parametrize("service", ["slot_tracker", "indexer"])
def test_schemathesis_with_every_check_finds_nothing(service: str, keyed: bool) -> None:
    flags = ("--api-key", KEY) if keyed else ()
    with running_service(service, *flags) as url:
        headers = {"authorization": f"Bearer {KEY}"} if keyed else {}
        document = httpx.get(f"{url}/openapi.json", headers=headers).json()
        assert ("security" in document) is keyed
        assert ("bearerKey" in document.get("components", {}).get("securitySchemes", {})) is keyed
        if keyed:
            assert httpx.get(f"{url}/openapi.json").status_code == 401
        run = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(TESTS / "support" / "schemathesis.toml"),
               "run", f"{url}/openapi.json", "--checks", "all", "--phases", "examples,coverage,fuzzing,stateful",
               "--max-examples", "5", "--seed", "1", "--no-color"]
        if keyed:
            run += ["-H", f"Authorization: Bearer {KEY}"]
        env = {**os.environ, "SCHEMATHESIS_HOOKS": "support.schemathesis_hooks", "PYTHONPATH": str(TESTS)}
        done = subprocess.run(run, capture_output=True, text=True, timeout=300, env=env, cwd=TESTS)
        assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
        assert "passed" in done.stdout
