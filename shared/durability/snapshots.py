"""A service's state on disk (`--snapshot PATH` of both services): written atomically, every
`--snapshot-interval-secs` and at shutdown, and loaded at start-up.

A snapshot is written to a temporary file in the same directory, flushed and fsynced, then
renamed over the previous one (and the directory fsynced), so a crash at any point leaves either
the old snapshot or the new one, never a torn file. Temporary files of a writer that died are
removed at the next start-up.

The state is collected on the event loop (the cores are not thread-safe) into fresh objects,
which a worker thread encodes piece by piece straight into the file: the encoders hold the GIL
while they run, and the pieces let the event loop answer requests between them.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Hashable, Iterable
from pathlib import Path
from typing import ClassVar, Generic, TypeVar

logger = logging.getLogger("dynamo_lite.snapshots")

TEMP_SUFFIX = ".tmp"

S = TypeVar("S")


class SnapshotError(Exception):
    """The snapshot file exists but cannot be used."""


def write_atomically(path: Path, data: bytes | Iterable[bytes]) -> int:
    """Replace `path` with `data` so that readers (and a restart after a crash) see the old
    content or the new one, whole. Returns the bytes written."""
    directory = path.parent
    chunks = [data] if isinstance(data, bytes) else data
    size = 0
    fd, temp_name = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20) as temp:
            for chunk in chunks:
                temp.write(chunk)
                size += len(chunk)
            temp.flush()
            os.fsync(temp.fileno())
        os.replace(temp_name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp_name)
        raise
    # The rename is durable only once the directory entry is.
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return size


def remove_stale_temp_files(path: Path) -> int:
    """Delete temporary files a killed writer left beside `path`; returns how many."""
    removed = 0
    for stale in path.parent.glob(f".{path.name}.*{TEMP_SUFFIX}"):
        with contextlib.suppress(OSError):
            stale.unlink()
            removed += 1
    return removed


def read_file(path: Path) -> bytes | None:
    """The snapshot's bytes, or None when there is none yet."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SnapshotError(f"cannot read snapshot {path}: {exc}") from None


class Snapshots(abc.ABC, Generic[S]):
    """Periodic and final snapshots of one service's state `S` to one path (the shell side).

    A service says how to collect its state (`collect`, on the event loop), encode it (`encode`,
    in a worker thread) and load the file (`load`); this class does the rest."""

    empty: ClassVar[str] = "an empty state"  # what the service starts with when there is no snapshot

    def __init__(self, path: str | os.PathLike[str], interval_secs: float, *, ignore_bad: bool = False) -> None:
        self.path = Path(path)
        self.interval_secs = interval_secs
        self.ignore_bad = ignore_bad
        self.written = 0
        self._written_version: Hashable | None = None
        self._lock = asyncio.Lock()

    @abc.abstractmethod
    def collect(self) -> S:
        """The state to write, as fresh objects the event loop will not change (runs on it)."""

    @abc.abstractmethod
    def encode(self, state: S) -> Iterable[bytes]:
        """The file's bytes, in pieces (runs in a worker thread)."""

    @abc.abstractmethod
    def load(self) -> str | None:
        """Load the file at `path` into the state; return what it held, for the log, or None
        when there is no file. Raise SnapshotError, naming the file, when it cannot be used."""

    def describe(self, state: S) -> str:
        """What a collected state holds, for the log."""
        return ""

    def version(self) -> Hashable | None:
        """A value that changes whenever the state does; periodic snapshots are skipped while it
        equals the last one written. None: unknown, always write."""
        return None

    def prepare(self) -> None:
        """Check that snapshots can be written, and delete what a killed writer left."""
        if not self.path.parent.is_dir():
            raise SnapshotError(f"snapshot directory {self.path.parent} does not exist")
        remove_stale_temp_files(self.path)

    def restore(self) -> None:
        """Load the snapshot at start-up. A bad one stops the start-up (SnapshotError), unless
        `ignore_bad`: then it is renamed to `<path>.bad` and the service starts empty. A missing
        directory is a configuration error either way: no snapshot could ever be written."""
        self.prepare()
        started = time.perf_counter()
        try:
            loaded = self.load()
        except SnapshotError as exc:
            if not self.ignore_bad:
                logger.error("%s; refusing to start (repair or move it, or pass --ignore-bad-snapshot)", exc)
                raise
            aside = self.path.with_name(self.path.name + ".bad")
            os.replace(self.path, aside)
            logger.error("%s; moved it to %s and starting with %s", exc, aside, self.empty)
            return
        if loaded is None:
            logger.info("no snapshot at %s yet: starting with %s", self.path, self.empty)
            return
        logger.info("loaded snapshot %s in %.2fs: %s", self.path, time.perf_counter() - started, loaded)

    async def save(self, *, final: bool = False) -> None:
        async with self._lock:  # the periodic and the final snapshot never interleave
            started = time.perf_counter()
            version = self.version()
            state = self.collect()
            collected = time.perf_counter()
            write = asyncio.ensure_future(asyncio.to_thread(self._write, state))
            try:
                size = await asyncio.shield(write)
            except asyncio.CancelledError:
                # A thread cannot be stopped: hold the lock until its rename is done, or it
                # could land after (and over) the final snapshot of the shutdown.
                await write
                raise
            self.written += 1
            self._written_version = version
            logger.log(
                logging.INFO if final else logging.DEBUG,
                "wrote the %s snapshot to %s: %s%d bytes, %.3fs to collect (event loop), %.3fs to encode and write",
                "final" if final else "periodic", self.path, _prefix(self.describe(state)), size,
                collected - started, time.perf_counter() - collected,
            )

    async def save_final(self) -> None:
        """The snapshot at shutdown. A failure is logged: the process stops either way."""
        try:
            await self.save(final=True)
        except OSError as exc:
            logger.error("cannot write the final snapshot to %s: %s", self.path, exc)

    def _write(self, state: S) -> int:
        return write_atomically(self.path, self.encode(state))

    async def run_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.interval_secs)
            version = self.version()
            if version is not None and version == self._written_version:
                continue
            try:
                await self.save()
            except OSError as exc:
                # The disk may come back (space freed, volume remounted): keep serving.
                logger.error("cannot write snapshot %s: %s", self.path, exc)


def _prefix(description: str) -> str:
    return f"{description}, " if description else ""
