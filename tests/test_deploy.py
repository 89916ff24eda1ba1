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


# --- deploy/compose/replicas.yaml -----------------------------------------------------------

COMPOSE = ROOT / "deploy" / "compose" / "replicas.yaml"


def compose_services() -> dict[str, dict[str, Any]]:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_compose_runs_several_replicas_of_each_service_on_nats() -> None:
    services = compose_services()
    ours = {name: service for name, service in services.items() if service.get("image") == "dynamo-lite"}
    modules = sorted(service["command"][-1] for service in ours.values())
    assert modules.count("dynamo_lite.indexer") >= 3 and modules.count("dynamo_lite.slot_tracker") >= 2
    for name, service in ours.items():
        env = service["environment"]
        assert env["DYNAMO_LITE_NATS"] == "nats://nats:4222", name
        result = subprocess.run([sys.executable, "-m", service["command"][-1], "--help"], capture_output=True,
                                text=True, timeout=60, env={**os.environ, **env})
        assert result.returncode == 0, (name, result.stderr)
        help_text = re.sub(r"\s+", " ", result.stdout)
        assert all(variable in help_text for variable in env), (name, env)
        check = service["healthcheck"]["test"]
        assert check[1:4] == ["python", "-m", "dynamo_lite.probe"]
        assert check[check.index("--path") + 1] in served_paths(service["command"][-1])
    names = [service["environment"].get("DYNAMO_LITE_NATS_REPLICA_NAME") for service in ours.values()
             if service["command"][-1] == "dynamo_lite.indexer"]
    assert len(set(names)) == len(names), "each indexer replica needs its own consumer name"


def test_compose_nats_configuration_starts_a_nats_server_with_jetstream(tmp_path: Path) -> None:
    from nats_support import nats_server_binary

    document = yaml.safe_load(COMPOSE.read_text())
    config = document["configs"]["nats-conf"]["content"]
    assert "max_payload: 8MB" in config
    port = free_port()
    local = config.replace("0.0.0.0:4222", f"127.0.0.1:{port}").replace('"/data"', f'"{tmp_path}"')
    (tmp_path / "nats.conf").write_text(local)
    process = subprocess.Popen([nats_server_binary(), "-c", str(tmp_path / "nats.conf")], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in process.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "Server is ready" in line or len(lines) > 200:
                break
        text = "".join(lines)
        assert "Server is ready" in text and "Starting JetStream" in text, text
    finally:
        process.terminate()
        process.wait(timeout=10)
