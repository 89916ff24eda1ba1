"""Every test says what it starts: `unit` or `process`, and `envoy`, `nats`, `reference` for the
child processes that need something installed. Marker meanings are in pyproject.toml; loaded by
tests/conftest.py as a plugin. Collection fails on a test marked wrongly, so a new test cannot
slip into a group (`pytest -m unit`) it does not belong to."""

from __future__ import annotations

import pytest

KINDS = ("unit", "process")
# Each of these starts a child process of its own kind, so it is also `process`.
PROCESS_KINDS = ("envoy", "nats", "reference")


def marking_problem(marks: set[str]) -> str | None:
    """What is wrong with a test carrying these marker names, or None."""
    kinds = [kind for kind in KINDS if kind in marks]
    if not kinds:
        return "neither `unit` nor `process`"
    if len(kinds) > 1:
        return "both `unit` and `process`"
    without = [kind for kind in PROCESS_KINDS if kind in marks and "process" not in marks]
    if without:
        return f"`{without[0]}` without `process`"
    return None


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: every collected test is checked
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    problems = []
    for item in items:
        problem = marking_problem({mark.name for mark in item.iter_markers()})
        if problem is not None:
            problems.append(f"  {item.nodeid}: {problem}")
    if problems:
        raise pytest.UsageError(
            "tests marked wrongly (mark each `unit` or `process`, see docs/development.md):\n" + "\n".join(problems)
        )
