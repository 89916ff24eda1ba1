"""What slot tracker replicas send each other (`nats_replica` publishes it, `replication.Replica`
makes and applies it): pure data and its msgpack encoding.

Every write a replica accepts (`/register`, `/unregister`, `/add`, `/prefill_complete`,
`/output_blocks`, `/free`) becomes an *op* with the replica's *origin* (a random 63-bit id drawn
at start) and the next number of the origin's *sequence*. Ops travel in `Batch`es, in sequence
order; `Heartbeat`s carry an origin's last number, so a loss at the end of a burst shows too.
"""

from __future__ import annotations

from typing import Union

import msgspec


class Tag(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """An op's name: its origin and sequence number (in `Free.seen`: an origin and the last
    number applied). A struct the garbage collector does not track, not a tuple: a replica
    keeps tags for a TTL, and tracked objects kept that long make young collections run, each
    traversing the tracker's newest hash sets (20-40 ms with 256-hash requests)."""

    origin: int
    seq: int


# --- ops: what a replica publishes for each write it accepted --------------------------------
# Compact on the wire: msgpack arrays, an integer tag first.


class Register(msgspec.Struct, array_like=True, frozen=True, tag=1):
    model_name: str
    tenant_id: str
    worker_id: int
    block_size: int
    dp_start: int
    dp_size: int
    role: str = "aggregated"  # last, with a default: a replica that predates roles still decodes it


class Unregister(msgspec.Struct, array_like=True, frozen=True, tag=2):
    model_name: str
    tenant_id: str
    worker_id: int


class Add(msgspec.Struct, array_like=True, frozen=True, tag=3):
    model_name: str
    tenant_id: str
    request_id: str
    worker_id: int
    dp_rank: int
    sequence_hashes: list[int]
    new_isl_tokens: int
    after: tuple[Tag, ...] = ()  # tags of this request id the publishing replica knew of
    expected_output_tokens: int | None = None  # last: a replica of an older version sends none


class PrefillComplete(msgspec.Struct, array_like=True, frozen=True, tag=4):
    model_name: str
    tenant_id: str
    request_id: str
    target: Tag  # the incarnation the publishing replica held


class OutputBlocks(msgspec.Struct, array_like=True, frozen=True, tag=5):
    model_name: str
    tenant_id: str
    request_id: str
    target: Tag
    output_blocks: int


class Free(msgspec.Struct, array_like=True, frozen=True, tag=6):
    model_name: str
    tenant_id: str
    request_id: str
    target: Tag | None  # None: the publishing replica held no such request
    seen: tuple[Tag, ...] = ()  # with no target: its version vector, as (origin, last seq) pairs


Op = Union[Register, Unregister, Add, PrefillComplete, OutputBlocks, Free]


class Batch(msgspec.Struct, array_like=True, frozen=True, tag=1):
    """Consecutive ops of one origin: `ops[i]` has sequence number `first_seq + i`."""

    origin: int
    first_seq: int
    accepted_at: float  # wall-clock time its first op was accepted: the replication delay starts there
    ops: list[Op]

    @property
    def last_seq(self) -> int:
        return self.first_seq + len(self.ops) - 1


class Heartbeat(msgspec.Struct, array_like=True, frozen=True, tag=2):
    """An origin is alive and has published up to `last_seq`."""

    origin: int
    last_seq: int
    sent_at: float


Message = Union[Batch, Heartbeat]

_encoder = msgspec.msgpack.Encoder()
_message_decoder = msgspec.msgpack.Decoder(Message)


def encode(value: object) -> bytes:
    return _encoder.encode(value)


def decode_message(data: bytes) -> Message:
    """Raises msgspec.DecodeError / ValidationError (ValueError) for anything else."""
    return _message_decoder.decode(data)

