"""The pool watcher: the picker's current pool, kept in step with its file and registered.

Each turn re-reads the file when it changed; a new pool becomes the wanted registrations of two
`dynamo_lite.routing.reconcile.Reconciler`s (the slot tracker's and the indexer's), and a reconcile pass
runs whenever the pool changed, the last pass did not converge (a service down, a conflict), or
every `verify_interval` seconds (a service that restarted without its state gets it again). The
watcher keeps no registration state of its own: each pass starts from what the services list.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from dynamo_lite.routing.reconcile import Outcome, Reconciler, Registry
from dynamo_lite.routing.registrar import IndexedRank, TrackerWorker

from .endpoint import PoolEndpoint, RankKey
from .pool_file import PoolError, load_pool
from .registration import POOL_LOGGER, indexer_rank, tracker_workers

log = logging.getLogger(POOL_LOGGER)

OnChange = Callable[[list[PoolEndpoint]], Any]


class Registrations(Protocol):
    """What `PoolWatcher` registers through: `registration.PoolRegistrar` (both services), or the
    picker's own cores (`state.LocalRegistrar`, `--state in-process`)."""

    @property
    def tracker_registry(self) -> Registry[TrackerWorker]: ...

    @property
    def indexer_registry(self) -> Registry[IndexedRank]: ...


@dataclass
class PoolDiff:
    """What changed between two pools, by rank_key: `changed` holds (old, new) pairs of the
    same rank with some other field different."""

    added: list[PoolEndpoint] = field(default_factory=list)
    removed: list[PoolEndpoint] = field(default_factory=list)
    changed: list[tuple[PoolEndpoint, PoolEndpoint]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)


def diff(old: Iterable[PoolEndpoint], new: Iterable[PoolEndpoint]) -> PoolDiff:
    """Added, removed and changed endpoints from `old` to `new`, each in its pool's order."""
    before = {ep.rank_key: ep for ep in old}
    after = {ep.rank_key: ep for ep in new}
    return PoolDiff(
        added=[ep for key, ep in after.items() if key not in before],
        removed=[ep for key, ep in before.items() if key not in after],
        changed=[(before[key], ep) for key, ep in after.items() if key in before and before[key] != ep],
    )


class PoolWatcher:
    """The current pool, kept in step with its file and registered with both services.

    `run()` (a task for the picker's lifetime) registers the pool, then every `interval`
    seconds re-reads the file if its mtime, size or inode changed (or `reload()` was called: the
    CLI's SIGHUP) and reconciles the registrations when the pool changed, the last pass left
    something undone, or `verify_interval` seconds have passed since the last pass.

    A valid new file: its registrations become the wanted ones (what left it, and the old form
    of what changed there, is unregistered, the rest registered); then the pool is swapped and
    the `on_change` callbacks called with it (a callback may be a coroutine function; its errors
    are logged). An invalid file is logged and ignored: the pool stays as it was. Nothing is
    unregistered when the watcher stops: several pickers may share the pool.

    `pool`, `by_address` and `ready` are read by the picker; treat `pool` and `by_address` as
    read-only (a change swaps them whole).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        registrar: Registrations,
        *,
        interval: float = 1.0,
        verify_interval: float = 10.0,
        on_change: Iterable[OnChange] = (),
        pool: Sequence[PoolEndpoint] | None = None,
    ) -> None:
        """`pool`: the pool already loaded from `path` (else it is loaded here: PoolError if the
        file is invalid, so a picker does not start on a broken file)."""
        self.path = Path(path)
        self.registrar = registrar
        self.interval = interval
        self.verify_interval = verify_interval
        self.on_change: list[OnChange] = list(on_change)
        """Called with each new pool once it is in force (append to it freely)."""
        self._file_key = self._stat_key()
        self._set_pool(list(pool) if pool is not None else load_pool(self.path))
        self.last_error: str | None = None  # the file's problem, while it has one
        self._tracker = Reconciler(registrar.tracker_registry, logger=log)
        self._indexer = Reconciler(registrar.indexer_registry, logger=log)
        self._want(self._pool)
        self._last: tuple[Outcome[TrackerWorker], Outcome[IndexedRank]] | None = None
        self._last_pass = -math.inf
        self._reload = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None

    # --- what the picker reads ------------------------------------------------------------------

    @property
    def pool(self) -> list[PoolEndpoint]:
        return self._pool

    @property
    def by_address(self) -> dict[str, PoolEndpoint]:
        return self._by_address

    @property
    def ready(self) -> bool:
        """Every endpoint registered with both services at the last pass."""
        return self._last is not None and self._last[0].converged and self._last[1].converged

    @property
    def registered(self) -> set[RankKey]:
        """The rank_keys of the pool registered with both services at the last pass."""
        if self._last is None:
            return set()
        tracker, indexer = self._last
        with_tracker = set().union(*(w.rank_keys for w in tracker.held))
        return {r.rank_key for r in indexer.held if r.rank_key in with_tracker}

    def add_on_change(self, callback: OnChange) -> None:
        self.on_change.append(callback)

    # --- driving it -----------------------------------------------------------------------------

    def reload(self) -> None:
        """Re-read the file at the next turn even if it looks unchanged (from a signal handler,
        the loop's thread, or another thread)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            # Safe from a signal handler or another thread alike: the set runs on the loop.
            loop.call_soon_threadsafe(self._reload.set)
        else:
            self._reload.set()

    async def run(self) -> None:
        """Register the pool, then follow the file until cancelled."""
        self._loop = asyncio.get_running_loop()
        while True:
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - one bad turn must not end the watching
                log.exception("pool watcher: the turn failed; trying again in %.1f s", self.interval)
            try:
                await asyncio.wait_for(self._reload.wait(), timeout=self.interval)
            except asyncio.TimeoutError:
                pass

    async def refresh(self, force: bool = False) -> bool:
        """One turn: re-read the file if it changed (or `force`, or `reload()` was called), then
        reconcile if due. True when a new pool was taken."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            force = force or self._reload.is_set()
            self._reload.clear()
            new_pool = self._read_if_changed(force)
            if new_pool is not None and new_pool == self._pool:
                new_pool = None
            if new_pool is not None:
                changes = diff(self._pool, new_pool)
                log.info(
                    "%s: %d endpoints (%d added, %d removed, %d changed)", self.path, len(new_pool),
                    len(changes.added), len(changes.removed), len(changes.changed),
                )
                self._want(new_pool)
            now = time.monotonic()
            if new_pool is not None or not self.ready or now - self._last_pass >= self.verify_interval:
                self._last_pass = now
                self._last = await asyncio.gather(self._tracker.reconcile(), self._indexer.reconcile())
            if new_pool is not None:
                self._set_pool(new_pool)
        if new_pool is not None:
            await self._notify(new_pool)
        return new_pool is not None

    # --- internals ------------------------------------------------------------------------------

    def _want(self, pool: list[PoolEndpoint]) -> None:
        self._tracker.want(tracker_workers(pool))
        self._indexer.want(indexer_rank(ep) for ep in pool)

    def _set_pool(self, pool: list[PoolEndpoint]) -> None:
        self._pool = pool
        self._by_address = {ep.address: ep for ep in pool}

    def _stat_key(self) -> tuple[int, ...] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)

    def _read_if_changed(self, force: bool) -> list[PoolEndpoint] | None:
        key = self._stat_key()
        if key is None:
            self._problem(f"{self.path}: cannot read the pool file (missing?)")
            self._file_key = None  # read it again whenever it is back
            return None
        if key == self._file_key and not force:
            return None
        self._file_key = key  # stat before reading: a write during the read shows at the next turn
        try:
            pool = load_pool(self.path)
        except PoolError as exc:
            self._problem(str(exc), again=True)
            return None
        if self.last_error is not None:
            log.info("%s: valid again", self.path)
        self.last_error = None
        return pool

    def _problem(self, message: str, again: bool = False) -> None:
        if again or message != self.last_error:
            log.error("%s; keeping the current pool of %d endpoints", message, len(self._pool))
        self.last_error = message

    async def _notify(self, pool: list[PoolEndpoint]) -> None:
        for callback in list(self.on_change):
            try:
                result = callback(pool)
                if inspect.isawaitable(result):
                    await result
            except Exception:  # noqa: BLE001 - a callback's bug must not stop the watcher
                log.exception("pool on_change callback %r failed", callback)


__all__ = ["OnChange", "PoolDiff", "PoolWatcher", "Registrations", "diff"]
