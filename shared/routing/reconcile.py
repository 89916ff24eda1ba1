"""Level-triggered reconciliation of one service's registrations: given what a process wants
registered and what the service lists (its `GET /workers`), register what is missing, replace
what changed and unregister what left, written once for the slot tracker and the indexer.

A service lists everyone's registrations (other pickers', remote selectors'), so "what left" is
not "everything listed but not wanted": only the registrations this process itself wanted
before (`retired`) are removed, and only in exactly the form it wanted them; anything else
listed is somebody else's and left alone. A wanted registration listed in a form that is not
ours is still registered, so the registrar's 409 path reports the conflict.

Each `Reconciler.reconcile()` starts from a fresh listing, so it is safe to re-run after any
failure: what went through is listed next time, what did not is planned again. `plan` is the
pure core (tested on its own); `Reconciler` lists, plans and applies through a `Registry`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

log = logging.getLogger("dynamo_lite.reconcile")  # its name from before the move: log filters use it


class Unit(Protocol):
    """One registration: equal when registered exactly alike; `identity` is what the service
    keys it by (one registration per identity), so a changed unit keeps its identity."""

    def __hash__(self) -> int: ...

    @property
    def identity(self) -> tuple[Any, ...]: ...

    def describe_registration(self) -> str: ...


U = TypeVar("U", bound=Unit)


@dataclass(frozen=True)
class Registry(Generic[U]):
    """How to list, register and unregister one service's registrations. `listing` is None
    when the service cannot be asked; `register` / `unregister` are True once the service holds
    the unit exactly so / no longer holds its identity (they log their own failures)."""

    name: str
    listing: Callable[[], Awaitable[set[U] | None]]
    register: Callable[[U], Awaitable[bool]]
    unregister: Callable[[U], Awaitable[bool]]


@dataclass(frozen=True)
class Plan(Generic[U]):
    """What one pass does: `unregister` first (listed forms to remove), then `register` (wanted
    units not listed exactly so); `held` are the wanted units already listed exactly so."""

    unregister: frozenset[U]
    register: frozenset[U]
    held: frozenset[U]

    def __bool__(self) -> bool:
        return bool(self.unregister or self.register)


def plan(desired: Iterable[U], listed: Iterable[U], retired: Iterable[U] = ()) -> Plan[U]:
    """The actions that take the service from `listed` to `desired`: register every desired
    unit not listed exactly so, and unregister every listed unit that is one of ours no more
    (in `retired`, and not desired)."""
    wanted = frozenset(desired)
    present = frozenset(listed)
    return Plan(
        unregister=(present & frozenset(retired)) - wanted,
        register=wanted - present,
        held=wanted & present,
    )


@dataclass(frozen=True)
class Outcome(Generic[U]):
    """The end of one pass: `held` the wanted units the service holds exactly so now, and
    `converged` when that is all of them (the listing answered and every action went through)."""

    held: frozenset[U]
    converged: bool


class Reconciler(Generic[U]):
    """Keeps one service's registrations in step with what is wanted (`want`), one pass per
    `reconcile()`. Its only memory is `retired`: what it wanted before and may still have to
    remove, forgotten once the service no longer lists it."""

    def __init__(self, registry: Registry[U], *, logger: logging.Logger = log) -> None:
        self.registry = registry
        self.desired: frozenset[U] = frozenset()
        self.retired: set[U] = set()
        self._log = logger

    def want(self, units: Iterable[U]) -> None:
        """Make `units` the desired registrations; what was desired before and is no longer is
        removed by the next passes."""
        new = frozenset(units)
        self.retired = (self.retired | (self.desired - new)) - new
        self.desired = new

    async def reconcile(self) -> Outcome[U]:
        """One pass: list, plan, unregister, then register (a replaced unit's old form is in the
        way of its new one, so a unit whose old form could not be removed waits a pass)."""
        listed = await self.registry.listing()
        if listed is None:
            return Outcome(frozenset(), False)
        self.retired &= listed  # the rest is gone already: nothing left to remove
        actions = plan(self.desired, listed, self.retired)
        removals = list(actions.unregister)
        removed = await asyncio.gather(*(self.registry.unregister(unit) for unit in removals))
        self.retired -= {unit for unit, ok in zip(removals, removed) if ok}
        blocked = {unit.identity for unit, ok in zip(removals, removed) if not ok}
        additions = [unit for unit in actions.register if unit.identity not in blocked]
        added = await asyncio.gather(*(self.registry.register(unit) for unit in additions))
        newly = [unit for unit, ok in zip(additions, added) if ok]
        for unit in sorted(newly, key=lambda unit: unit.identity):
            self._log.info("registered %s with the %s", unit.describe_registration(), self.registry.name)
        held = actions.held | frozenset(newly)
        return Outcome(held, all(removed) and held == self.desired)


__all__ = ["Outcome", "Plan", "Reconciler", "Registry", "Unit", "plan"]
