"""The merge algebra of slot tracker replicas: what a replica remembers of one request id
(`History`) and which of its adds is the request, computed from the set of ops received,
never from their order. Pure functions of immutable structs.

One request id, several adds. Each add is an *incarnation* of its request id, named by its
tag `(origin, seq)`. An add lists in `after` every tag of that request id its replica knew of
(earlier incarnations, frees, ...): those happened before it. Two incarnations neither of
which lists the other, from different origins, are *concurrent*: the same request id added
through two replicas at once (two gateways, or a gateway retrying elsewhere). For each request
id, every replica computes from the ops it received:

* an incarnation is *dead* when a free names it or an incarnation concurrent with it (a free
  ends the request whichever replica's copy the gateway saw), when a later incarnation
  lists it or comes from the same origin with a higher number, or when a free of an id its
  replica did not hold (see below) covers it;
* of the incarnations not dead, which are pairwise concurrent, the one with the smallest
  origin is *the* request: its `/add` body, with the prefill completion and the largest output
  block count reported for it or for any incarnation concurrent with it. A losing copy is
  replaced by the winner; calls made on the losing copy count for the winner.

A `/free` of a request id the replica does not hold (a free that overtook the add replicating
from another replica, or a repeated free) is published with the replica's version vector
(`seen`): it kills every incarnation of that id from another origin that the vector does not
cover, whenever it arrives, unless that incarnation lists the free in `after` (its replica had
seen the free: a new request reusing the id).

So the state is a function of the set of ops received, and replicas that received the same
ops hold the same requests, whatever order the ops came in (tested with hypothesis in
`tests/test_slot_tracker_replication.py`).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from .ops import Tag


class Incarnation(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One add of a request id. Its body is kept (`hashes`) only while this replica may still
    have to add it: the tracker holds the hashes of the one it placed."""

    origin: int
    seq: int
    after: tuple[Tag, ...]
    worker_id: int
    dp_rank: int
    new_isl_tokens: int
    hashes: tuple[int, ...] | None = None
    freed: bool = False  # a free named it
    expected_output_tokens: int | None = None

    @property
    def tag(self) -> Tag:
        return Tag(self.origin, self.seq)


class UnknownFree(msgspec.Struct, array_like=True, frozen=True, gc=False):
    origin: int
    seq: int
    seen: tuple[Tag, ...]


class Progress(msgspec.Struct, array_like=True, frozen=True, gc=False):
    target: Tag
    prefill: bool
    output_blocks: int


class History(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Every op received for one request id. Immutable (replaced on each op), so a state
    transfer can encode a copy in a thread while the event loop goes on; and untracked by the
    garbage collector down to its common case, one incarnation: see `Tag`."""

    touched: float  # the tracker clock at its last op; forgotten a request TTL later
    first: Incarnation | None = None
    others: tuple[Incarnation, ...] = ()  # more adds of the same id: a conflict, or a reuse
    freed: tuple[Tag, ...] = ()  # frees naming an incarnation not received here (yet)
    unknown_frees: tuple[UnknownFree, ...] = ()
    progress: tuple[Progress, ...] = ()  # one per target
    placed: Tag | None = None  # the incarnation this replica's tracker holds (or held until expiry)


def incarnations(history: History) -> tuple[Incarnation, ...]:
    first = history.first
    if first is None:
        return history.others
    return (first, *history.others) if history.others else (first,)


def with_incarnation(history: History, incarnation: Incarnation) -> History:
    tag = incarnation.tag
    if tag in history.freed:  # its free came first
        incarnation = msgspec.structs.replace(incarnation, freed=True)
        history = msgspec.structs.replace(history, freed=tuple(t for t in history.freed if t != tag))
    if history.first is None:
        return msgspec.structs.replace(history, first=incarnation)
    return msgspec.structs.replace(history, others=history.others + (incarnation,))


def _replaced(history: History, old: Incarnation, new: Incarnation) -> History:
    if history.first is old:
        return msgspec.structs.replace(history, first=new)
    return msgspec.structs.replace(history, others=tuple(new if other is old else other for other in history.others))


def with_free(history: History, target: Tag) -> History:
    """`history` with a free naming `target`."""
    known = find(incarnations(history), target)
    if known is None:
        return msgspec.structs.replace(history, freed=history.freed + (target,))
    if known.freed:
        return history
    return _replaced(history, known, msgspec.structs.replace(known, freed=True))


def concurrent(a: Incarnation, b: Incarnation) -> bool:
    return a.origin != b.origin and b.tag not in a.after and a.tag not in b.after


def find(candidates: Iterable[Incarnation], tag: Tag) -> Incarnation | None:
    for incarnation in candidates:
        if incarnation.origin == tag.origin and incarnation.seq == tag.seq:
            return incarnation
    return None


def _seen(pairs: tuple[Tag, ...], origin: int) -> int:
    for pair in pairs:
        if pair.origin == origin:
            return pair.seq
    return 0


def dead(incarnation: Incarnation, history: History) -> bool:
    """Whether the ops in `history` end `incarnation` (see the module docstring)."""
    tag = incarnation.tag
    candidates = incarnations(history)
    for other in candidates:
        if other is not incarnation and (
            (other.origin == incarnation.origin and other.seq > incarnation.seq) or tag in other.after
        ):
            return True
    return freed(incarnation, history)


def freed(incarnation: Incarnation, history: History) -> bool:
    """Whether a free in `history` ends `incarnation`."""
    if incarnation.freed or incarnation.tag in history.freed:
        return True
    for other in incarnations(history):
        if other.freed and concurrent(other, incarnation):
            return True
    for free in history.unknown_frees:
        if (free.origin != incarnation.origin and Tag(free.origin, free.seq) not in incarnation.after
                and incarnation.seq > _seen(free.seen, incarnation.origin)):
            return True
    return False


def winner(history: History) -> Incarnation | None:
    """The incarnation that is the request, or None when every one is dead."""
    best = None
    for incarnation in incarnations(history):
        if (best is None or incarnation.origin < best.origin) and not dead(incarnation, history):
            best = incarnation
    return best


def progress_of(incarnation: Incarnation, history: History) -> tuple[bool, int]:
    """(prefill completed, output blocks) reported for `incarnation` or its concurrent copies."""
    tags = {incarnation.tag}
    tags.update(other.tag for other in incarnations(history) if concurrent(other, incarnation))
    prefill, output_blocks = False, 0
    for progress in history.progress:
        if progress.target in tags:
            prefill = prefill or progress.prefill
            output_blocks = max(output_blocks, progress.output_blocks)
    return prefill, output_blocks


def referenced(history: History) -> tuple[Tag, ...]:
    """Every tag a history names: a new add of its request id comes after all of them."""
    tags = dict.fromkeys(incarnation.tag for incarnation in incarnations(history))
    tags.update(dict.fromkeys(history.freed))
    tags.update(dict.fromkeys(Tag(free.origin, free.seq) for free in history.unknown_frees))
    tags.update(dict.fromkeys(progress.target for progress in history.progress))
    return tuple(tags)


def with_progress(
    progress: tuple[Progress, ...], target: Tag, prefill: bool, output_blocks: int
) -> tuple[Progress, ...]:
    for index, known in enumerate(progress):
        if known.target == target:
            merged = Progress(target, known.prefill or prefill, max(known.output_blocks, output_blocks))
            return progress[:index] + (merged,) + progress[index + 1:]
    return progress + (Progress(target, prefill, output_blocks),)



def tombstone(history: History) -> History:
    """`history` without what no longer matters for the incarnations a free names: their progress
    (it counts only for them and the copies concurrent with them, which that free ends too) and
    their placement. A request id remembered after its free costs less."""
    if not history.progress and history.placed is None:
        return history
    targets = {incarnation.tag for incarnation in incarnations(history) if incarnation.freed}
    targets.update(history.freed)
    if not targets:
        return history
    progress = tuple(progress for progress in history.progress if progress.target not in targets)
    placed = None if history.placed in targets else history.placed
    return msgspec.structs.replace(history, progress=progress, placed=placed)


def keep_body(history: History, tag: Tag, hashes: tuple[int, ...] | None) -> History:
    """`history` with the body of incarnation `tag` kept (`hashes`) or dropped (None): a copy
    that lost may win again (the one that beat it superseded), the placed one is in the tracker."""
    incarnation = find(incarnations(history), tag)
    if incarnation is None:
        return history
    if hashes is not None and dead(incarnation, history):
        hashes = None  # it can never come back
    if incarnation.hashes is hashes:
        return history
    return _replaced(history, incarnation, msgspec.structs.replace(incarnation, hashes=hashes))
