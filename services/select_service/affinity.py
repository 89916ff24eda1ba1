"""Session affinity (`--session-affinity-ttl-secs`): a session's requests go to the rank its
first booked request went to, for as long as it has a request in flight and `ttl_secs` after
its last one ended.

A binding is hard, as in Dynamo: a bound session's request is selected among its rank only,
however loaded that rank is, unless the rank is no longer schedulable (then the session is bound
anew). Each reservation of the session holds a lease on the binding; the idle clock starts when
the last lease is released. `/select` only reads bindings; booking creates them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dynamo_lite.base.errors import InvalidArgument

MAX_SESSION_ID_BYTES = 256
MAX_SESSIONS_PER_PARTITION = 65_536
MIN_TTL_SECS = 1.0
MAX_TTL_SECS = 31_536_000.0

Partition = tuple[str, str]
RankKey = tuple[int, int]


@dataclass(slots=True)
class Binding:
    rank: RankKey
    leases: set[str] = field(default_factory=set)  # selection ids of the session's requests in flight
    idle_until: float = 0.0  # with no lease: the binding is gone after this


def check_session_id(session_id: str) -> None:
    if len(session_id.encode()) > MAX_SESSION_ID_BYTES:
        raise InvalidArgument(f"session affinity ID must not exceed {MAX_SESSION_ID_BYTES} bytes")


class SessionAffinity:
    def __init__(self, ttl_secs: float, *, clock: Callable[[], float],
                 max_per_partition: int = MAX_SESSIONS_PER_PARTITION) -> None:
        if not MIN_TTL_SECS <= ttl_secs <= MAX_TTL_SECS:
            raise ValueError(f"session_affinity_ttl_secs must be between {MIN_TTL_SECS:g} and {MAX_TTL_SECS:g}")
        self.ttl_secs = ttl_secs
        self.clock = clock
        self.max_per_partition = max_per_partition
        self._bindings: dict[Partition, dict[str, Binding]] = {}
        self._by_lease: dict[str, tuple[Partition, str]] = {}

    def bound(self, partition: Partition, session_id: str) -> RankKey | None:
        """The rank the session is bound to, if the binding is alive."""
        sessions = self._bindings.get(partition)
        binding = sessions.get(session_id) if sessions is not None else None
        if binding is None:
            return None
        if not binding.leases and self.clock() > binding.idle_until:
            del sessions[session_id]  # type: ignore[union-attr]
            return None
        return binding.rank

    def bind(self, partition: Partition, session_id: str, rank: RankKey, selection_id: str) -> None:
        """The session's request `selection_id` was booked on `rank`: bind the session there (or
        keep it bound) and hold a lease until the request is freed. A full table binds nothing."""
        sessions = self._bindings.setdefault(partition, {})
        binding = sessions.get(session_id)
        if binding is None or binding.rank != rank:
            if binding is None and len(sessions) >= self.max_per_partition:
                self._drop_idle(sessions)
                if len(sessions) >= self.max_per_partition:
                    return  # routed without affinity, as Dynamo does with a full table
            if binding is not None:
                for lease in binding.leases:
                    self._by_lease.pop(lease, None)
            binding = sessions[session_id] = Binding(rank)
        binding.leases.add(selection_id)
        self._by_lease[selection_id] = (partition, session_id)

    def release(self, selection_id: str) -> None:
        """The request `selection_id` ended: its lease goes, and the idle clock starts with the last."""
        owner = self._by_lease.pop(selection_id, None)
        if owner is None:
            return
        partition, session_id = owner
        binding = self._bindings.get(partition, {}).get(session_id)
        if binding is not None:
            binding.leases.discard(selection_id)
            if not binding.leases:
                binding.idle_until = self.clock() + self.ttl_secs

    def invalidate(self, partition: Partition, session_id: str) -> None:
        """The bound rank cannot be scheduled any more: forget the binding (its leases too)."""
        binding = self._bindings.get(partition, {}).pop(session_id, None)
        if binding is not None:
            for lease in binding.leases:
                self._by_lease.pop(lease, None)

    def forget_ranks(self, ranks: set[RankKey]) -> None:
        for sessions in self._bindings.values():
            for session_id in [s for s, binding in sessions.items() if binding.rank in ranks]:
                for lease in sessions.pop(session_id).leases:
                    self._by_lease.pop(lease, None)

    def sweep(self) -> int:
        """Drop the bindings idle past their TTL; returns how many."""
        dropped = 0
        for sessions in self._bindings.values():
            dropped += self._drop_idle(sessions)
        return dropped

    def _drop_idle(self, sessions: dict[str, Binding]) -> int:
        now = self.clock()
        idle = [s for s, binding in sessions.items() if not binding.leases and now > binding.idle_until]
        for session_id in idle:
            del sessions[session_id]
        return len(idle)

    def __len__(self) -> int:
        return sum(map(len, self._bindings.values()))


__all__ = ["Binding", "MAX_SESSION_ID_BYTES", "SessionAffinity", "check_session_id"]
