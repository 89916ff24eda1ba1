"""The check that every test is marked `unit` or `process` (tests/support/markers.py)."""

from __future__ import annotations

import pytest
from support.markers import marking_problem

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("marks", [{"unit"}, {"process"}, {"process", "envoy"}, {"process", "nats", "reference"},
                                   {"unit", "parametrize", "skipif"}])
def test_one_kind_and_process_under_the_process_kinds_pass(marks: set[str]) -> None:
    assert marking_problem(marks) is None


@pytest.mark.parametrize(("marks", "problem"), [
    (set(), "neither `unit` nor `process`"),
    ({"parametrize"}, "neither `unit` nor `process`"),
    ({"unit", "process"}, "both `unit` and `process`"),
    ({"unit", "envoy"}, "`envoy` without `process`"),
    ({"unit", "nats"}, "`nats` without `process`"),
    ({"unit", "reference"}, "`reference` without `process`"),
])
def test_a_test_marked_wrongly_is_named_with_what_is_wrong(marks: set[str], problem: str) -> None:
    assert marking_problem(marks) == problem
