"""Shared fixtures. Test support modules (e.g. support.reference_server) sit in tests/support/."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))

# the `nats_server` fixture; the check that every test is marked `unit` or `process`
pytest_plugins = ["support.nats_support", "support.markers"]

settings.register_profile("default", deadline=None)
settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", deadline=None, max_examples=10_000, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default"))


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    """A ZeroMQ context for one test (the engines' sockets and the tests' own), terminated after it."""
    context = zmq.Context()
    yield context
    context.term()
