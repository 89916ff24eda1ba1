"""schemathesis, as a user runs it, against the API document each service serves: every check
(`--checks all`) and every phase, started without a key and with one. The document follows the
configuration: without a key it declares no security (a request without `Authorization` is
then right to be accepted), with keys every route but the probes needs one; and its links read
only fields every valid body has."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from support.reference_server import running_service

pytestmark = pytest.mark.process

TESTS = Path(__file__).resolve().parent
KEY = "served-documents-key"


# The selection service starts with two schedulable workers (engines that never publish), so
# that generated selections reach a pick and the stateful phase the reservations.
SELECT_WORKERS = [{"worker_id": worker_id, "model_name": "default", "endpoint": f"http://127.0.0.1:{9000 + worker_id}",
                   "block_size": 16, "kv_events_endpoint": f"tcp://127.0.0.1:{1 + worker_id}"} for worker_id in (0, 1)]


@pytest.mark.parametrize("keyed", [False, True], ids=["open", "keyed"])
@pytest.mark.parametrize("service", ["slot_tracker", "indexer", "select_service"])
def test_schemathesis_with_every_check_finds_nothing(service: str, keyed: bool, tmp_path: Path) -> None:
    flags: tuple[str, ...] = ("--api-key", KEY) if keyed else ()
    config = "schemathesis.toml"
    if service == "select_service":
        workers = tmp_path / "workers.json"
        workers.write_text(json.dumps(SELECT_WORKERS))
        flags += ("--workers", str(workers))
        config = "schemathesis_select.toml"
    with running_service(service, *flags) as url:
        headers = {"authorization": f"Bearer {KEY}"} if keyed else {}
        document = httpx.get(f"{url}/openapi.json", headers=headers).json()
        assert ("security" in document) is keyed
        assert ("bearerKey" in document.get("components", {}).get("securitySchemes", {})) is keyed
        if keyed:
            assert httpx.get(f"{url}/openapi.json").status_code == 401
        run = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(TESTS / "support" / config),
               "run", f"{url}/openapi.json", "--checks", "all", "--phases", "examples,coverage,fuzzing,stateful",
               "--max-examples", "5", "--seed", "1", "--no-color"]
        if keyed:
            run += ["-H", f"Authorization: Bearer {KEY}"]
        env = {**os.environ, "SCHEMATHESIS_HOOKS": "support.schemathesis_hooks", "PYTHONPATH": str(TESTS)}
        done = subprocess.run(run, capture_output=True, text=True, timeout=300, env=env, cwd=TESTS)
        assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
        assert "passed" in done.stdout
