"""`--allowed-endpoints`: the rules (`EndpointRules`), then the indexer as a real process refusing
`/register` endpoints outside them with a 400 naming the rules, and subscribing to those inside."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
from support.reference_server import running_service

from dynamo_lite.base.errors import InvalidArgument
from dynamo_lite.indexer.endpoints import EndpointRules

RULES = "10.0.0.0/8,fd00::/8,192.168.1.7:5557-5558,*.engines.svc.cluster.local:5557,vllm-?,ipc:///run/vllm/*"


@pytest.mark.unit
@pytest.mark.parametrize("endpoint", [
    "tcp://10.1.2.3:5557", "tcp://[fd00::1]:9000", "tcp://192.168.1.7:5558", "tcp://a.engines.svc.cluster.local:5557",
    "tcp://B.Engines.SVC.cluster.local:5557", "tcp://vllm-3:1234", "ipc:///run/vllm/engine-0",
])
def test_endpoints_inside_the_rules_pass(endpoint: str) -> None:
    EndpointRules.parse(RULES).check(endpoint)


@pytest.mark.unit
@pytest.mark.parametrize("endpoint", [
    "tcp://11.0.0.1:5557", "tcp://[fe80::1]:9000", "tcp://192.168.1.7:5559", "tcp://a.engines.svc.cluster.local:80",
    "tcp://evil.com:5557", "tcp://engines.svc.cluster.local.evil.com:5557", "tcp://vllm-33:1234",
    "ipc:///tmp/socket", "inproc://x", "tcp://localhost:5557", "tcp://127.0.0.1:5557",
])
def test_endpoints_outside_the_rules_are_a_400_naming_them(endpoint: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        EndpointRules.parse(RULES).check(endpoint)
    assert refused.value.message == f"endpoint `{endpoint}` is outside --allowed-endpoints ({RULES.replace(',', ', ')})"


@pytest.mark.unit
@pytest.mark.parametrize("text", ["", " , ", "10.0.0.0/8:0", "host:9-2", "a/b", "bad host", ":5557"])
def test_unusable_rules_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        EndpointRules.parse(text)


@pytest.mark.process
def test_the_indexer_refuses_register_outside_the_rules() -> None:
    with running_service("indexer", "--allowed-endpoints", "10.0.0.0/8,ipc:///nonexistent/*") as url, \
            httpx.Client(base_url=url, timeout=10) as client:
        register = {"instance_id": 1, "model_name": "m", "block_size": 16}
        refused = client.post("/register", json={**register, "endpoint": "tcp://127.0.0.1:5557"})
        assert refused.status_code == 400
        assert refused.json() == {"error": "endpoint `tcp://127.0.0.1:5557` is outside --allowed-endpoints "
                                           "(10.0.0.0/8, ipc:///nonexistent/*)"}
        replay = client.post("/register", json={**register, "endpoint": "ipc:///nonexistent/pub",
                                                "replay_endpoint": "tcp://8.8.8.8:5558"})
        assert replay.status_code == 400 and "replay endpoint `tcp://8.8.8.8:5558`" in replay.json()["error"]
        assert client.get("/workers").json() == []  # nothing registered by a refused request
        allowed = client.post("/register", json={**register, "endpoint": "ipc:///nonexistent/pub"})
        assert allowed.status_code == 201, allowed.text
        assert client.post("/register", json={**register, "instance_id": 2}).status_code == 201  # no endpoint: fine


@pytest.mark.process
def test_a_bad_rule_stops_the_command() -> None:
    done = subprocess.run([sys.executable, "-m", "dynamo_lite.indexer", "--allowed-endpoints", "a/b"],
                          capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert done.returncode == 2 and "allowed endpoint rule 'a/b'" in done.stderr
