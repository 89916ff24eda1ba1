"""The admission queue: requests held while every candidate worker is busy.

The router guide's `--router-queue-threshold`: while every worker's active prefill tokens exceed
`queue_threshold * max_num_batched_tokens`, a request is not routed but held, and released when
capacity frees up, so that it is routed with the freshest loads. Held requests leave in the
order of `--router-queue-policy`:

  fcfs  adjusted arrival `arrival - priority_jump`, earliest first (tail TTFT);
  wspt  Smith's rule, `(1 + priority_jump) / isl_tokens`, highest first (average TTFT);

ties by arrival, then by push order. `priority_jump` (seconds, >= 0) comes from the request's
`nvext.agent_hints.latency_sensitivity`.

Two layers:
  RequestQueue    pure and synchronous: no asyncio, no clock (every time is passed in). Three
                  heaps (policy order, deadline, arrival) with lazy deletion: an entry popped,
                  removed or expired is marked dead and skipped when it surfaces in another heap;
                  a heap holding more than twice the live entries is rebuilt (amortised O(1)).
                  push/pop_ready/remove are O(log n), expire O(k log n) for k expired.
  AdmissionQueue  the asyncio wrapper the picker awaits (`wait_turn`), nudges (`poke`) and tells
                  when a released request is booked (`admitted`).

Refusal reasons (the picker's `x-dynamo-lite-dropped-reason`): "queue-full", "queue-timeout",
"shutting-down".
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

REASON_FULL = "queue-full"
REASON_TIMEOUT = "queue-timeout"
REASON_SHUTDOWN = "shutting-down"


class QueuePolicy(enum.Enum):
    FCFS = "fcfs"
    WSPT = "wspt"


@dataclass
class QueuedRequest:
    request_id: str
    isl_tokens: int  # input sequence length; wspt weighs by it (0 counts as 1 token)
    arrival: float  # seconds, in the clock `now` is given in (AdmissionQueue: loop.time())
    priority_jump: float  # seconds >= 0, from latency_sensitivity
    deadline: float  # arrival + max wait; expired once now >= deadline (math.inf: never)
    payload: object = None  # opaque to the queue

    def __post_init__(self) -> None:
        if not (isinstance(self.priority_jump, (int, float)) and math.isfinite(self.priority_jump)):
            raise ValueError(f"priority_jump must be a finite number, got {self.priority_jump!r}")
        if self.priority_jump < 0:
            raise ValueError(f"priority_jump must be >= 0, got {self.priority_jump!r}")
        if self.isl_tokens < 0:
            raise ValueError(f"isl_tokens must be >= 0, got {self.isl_tokens!r}")


class _Entry:
    __slots__ = ("item", "alive")

    def __init__(self, item: QueuedRequest) -> None:
        self.item = item
        self.alive = True


def _policy_key(policy: QueuePolicy, item: QueuedRequest) -> float:
    """Smaller leaves first. Computed once per push: a queued request's priority never changes."""
    if policy is QueuePolicy.FCFS:
        return item.arrival - item.priority_jump
    return -(1.0 + item.priority_jump) / max(item.isl_tokens, 1)


_COMPACT_MIN = 64  # heaps smaller than this are never rebuilt


class RequestQueue:
    """Pure, synchronous priority queue of held requests. Request ids must be unique while queued."""

    def __init__(self, policy: QueuePolicy, max_size: int) -> None:
        if max_size < 0:
            raise ValueError(f"max_size must be >= 0, got {max_size}")
        self.policy = QueuePolicy(policy)
        self.max_size = max_size
        self._seq = 0
        self._live: dict[str, _Entry] = {}
        # (policy key, arrival, seq, entry) / (deadline, seq, entry) / (arrival, seq, entry);
        # seq is unique, so tuple comparison never reaches the entry.
        self._order: list[tuple[float, float, int, _Entry]] = []
        self._deadlines: list[tuple[float, int, _Entry]] = []
        self._arrivals: list[tuple[float, int, _Entry]] = []

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    def push(self, item: QueuedRequest) -> bool:
        """Queue `item`; False when the queue is full (refuse with "queue-full").

        Raises ValueError when a request with the same id is already queued.
        """
        if item.request_id in self._live:
            raise ValueError(f"request {item.request_id!r} is already queued")
        if len(self._live) >= self.max_size:
            return False
        entry = _Entry(item)
        seq = self._seq
        self._seq += 1
        self._live[item.request_id] = entry
        heapq.heappush(self._order, (_policy_key(self.policy, item), item.arrival, seq, entry))
        heapq.heappush(self._deadlines, (item.deadline, seq, entry))
        heapq.heappush(self._arrivals, (item.arrival, seq, entry))
        return True

    def pop_ready(self) -> QueuedRequest | None:
        """Remove and return the best queued request by policy; None when empty."""
        order = self._order
        while order:
            entry = heapq.heappop(order)[-1]
            if entry.alive:
                self._kill(entry)
                return entry.item
        return None

    def peek(self) -> QueuedRequest | None:
        """The request `pop_ready` would return, left in place."""
        order = self._order
        while order and not order[0][-1].alive:
            heapq.heappop(order)
        return order[0][-1].item if order else None

    def expire(self, now: float) -> list[QueuedRequest]:
        """Remove and return every request whose deadline has come (`deadline <= now`), earliest
        deadline first (refuse each with "queue-timeout")."""
        out: list[QueuedRequest] = []
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            entry = heapq.heappop(deadlines)[-1]
            if entry.alive:
                self._kill(entry)
                out.append(entry.item)
        return out

    def remove(self, request_id: str) -> bool:
        """Drop a queued request (its client gave up); False when it is not queued."""
        entry = self._live.get(request_id)
        if entry is None:
            return False
        self._kill(entry)
        return True

    def drain(self) -> list[QueuedRequest]:
        """Remove and return every queued request, in push order."""
        items = [entry.item for entry in self._live.values()]
        for entry in self._live.values():
            entry.alive = False
        self._live.clear()
        self._order.clear()
        self._deadlines.clear()
        self._arrivals.clear()
        return items

    def next_deadline(self) -> float | None:
        """The earliest deadline among queued requests; None when empty."""
        deadlines = self._deadlines
        while deadlines and not deadlines[0][-1].alive:
            heapq.heappop(deadlines)
        return deadlines[0][0] if deadlines else None

    def oldest_wait(self, now: float) -> float:
        """How long the earliest-arrived queued request has waited at `now` (0.0 when empty)."""
        arrivals = self._arrivals
        while arrivals and not arrivals[0][-1].alive:
            heapq.heappop(arrivals)
        return max(0.0, now - arrivals[0][0]) if arrivals else 0.0

    def _kill(self, entry: _Entry) -> None:
        entry.alive = False
        del self._live[entry.item.request_id]
        limit = max(_COMPACT_MIN, 2 * len(self._live))
        heaps: tuple[list[Any], ...] = (self._order, self._deadlines, self._arrivals)  # entries last in each
        for heap in heaps:
            if len(heap) > limit:
                heap[:] = [t for t in heap if t[-1].alive]
                heapq.heapify(heap)


class QueueRefused(Exception):
    """`wait_turn` gave up on a request: `reason` is "queue-full", "queue-timeout" or "shutting-down"."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class AdmissionQueue:
    """Asyncio wrapper around a RequestQueue. Use from the event loop's thread only.

    Times (`QueuedRequest.arrival`, `.deadline`) are in the loop's clock: use `now()`.

    `has_capacity()` is the picker's verdict from its latest view of the loads (some candidate
    worker not busy); it is asked before each release. A released request adds load only once the
    picker has routed and booked it, which may take awaits (fresh costs), so releases go one at a
    time: while a release is outstanding no other is made. It ends when
      - the caller calls `admitted(request_id)` once the released request's load is booked (or
        it gave up on routing it): the next release is considered at once, so one `poke()` with
        room for several releases them back to back, each after the previous one's booking;
      - the released waiter is cancelled before it could resume: its slot goes to the next one;
      - failing both, at the next `poke()`: each capacity event then releases at most one.
    """

    def __init__(self, core: RequestQueue, has_capacity: Callable[[], bool]) -> None:
        self._core = core
        self._has_capacity = has_capacity
        self._waiters: dict[str, asyncio.Future[None]] = {}
        self._released: tuple[str, asyncio.Future[None]] | None = None  # the outstanding release
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def depth(self) -> int:
        """Requests held now (for a gauge)."""
        return len(self._core)

    @property
    def closed(self) -> bool:
        return self._closed

    @staticmethod
    def now() -> float:
        """The clock arrivals and deadlines are measured in: the running loop's `time()`."""
        return asyncio.get_running_loop().time()

    def oldest_wait(self) -> float:
        return self._core.oldest_wait(self.now())

    async def wait_turn(self, item: QueuedRequest) -> None:
        """Return when `item` may be routed; raise QueueRefused when the queue is full, the item
        waited past its deadline, or the queue closed. Returns at once, without queueing, when
        nothing is held or outstanding and `has_capacity()`. Cancelling the caller withdraws the
        item. After a release (not after the immediate return) call `admitted(item.request_id)`."""
        if self._closed:
            raise QueueRefused(REASON_SHUTDOWN)
        loop = asyncio.get_running_loop()
        self._expire_due(loop.time())
        if not len(self._core) and self._released is None and self._has_capacity():
            return
        if item.deadline <= loop.time():
            raise QueueRefused(REASON_TIMEOUT)
        if not self._core.push(item):
            raise QueueRefused(REASON_FULL)
        rid = item.request_id
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters[rid] = fut
        try:
            self._advance()  # may release this very item (or a better one) at once
        except BaseException:
            self._withdraw(rid, fut)
            raise
        try:
            await fut
        except asyncio.CancelledError:
            if not self._withdraw(rid, fut) and self._released is not None and self._released[1] is fut:
                # Released, then cancelled before it could run: the slot goes to the next one.
                self._released = None
                self._advance()
            raise

    def admitted(self, request_id: str) -> None:
        """The released request `request_id` is booked (or abandoned): consider the next release.
        A no-op for any other id (not released, already superseded by a poke, never queued)."""
        released = self._released
        if released is None or released[0] != request_id:
            return
        self._released = None
        if not self._closed:
            self._advance()

    def poke(self) -> None:
        """Capacity may have freed (a request ended, loads refreshed): expire what is due, then
        release the best held request if `has_capacity()`. An outstanding release not yet
        `admitted` is taken as booked by now. Cheap when nothing waits."""
        if self._closed:
            return
        self._released = None
        self._advance()

    def close(self) -> None:
        """Refuse every held request with "shutting-down"; later `wait_turn` calls are refused too.
        A request already released is left to proceed."""
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for item in self._core.drain():
            fut = self._waiters.pop(item.request_id)
            if not fut.done():
                fut.set_exception(QueueRefused(REASON_SHUTDOWN))

    # -- internals -------------------------------------------------------------------------------

    def _advance(self) -> None:
        """Expire what is due; unless a release is outstanding, release the best live waiter if
        there is capacity (skipping waiters cancelled meanwhile); re-arm the deadline timer."""
        loop = asyncio.get_running_loop()
        core = self._core
        self._expire_due(loop.time())
        if self._released is None:
            while len(core) and self._has_capacity():
                item = core.pop_ready()
                assert item is not None
                fut = self._waiters.pop(item.request_id)
                if fut.done():  # its task was cancelled (withdrawal pending): skip it
                    continue
                fut.set_result(None)
                self._released = (item.request_id, fut)
                break
        self._arm_timer(loop)

    def _withdraw(self, rid: str, fut: asyncio.Future[None]) -> bool:
        """Remove a still-queued waiter; False when it had already left the queue."""
        if self._waiters.get(rid) is not fut:
            return False
        del self._waiters[rid]
        self._core.remove(rid)
        return True

    def _expire_due(self, now: float) -> None:
        for item in self._core.expire(now):
            fut = self._waiters.pop(item.request_id)
            if not fut.done():
                fut.set_exception(QueueRefused(REASON_TIMEOUT))

    def _arm_timer(self, loop: asyncio.AbstractEventLoop) -> None:
        deadline = self._core.next_deadline()
        timer = self._timer
        if deadline is None or math.isinf(deadline):
            if timer is not None:
                timer.cancel()
                self._timer = None
            return
        # A timer already due no later is kept: firing early costs one re-arm, not a reschedule
        # per push.
        if timer is not None and timer.when() <= deadline:
            return
        if timer is not None:
            timer.cancel()
        self._timer = loop.call_at(deadline, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self._closed:
            return
        loop = asyncio.get_running_loop()
        self._expire_due(loop.time())
        self._arm_timer(loop)  # the clock may read a little short of the deadline: fires again
