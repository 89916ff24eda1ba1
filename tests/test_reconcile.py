"""The level-triggered reconcile core (`dynamo_lite.routing.reconcile`): `plan` on its own, and a
`Reconciler` against an in-memory service that keys registrations by identity, refuses a second
form of one identity (the services' 409) and fails calls when told to (a service away)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynamo_lite.routing.reconcile import Reconciler, Registry, plan

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class Reg:
    """A registration: `key` is its identity, `form` what it registers under it."""

    key: int
    form: int

    @property
    def identity(self) -> tuple[Any, ...]:
        return (self.key,)

    def describe_registration(self) -> str:
        return f"reg {self.key}/{self.form}"


@dataclass
class FakeService:
    held: dict[tuple[Any, ...], Reg]
    failures: list[bool] = field(default_factory=list)  # per call, in order: True fails it
    calls: int = 0
    listings: int = 0
    down: bool = False

    def _fails(self) -> bool:
        self.calls += 1
        return self.failures.pop(0) if self.failures else False

    async def listing(self) -> set[Reg] | None:
        self.listings += 1
        return None if self.down else set(self.held.values())

    async def register(self, unit: Reg) -> bool:
        if self._fails():
            return False
        current = self.held.get(unit.identity)
        if current is not None:
            return current == unit  # another form holds the identity: a conflict
        self.held[unit.identity] = unit
        return True

    async def unregister(self, unit: Reg) -> bool:
        if self._fails():
            return False
        self.held.pop(unit.identity, None)  # by identity, as the services do
        return True

    def registry(self) -> Registry[Reg]:
        return Registry("fake", self.listing, self.register, self.unregister)


def units(forms: dict[int, int]) -> set[Reg]:
    return {Reg(key, form) for key, form in forms.items()}


def by_identity(regs: Iterable[Reg]) -> dict[tuple[Any, ...], Reg]:
    return {reg.identity: reg for reg in regs}


def expected(desired: set[Reg], listed: set[Reg], retired: set[Reg]) -> dict[tuple[Any, ...], Reg]:
    """Where reconciling ends: ours removed, somebody else's kept (and winning its identity), the
    rest of what is desired registered."""
    state = by_identity(reg for reg in listed if reg not in retired or reg in desired)
    for reg in desired:
        state.setdefault(reg.identity, reg)
    return state


forms = st.dictionaries(st.integers(0, 7), st.integers(0, 2), max_size=8)
regs = st.sets(st.builds(Reg, st.integers(0, 7), st.integers(0, 2)), max_size=8)


def apply(actions_unregister: Iterable[Reg], actions_register: Iterable[Reg],
          held: dict[tuple[Any, ...], Reg]) -> dict[tuple[Any, ...], Reg]:
    state = dict(held)
    for reg in actions_unregister:
        state.pop(reg.identity, None)
    for reg in actions_register:
        state.setdefault(reg.identity, reg)
    return state


@given(desired=forms, listed=forms, retired=regs)
def test_a_plan_applied_reaches_the_desired_state_and_a_second_plan_does_nothing(
        desired: dict[int, int], listed: dict[int, int], retired: set[Reg]) -> None:
    want, present = units(desired), units(listed)
    actions = plan(want, present, retired)
    assert actions.held == want & present
    assert not actions.unregister & want and actions.unregister <= present & retired
    final = apply(actions.unregister, actions.register, by_identity(present))
    assert final == expected(want, present, retired)
    # Again, on what the first left: nothing to remove, and only somebody else's forms in the way.
    again = plan(want, set(final.values()), retired)
    assert not again.unregister
    assert all(final[reg.identity] != reg and final[reg.identity] not in retired for reg in again.register)
    if all(reg.identity not in by_identity(present - retired) or reg in present for reg in want):
        assert not again  # nothing foreign in the way: converged


def test_a_plan_replaces_our_old_form_and_leaves_others_alone() -> None:
    old, new, gone, foreign, theirs = Reg(1, 0), Reg(1, 1), Reg(2, 0), Reg(3, 0), Reg(4, 0)
    actions = plan([new, Reg(3, 1)], [old, gone, foreign, theirs], retired=[old, gone])
    assert actions.unregister == {old, gone}
    assert actions.register == {new, Reg(3, 1)}  # (3, 1) will meet somebody else's (3, 0): a 409
    assert not actions.held


@given(first=forms, second=forms, others=forms, failures=st.lists(st.booleans(), max_size=20))
def test_a_reconciler_converges_through_failures_and_follows_a_change(
        first: dict[int, int], second: dict[int, int], others: dict[int, int], failures: list[bool]) -> None:
    # Somebody else's registrations, on identities this process never wants (they stay put).
    foreign = {Reg(key + 100, form) for key, form in others.items()}
    service = FakeService(by_identity(foreign), failures=list(failures))
    reconciler = Reconciler(service.registry())

    async def converge() -> None:
        for _ in range(len(failures) + 2):
            outcome = await reconciler.reconcile()
            if outcome.converged:
                assert outcome.held == reconciler.desired
                return
        raise AssertionError("not converged once the failures ran out")

    async def body() -> None:
        reconciler.want(units(first))
        await converge()
        assert service.held == by_identity(foreign | units(first))
        reconciler.want(units(second))
        await converge()
        assert service.held == by_identity(foreign | units(second))
        calls = service.calls
        assert (await reconciler.reconcile()).converged
        assert service.calls == calls  # converged: a pass lists, and calls nothing
        assert not reconciler.retired

    asyncio.run(body())


def test_a_service_that_cannot_list_is_left_alone_until_it_can() -> None:
    service = FakeService({}, down=True)
    reconciler = Reconciler(service.registry())
    reconciler.want([Reg(1, 0)])

    async def body() -> None:
        outcome = await reconciler.reconcile()
        assert not outcome.converged and not outcome.held and service.calls == 0
        service.down = False
        assert (await reconciler.reconcile()).converged

    asyncio.run(body())
    assert service.held == {(1,): Reg(1, 0)}


def test_an_old_form_that_cannot_be_removed_holds_back_its_replacement() -> None:
    service = FakeService({(1,): Reg(1, 0)})
    reconciler = Reconciler(service.registry())
    reconciler.want([Reg(1, 0)])
    reconciler.want([Reg(1, 1)])
    service.failures = [True]  # the unregister fails once

    async def body() -> None:
        outcome = await reconciler.reconcile()
        assert not outcome.converged and service.calls == 1  # no register into the 409
        assert service.held == {(1,): Reg(1, 0)}
        assert (await reconciler.reconcile()).converged

    asyncio.run(body())
    assert service.held == {(1,): Reg(1, 1)}


def test_a_replacement_another_process_made_is_not_undone() -> None:
    # Two pickers share a pool; the other one already replaced (1, 0) by (1, 1).
    service = FakeService({(1,): Reg(1, 1)})
    reconciler = Reconciler(service.registry())
    reconciler.want([Reg(1, 0)])
    reconciler.want([Reg(1, 1)])

    async def body() -> None:
        assert (await reconciler.reconcile()).converged

    asyncio.run(body())
    assert service.calls == 0 and service.held == {(1,): Reg(1, 1)} and not reconciler.retired
