"""A clock the tests move by hand: monotonic seconds, and the wall clock that goes with them."""

from __future__ import annotations

WALL = 1_800_000_000.0  # the wall clock when the monotonic one reads 0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def wall(self) -> float:
        return WALL + self.now
