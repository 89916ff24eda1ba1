"""ZMQ publishers that put the exact bytes of real engines' KV events on the wire.

The indexer has to ingest what inference engines really publish, so these publishers reproduce
each engine's wire format byte for byte. The engine stand-in (`dynamo_lite.mock_engine`)
publishes its cache's events with them, and the tests drive the indexer with them: the payload
is encoded from `msgspec.Struct` classes declared with the same options (array_like /
omit_defaults / tag / field order / defaults) as the engine's own, with
`msgspec.msgpack.Encoder()` as the engines use it. The layouts come from:

* `WireFormat.VLLM` -- vLLM 0.33.0, `vllm/distributed/kv_events.py`: a positional batch
  `[ts, events, data_parallel_rank]` (array_like, omit_defaults) of map events tagged `"type"`
  (omit_defaults). Replay answers `[topic, seq, payload]`.
* `WireFormat.VLLM_MAP_BATCH` -- vLLM builds between the two: the batch is a map
  `{"ts", "events", "data_parallel_rank"}` (no array_like), events are the same tagged maps
  (without vLLM 0.33's locality / ownership / session_id / lookahead_token_ids). Replay answers
  `[seq, payload]`.
* `WireFormat.VLLM_LEGACY` -- the vLLM that Dynamo 1.6.1 was built against: a positional batch of
  positional events (array_like, tag=True: the tag is the first element), e.g.
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name]`. Replay answers `[seq, payload]`. msgspec ignores omit_defaults on array_like
  structs (jcrist/msgspec#720): an array always has one element per declared field, so its
  length tells the vLLM version. Later versions of this layout appended `extra_keys, group_idx`
  and then `kv_cache_spec_kind, kv_cache_spec_sliding_window`; see `_legacy_event_struct`.
* `WireFormat.SGLANG` -- SGLang 0.5.23, `sglang/srt/disaggregation/kv_events.py` (structs,
  publisher) and `sglang/srt/mem_cache/events.py` (what the radix cache records): a positional
  batch `[ts, events, attn_dp_rank]` declared WITHOUT omit_defaults (not that it would matter,
  see above) of tagged map events (omit_defaults). Replay answers `[topic, seq, payload]`.
  Hashes are signed int64. The radix cache records one BlockStored per page (`block_hashes=[h]`,
  `block_size` = the page's token count, `lora_id=None`, medium "GPU" unless a lower tier) and
  then merges a page into the queued event before it when it continues that event's chain with
  the same attributes, so a published store usually carries several hashes.

Every positional batch therefore has three elements, the rank nil when it is None.

All publishers send `[topic, seq (8-byte big-endian, from 0 per publisher), payload]` on a PUB
socket and, like the engines' `ZmqEventPublisher`, serve replays from a ROUTER socket: a request
`[identity, b"", start_seq (8-byte big-endian)]` is answered with every buffered batch whose seq
>= start_seq, then an end marker whose seq frame is `END_SEQ` (-1 as 8 signed big-endian bytes).

Engine-neutral events (`Stored`, `Removed`, `Cleared`) are turned into each format's structs by
field name, so a field a format does not declare is simply not written (see `Stored`).
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import msgspec
import zmq

from .base.integers import U64_MASK

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""Seq frame of the replay end marker (both engines' `ZmqEventPublisher.END_SEQ`)."""

VLLM_MEDIA = ("GPU", "CPU", "STORAGE")
"""vLLM's medium strings (`MEDIUM_GPU`, `MEDIUM_CPU`, `MEDIUM_STORAGE`)."""

SGLANG_MEDIA = ("GPU", "CPU_PINNED", "DISK", "EXTERNAL")
"""SGLang's `StorageMedium` values (device HBM, host pinned, SSD, shared/remote pool)."""

BlockHash = int | bytes
"""vLLM's `ExternalBlockHash`: an int, or a 32-byte sha256 digest when
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`. SGLang only publishes signed int64 ints."""


def int_block_hash(block_hash: BlockHash) -> int:
    """The int vLLM publishes for a digest when int hashes are on (`maybe_convert_block_hash`):
    the low 64 bits of the big-endian digest. Ints are returned unchanged."""
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash, "big") & U64_MASK
    return block_hash


class WireFormat(enum.Enum):
    """One value per payload layout an indexer may have to decode."""

    VLLM_LEGACY = "vllm-legacy"  # positional batch of positional events; replay [seq, payload]
    VLLM_MAP_BATCH = "vllm-map-batch"  # map batch of map events; replay [seq, payload]
    VLLM = "vllm"  # vLLM 0.33: positional batch of map events; replay [topic, seq, payload]
    SGLANG = "sglang"  # positional [ts, events, attn_dp_rank] of map events; replay [topic, seq, payload]

    @property
    def replay_has_topic(self) -> bool:
        """Whether replayed batches (and the end marker) carry a topic frame before the seq."""
        return self in (WireFormat.VLLM, WireFormat.SGLANG)


# --- Engine-neutral events -------------------------------------------------------------------


@dataclass(frozen=True)
class Stored:
    """One BlockStored, described independently of the engine.

    Field names are the engines' field names. Which format writes which optional field:

    * every format: `lora_id`, `medium`, `lora_name`;
    * all vLLM formats: `extra_keys`, `group_idx`, `kv_cache_spec_kind`,
      `kv_cache_spec_sliding_window`;
    * `VLLM` (0.33) only: `locality`, `ownership`, `lookahead_token_ids`;
    * `VLLM` and `SGLANG`: `session_id`;
    * `SGLANG` only: `cache_salt` (vLLM has no such field: it publishes the salt as a plain
      string inside the first block's `extra_keys` entry).

    A field the chosen format does not declare is not written, whatever its value. In the map
    formats `lora_id`, `medium` and `lora_name` are always written (nil when None; they have
    no default), except SGLang's `medium`, which has one and is omitted when None; every other
    optional field is omitted when None. VLLM_LEGACY events are arrays and always carry every
    field of the vLLM version they come from (nil when None): 7 fields, 9 with
    `extra_keys`/`group_idx`, 11 with the `kv_cache_spec_*` pair; the shortest version that
    can carry the fields set here is used.
    """

    block_hashes: Sequence[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    extra_keys: Sequence[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: Sequence[Sequence[int]] | None = None


@dataclass(frozen=True)
class Removed:
    """One BlockRemoved. `group_idx` is written by the vLLM formats, `locality` and `ownership`
    by `VLLM` (0.33) only; SGLang omits `medium` when None, vLLM writes nil. VLLM_LEGACY
    writes `[tag, block_hashes, medium]`, plus `group_idx` when it is set (the later version)."""

    block_hashes: Sequence[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True)
class Cleared:
    """AllBlocksCleared: the engine dropped its whole cache (no fields in any format)."""


Event = Stored | Removed | Cleared


# --- The engines' structs, one set per format ------------------------------------------------
# Options, field order and defaults as declared by each engine. Tags are spelled out because
# the classes are renamed here; `tag=True` in the engines tags with the class name, the same
# string. The engines' `__hash__` methods (for their multi-worker aggregator) do not affect
# encoding and are left out.

# VLLM_LEGACY: everything positional.


class _LegacyBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


# Successive vLLM versions of the positional event; each array is as long as its version's
# field list, whatever the values.


class _LegacyBlockStored(_LegacyEvent, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class _LegacyBlockStoredGroups(_LegacyBlockStored, tag="BlockStored"):
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class _LegacyBlockStoredSpec(_LegacyBlockStoredGroups, tag="BlockStored"):
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _LegacyBlockRemoved(_LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None


class _LegacyBlockRemovedGroups(_LegacyBlockRemoved, tag="BlockRemoved"):
    group_idx: int | None = None


class _LegacyAllBlocksCleared(_LegacyEvent, tag="AllBlocksCleared"):
    pass


def _legacy_event_struct(event: Stored | Removed) -> type[msgspec.Struct]:
    """The oldest positional vLLM version whose event carries every field set in `event`."""
    if isinstance(event, Removed):
        return _LegacyBlockRemoved if event.group_idx is None else _LegacyBlockRemovedGroups
    if event.kv_cache_spec_kind is not None or event.kv_cache_spec_sliding_window is not None:
        return _LegacyBlockStoredSpec
    if event.extra_keys is not None or event.group_idx is not None:
        return _LegacyBlockStoredGroups
    return _LegacyBlockStored


# VLLM_MAP_BATCH: a map batch of map events.


class _MapBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _MapBlockStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _MapBlockRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class _MapAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


# VLLM (0.33): a positional batch of map events.


class _VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


# vLLM 0.33 appended four optional fields to the in-between build's events; a msgspec subclass
# appends its fields after its parent's, so the encoding is the same as the declaration's.


class _VllmBlockStored(_MapBlockStored, tag="BlockStored"):
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _VllmBlockRemoved(_MapBlockRemoved, tag="BlockRemoved"):
    locality: str | None = None
    ownership: str | None = None


class _VllmAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


# SGLANG: a positional batch WITHOUT omit_defaults (attn_dp_rank always present) of map events,
# declared like vLLM's (omit_defaults, tag=True) with SGLang's own fields.


class _SglangBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class _SglangBlockStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class _SglangBlockRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class _SglangAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


# The batch struct and the name of its rank field, per format.
_BATCHES: dict[WireFormat, tuple[type[msgspec.Struct], str]] = {
    WireFormat.VLLM_LEGACY: (_LegacyBatch, "data_parallel_rank"),
    WireFormat.VLLM_MAP_BATCH: (_MapBatch, "data_parallel_rank"),
    WireFormat.VLLM: (_VllmBatch, "data_parallel_rank"),
    WireFormat.SGLANG: (_SglangBatch, "attn_dp_rank"),
}

# The (BlockStored, BlockRemoved, AllBlocksCleared) structs of the map-event formats.
_MAP_EVENTS: dict[WireFormat, tuple[type[msgspec.Struct], type[msgspec.Struct], type[msgspec.Struct]]] = {
    WireFormat.VLLM_MAP_BATCH: (_MapBlockStored, _MapBlockRemoved, _MapAllBlocksCleared),
    WireFormat.VLLM: (_VllmBlockStored, _VllmBlockRemoved, _VllmAllBlocksCleared),
    WireFormat.SGLANG: (_SglangBlockStored, _SglangBlockRemoved, _SglangAllBlocksCleared),
}


def _event_struct(fmt: WireFormat, event: Event) -> type[msgspec.Struct]:
    if isinstance(event, Cleared):
        return _LegacyAllBlocksCleared if fmt is WireFormat.VLLM_LEGACY else _MAP_EVENTS[fmt][2]
    if isinstance(event, (Stored, Removed)):
        if fmt is WireFormat.VLLM_LEGACY:
            return _legacy_event_struct(event)
        stored, removed, _ = _MAP_EVENTS[fmt]
        return stored if isinstance(event, Stored) else removed
    raise TypeError(f"not a Stored, Removed or Cleared event: {event!r}")


def _to_struct(fmt: WireFormat, event: Event) -> msgspec.Struct:
    """The format's struct for `event`, given the neutral fields the struct declares."""
    cls = _event_struct(fmt, event)
    declared = set(cls.__struct_fields__)
    return cls(**{f.name: getattr(event, f.name) for f in fields(event) if f.name in declared})


def _encode(
    encoder: msgspec.msgpack.Encoder, fmt: WireFormat, events: Sequence[Event], dp_rank: int | None, ts: float
) -> bytes:
    batch, rank_field = _BATCHES[fmt]
    return encoder.encode(batch(ts=ts, events=[_to_struct(fmt, event) for event in events], **{rank_field: dp_rank}))


def encode_batch(fmt: WireFormat, events: Sequence[Event], *, dp_rank: int | None, ts: float) -> bytes:
    """The payload frame an engine of format `fmt` publishes for one batch of `events`.

    `dp_rank=None` is what a batch looks like before the engine's publisher fills in its rank
    (VLLM_MAP_BATCH then omits the key, the positional batches write nil); the engines'
    publishers always fill it in, as `EnginePublisher.publish` does.
    """
    return _encode(msgspec.msgpack.Encoder(), fmt, events, dp_rank, ts)


# --- The publisher ---------------------------------------------------------------------------


class EnginePublisher:
    """One engine's publisher on loopback, like the engine's `ZmqEventPublisher`.

    A PUB-side socket bound to `tcp://127.0.0.1:<free port>` sends `[topic, seq, payload]`, seq
    an 8-byte big-endian count from 0 per publisher. With `replay=True` a ROUTER socket on its
    own free port serves replay requests from a background thread (the engines serve them from
    their publisher thread) out of a replay buffer bounded to the last `buffer_steps` batches.

    ZMQ sockets are not thread-safe: the PUB socket is used only from the caller's thread, the
    ROUTER only from the replay thread (it is created and bound here, then handed over; thread
    start is a full memory barrier, which ZMQ requires for such a migration). The replay
    buffer and `replay_requests` are shared and guarded by a lock.
    """

    def __init__(
        self,
        fmt: WireFormat,
        *,
        dp_rank: int = 0,
        topic: bytes = b"",
        replay: bool = True,
        buffer_steps: int = 10_000,
        context: zmq.Context | None = None,
        bind: str | None = None,
        replay_bind: str | None = None,
        send_hwm: int = 1_000_000,
    ) -> None:
        """`bind` / `replay_bind`: the addresses to bind, as an engine's `endpoint` and
        `replay_endpoint` (e.g. `tcp://*:5557`); None binds a free loopback port. `send_hwm`:
        messages queued per subscriber before ZMQ drops (0: never drop, the queue grows)."""
        self.fmt = fmt
        self.dp_rank = dp_rank
        self.topic = topic
        self.seq = 0  # the seq the next publish uses
        self.subscribers = 0  # net subscriptions seen by `wait_for_subscribers`
        self.replay_requests = 0  # valid replay requests received (read it after a replay ends)
        # (time.monotonic(), start_seq) of each of those requests, in the order they arrived.
        self.replay_log: list[tuple[float, int]] = []
        # Batches an answer sends before it breaks off without its end marker (None: whole
        # answers): an engine that stalls or dies in the middle of a replay.
        self.replay_answer_limit: int | None = None
        # Seconds between two replayed messages: an engine whose publisher thread answers a
        # replay in pieces while it also publishes (the answer spreads over time).
        self.replay_pause_secs = 0.0
        self._answering = threading.Event()  # cleared by `hold_replays`
        self._answering.set()
        self._encoder = msgspec.msgpack.Encoder()
        self._drop = 0
        self._closed = False
        self._lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._own_context = context is None
        self._context = zmq.Context() if context is None else context

        # XPUB rather than PUB: it behaves like PUB for sending, but also hands us every
        # subscription. A SUB that connects late misses whatever was published before its
        # subscription arrived (ZMQ's slow-joiner problem), so tests wait for the
        # subscription (`wait_for_subscribers`) before publishing. XPUB_VERBOSE passes
        # every subscription, not only the first one for a given prefix.
        self._pub = self._context.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._pub.setsockopt(zmq.SNDHWM, send_hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = _bind(self._pub, bind)

        self.replay_endpoint: str | None = None
        self._router: zmq.Socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay:
            router = self._context.socket(zmq.ROUTER)
            # As vLLM 0.33: room for a whole replay plus its end marker for a slow reader.
            router.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
            router.setsockopt(zmq.LINGER, 0)
            try:
                self.replay_endpoint = _bind(router, replay_bind)
            except BaseException:
                router.close(linger=0)
                self._pub.close(linger=0)
                raise
            self._router = router
            self._thread = threading.Thread(
                target=self._serve_replay, name=f"replay-{fmt.value}-dp{dp_rank}", daemon=True
            )
            self._thread.start()

    # --- subscriptions -----------------------------------------------------------------------

    def wait_for_subscribers(self, count: int = 1, timeout: float = 10.0) -> None:
        """Block until `count` subscriptions (net of unsubscriptions) have arrived, so whatever
        is published next reaches those subscribers."""
        self._follow_subscriptions(lambda: self.subscribers >= count, timeout, f"{count} subscribers")

    def wait_for_unsubscribed(self, timeout: float = 10.0) -> None:
        """Block until every subscriber has gone (unsubscribed, or closed its socket)."""
        self._follow_subscriptions(lambda: self.subscribers <= 0, timeout, "no subscriber")

    def _follow_subscriptions(self, done: Callable[[], bool], timeout: float, wanted: str) -> None:
        """Count the (un)subscription frames XPUB_VERBOSE passes on until `done()`."""
        deadline = time.monotonic() + timeout
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self!r}: {self.subscribers} subscribers, not {wanted}, after {timeout} s")
            if self._pub.poll(int(min(remaining, 0.2) * 1000) + 1, zmq.POLLIN):
                frame = self._pub.recv()
                if frame[:1] == b"\x01":
                    self.subscribers += 1
                elif frame[:1] == b"\x00":
                    self.subscribers -= 1

    # --- publishing --------------------------------------------------------------------------

    def publish(self, events: Sequence[Event], *, ts: float | None = None) -> int:
        """Publish one batch with this publisher's dp rank filled in (as the engines do);
        returns the seq it used. The batch is also kept for replay."""
        payload = _encode(self._encoder, self.fmt, events, self.dp_rank, time.time() if ts is None else ts)
        return self.publish_raw(payload)

    def publish_raw(self, payload: bytes, frames: list[bytes] | None = None) -> int:
        """Publish `payload` as is (e.g. malformed msgpack) as the next batch: a seq is consumed
        and returned, and `(seq, payload)` is kept for replay, as the engines keep every batch
        they send. With `frames`, send exactly those frames instead (wrong frame counts, odd seq
        frames): a message that is no batch, so no seq is consumed (-1 is returned) and nothing
        is kept for replay.
        """
        if self._closed:
            raise RuntimeError("Publisher is closed")
        if frames is not None:
            message = list(frames)
            seq = -1
        else:
            seq = self.seq
            self.seq += 1
            message = [self.topic, seq.to_bytes(8, "big"), payload]
            if self._router is not None:  # without replay nothing is ever read back
                with self._lock:
                    self._buffer.append((seq, payload))
        if self._drop > 0:
            self._drop -= 1
        else:
            self._pub.send_multipart(message)
        return seq

    def drop_next(self, n: int = 1) -> None:
        """Lose the next `n` publishes (`publish` or `publish_raw`) on the way to subscribers:
        they consume seqs and are kept for replay, but are not sent, so a subscriber sees a
        seq gap. Pending drops survive `restart`."""
        if n < 0:
            raise ValueError("n must be >= 0")
        self._drop += n

    def restart(self) -> None:
        """A fast engine restart behind the same address: seq back to 0, replay buffer empty.

        The sockets are kept, so subscribers stay connected and simply see seqs start over.
        """
        with self._lock:
            self._buffer.clear()
        self.seq = 0

    # --- replay ------------------------------------------------------------------------------

    def hold_replays(self) -> None:
        """Take replay requests (counted in `replay_requests`) but answer none until
        `release_replays`: the moment between a subscriber asking and the answer is then the
        caller's, e.g. to stop the subscriber's process before the answer reaches it."""
        self._answering.clear()

    def release_replays(self) -> None:
        """Answer the requests held since `hold_replays`, in order, and the next ones at once."""
        self._answering.set()

    def _serve_replay(self) -> None:
        """Replay thread: answer requests until `close`, then close the ROUTER socket."""
        router = self._router
        assert router is not None
        held: list[tuple[bytes, int]] = []  # requests taken while `hold_replays` is on
        try:
            while not self._stop.is_set():
                if held and self._answering.is_set():
                    for identity, start_seq in held:
                        self._answer_replay(router, identity, start_seq)
                    held.clear()
                if not router.poll(20, zmq.POLLIN):
                    continue
                request = router.recv_multipart()
                if len(request) != 3:
                    continue  # the engines log "Invalid replay request" and ignore it
                identity, _, start = request
                start_seq = int.from_bytes(start, "big")
                with self._lock:
                    self.replay_requests += 1
                    self.replay_log.append((time.monotonic(), start_seq))
                held.append((identity, start_seq))
        finally:
            router.close(linger=0)

    def _answer_replay(self, router: zmq.Socket, identity: bytes, start_seq: int) -> None:
        """Every buffered batch from `start_seq` on, as the buffer is now, then the end marker
        (only the first `replay_answer_limit` batches and no end marker, when it is set)."""
        with self._lock:
            batches = [(seq, payload) for seq, payload in self._buffer if seq >= start_seq]
        limit = self.replay_answer_limit
        for seq, payload in batches[:limit]:
            router.send_multipart(self._replay_frames(identity, self.topic, seq.to_bytes(8, "big"), payload))
            if self.replay_pause_secs and self._stop.wait(self.replay_pause_secs):
                return
        if limit is not None and len(batches) > limit:
            return  # broken off: the subscriber hears nothing more of this answer
        # The end marker's topic frame (where there is one) is empty, not the topic.
        router.send_multipart(self._replay_frames(identity, b"", END_SEQ, b""))

    def _replay_frames(self, identity: bytes, topic: bytes, seq: bytes, payload: bytes) -> list[bytes]:
        if self.fmt.replay_has_topic:
            return [identity, b"", topic, seq, payload]
        return [identity, b"", seq, payload]

    # --- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the replay thread, close both sockets and, if this publisher made it, the
        context. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._pub.close(linger=0)
        if self._own_context:
            self._context.term()

    def __enter__(self) -> EnginePublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EnginePublisher({self.fmt.name}, dp_rank={self.dp_rank}, endpoint={self.endpoint!r})"


def _bind(socket: zmq.Socket, address: str | None) -> str:
    """Bind `socket` to `address` (a free loopback port when None); the address to connect to."""
    if address is None:
        return f"tcp://127.0.0.1:{socket.bind_to_random_port('tcp://127.0.0.1')}"
    socket.bind(address)
    bound = socket.getsockopt_string(zmq.LAST_ENDPOINT)
    return bound.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:")


class DpEngine:
    """An engine with data parallelism: one `EnginePublisher` per dp rank, each on its own port
    and filling its own rank into every batch, as vLLM and SGLang publish per rank.

    (The engines derive rank r's port as base + r; here every rank binds a free port, so use
    `endpoints` / `replay_endpoints` rather than arithmetic.)
    """

    def __init__(
        self,
        fmt: WireFormat,
        dp_size: int,
        *,
        topic: bytes = b"",
        replay: bool = True,
        buffer_steps: int = 10_000,
        context: zmq.Context | None = None,
    ) -> None:
        if dp_size < 1:
            raise ValueError("dp_size must be >= 1")
        self._own_context = context is None
        self._context = zmq.Context() if context is None else context
        self.ranks: list[EnginePublisher] = []
        try:
            for rank in range(dp_size):
                self.ranks.append(
                    EnginePublisher(
                        fmt, dp_rank=rank, topic=topic, replay=replay, buffer_steps=buffer_steps, context=self._context
                    )
                )
        except BaseException:
            self.close()
            raise

    @property
    def endpoints(self) -> list[str]:
        return [rank.endpoint for rank in self.ranks]

    @property
    def replay_endpoints(self) -> list[str | None]:
        return [rank.replay_endpoint for rank in self.ranks]

    def wait_for_subscribers(self, count: int = 1, timeout: float = 10.0) -> None:
        """`EnginePublisher.wait_for_subscribers` on every rank (`timeout` per rank)."""
        for rank in self.ranks:
            rank.wait_for_subscribers(count, timeout)

    def __getitem__(self, dp_rank: int) -> EnginePublisher:
        return self.ranks[dp_rank]

    def __len__(self) -> int:
        return len(self.ranks)

    def __iter__(self) -> Iterator[EnginePublisher]:
        return iter(self.ranks)

    def close(self) -> None:
        for rank in self.ranks:
            rank.close()
        if self._own_context and not self._context.closed:
            self._context.term()

    def __enter__(self) -> DpEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
