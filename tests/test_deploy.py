"""The Docker image's health check and the Kubernetes example stay true to the services.

No container runtime or cluster is needed: the manifests are read as data and every
command, flag variable, port and probe path they name is checked against the services
themselves (their --help, their routes, a running process).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from reference_server import free_port, running_server

from dynamo_lite.indexer.app import create_app as create_indexer_app
from dynamo_lite.slot_tracker.app import create_app as create_slot_tracker_app

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "deploy" / "kubernetes" / "dynamo-lite.yaml"
PROBE = [sys.executable, "-m", "dynamo_lite.probe"]


def manifest_containers() -> list[dict[str, Any]]:
    documents = [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]
    return [
        container
        for doc in documents
        if doc["kind"] in ("Deployment", "StatefulSet")
        for container in doc["spec"]["template"]["spec"]["containers"]
    ]


def served_paths(module: str) -> set[str]:
    create_app = {"dynamo_lite.slot_tracker": create_slot_tracker_app, "dynamo_lite.indexer": create_indexer_app}
    return {route.path for route in create_app[module]().routes}


CONTAINERS = manifest_containers()


def test_manifest_runs_both_services_once() -> None:
    modules = sorted(container["command"][-1] for container in CONTAINERS)
    assert modules == ["dynamo_lite.indexer", "dynamo_lite.slot_tracker"]
    for doc in yaml.safe_load_all(MANIFEST.read_text()):
        if doc and doc["kind"] in ("Deployment", "StatefulSet"):
            assert doc["spec"]["replicas"] == 1, "state lives in one process: one replica"


@pytest.mark.parametrize("container", CONTAINERS, ids=lambda c: c["name"])
def test_container_environment_is_accepted_by_the_service(container: dict[str, Any]) -> None:
    env = {item["name"]: item["value"] for item in container["env"]}
    assert all(name.startswith("DYNAMO_LITE_") for name in env)
    result = subprocess.run(
        [sys.executable, "-m", container["command"][-1], "--help"],
        capture_output=True, text=True, timeout=60, env={**os.environ, **env},
    )
    assert result.returncode == 0, result.stderr  # a bad value or unknown flag exits with 2
    help_text = re.sub(r"\s+", " ", result.stdout)
    for name in env:
        assert name in help_text, f"{name} is not a variable of {container['command'][-1]}"


@pytest.mark.parametrize("container", CONTAINERS, ids=lambda c: c["name"])
def test_probes_use_served_routes_and_the_container_port(container: dict[str, Any]) -> None:
    env = {item["name"]: item["value"] for item in container["env"]}
    (port,) = container["ports"]
    assert int(env["DYNAMO_LITE_PORT"]) == port["containerPort"]
    paths = served_paths(container["command"][-1])
    probes = [container[key] for key in ("startupProbe", "livenessProbe", "readinessProbe") if key in container]
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    for probe in probes:
        assert probe["httpGet"]["path"] in paths
        assert probe["httpGet"]["port"] == port["name"]


def test_dockerfile_health_check_runs_the_probe_module() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    check = re.search(r"HEALTHCHECK .*?CMD (\[.*?\])", dockerfile, re.S)
    assert check is not None
    assert yaml.safe_load(check.group(1))[:3] == ["python", "-m", "dynamo_lite.probe"]


def test_probe_passes_on_a_live_service_and_fails_on_a_closed_port() -> None:
    port = free_port()
    with running_server([sys.executable, "-m", "dynamo_lite.slot_tracker", "--port", str(port)], port):
        for path in ("/health", "/ready"):
            assert subprocess.run([*PROBE, "--port", str(port), "--path", path], timeout=30).returncode == 0
        env = {**os.environ, "DYNAMO_LITE_PORT": str(port)}
        assert subprocess.run(PROBE, env=env, timeout=30).returncode == 0
    closed = subprocess.run(
        [*PROBE, "--port", str(port), "--timeout", "0.5"], capture_output=True, text=True, timeout=30
    )
    assert closed.returncode == 1
    assert "no service answered /health" in closed.stderr
