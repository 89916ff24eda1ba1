"""The index on disk: the `/dump` document, written atomically and read back at start-up.

A snapshot is exactly what `GET /dump` answers, so it can also be posted to `/events` or
served to a peer. Approximations (`/routed`) are in it with the Unix time each expires, so
those still running when the snapshot is loaded come back with the TTL they have left.

It is written to a temporary file in the same directory, flushed and fsynced, then renamed
over the previous one (and the directory fsynced), so a crash at any point leaves either the
old snapshot or the new one, never a torn file. Temporary files of a writer that died are
removed at the next start-up.

Cost: collecting the index's events runs on the event loop (the index is not thread-safe);
requests wait meanwhile: 0.25-0.4 s for 1M indexed blocks on the 2-core development machine.
The events are fresh objects (about 20 MB for 1M blocks), so a worker thread encodes them,
one event at a time straight into the file (never the whole document in memory), and fsyncs
it: 0.4 s more for 1M blocks (94 MB), sharing the GIL with the event loop. Keep the interval
well above that for big indexes.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import orjson

from dynamo_lite.base.errors import MalformedRequest, ServiceError

# The file handling is shared with the slot tracker's snapshots ("X as X": also this module's).
from dynamo_lite.durability.snapshots import SnapshotError as SnapshotError
from dynamo_lite.durability.snapshots import Snapshots as ServiceSnapshots
from dynamo_lite.durability.snapshots import read_file
from dynamo_lite.durability.snapshots import write_atomically as write_atomically
from dynamo_lite.web.validation import JSON_FAILURE

from .core import ApplyReport, Indexer
from .protocols import PartitionEvents, approximation_to_json, decode_events_document, event_to_json


def encode(indexer: Indexer) -> bytes:
    return b"".join(encode_partitions(indexer.dump_partitions()))


def encode_partitions(partitions: list[PartitionEvents]) -> Iterator[bytes]:
    """`orjson.dumps(indexer.dump())` in pieces, one event at a time: writing them as they
    come never holds the whole document in memory (three times its size when joined)."""
    yield b"{"
    for number, partition in enumerate(partitions):
        yield b"," if number else b""
        yield orjson.dumps(partition.key) + b':{"block_size":%d,"events":[' % partition.block_size
        for index, event in enumerate(partition.events):
            yield (b"," if index else b"") + orjson.dumps(event_to_json(event))
        if partition.approximations:
            yield b'],"approximations":['
            for index, entry in enumerate(partition.approximations):
                yield (b"," if index else b"") + orjson.dumps(approximation_to_json(entry))
        yield b"]}"
    yield b"}"


def load(indexer: Indexer, path: Path) -> ApplyReport | None:
    """Merge the snapshot at `path` into `indexer`; None when there is no snapshot yet.
    Raises SnapshotError when the file is unreadable or not a valid dump (nothing applied)."""
    data = read_file(path)
    if data is None:
        return None
    try:
        sections = decode_events_document(data)
    except MalformedRequest as exc:
        raise SnapshotError(f"snapshot {path} is not valid JSON: {exc.message.removeprefix(JSON_FAILURE)}") from None
    except ServiceError as exc:
        raise SnapshotError(f"snapshot {path} is not a valid dump: {exc.message}") from None
    try:
        return indexer.load_sections(sections)
    except ServiceError as exc:
        raise SnapshotError(f"snapshot {path} is not a valid dump: {exc.message}") from None


class Snapshots(ServiceSnapshots[list[PartitionEvents]]):
    """Periodic and final snapshots of one indexer to one path (the shell side)."""

    empty = "an empty index"

    def __init__(self, indexer: Indexer, path: str | os.PathLike[str], interval_secs: float,
                 *, ignore_bad: bool = False) -> None:
        super().__init__(path, interval_secs, ignore_bad=ignore_bad)
        self.indexer = indexer

    def collect(self) -> list[PartitionEvents]:
        return self.indexer.dump_partitions()

    def encode(self, state: list[PartitionEvents]) -> Iterable[bytes]:
        return encode_partitions(state)

    def load(self) -> str | None:
        report = load(self.indexer, self.path)
        return None if report is None else f"{report.applied} events applied, {report.rejected} rejected"
