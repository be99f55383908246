"""A fair share of Triton when the machine is full: at most ``capacity`` requests of all keys together go on to
Triton at once; beyond, a request waits, and each freed slot goes to the waiting keys in turn (round robin over
keys, first come first served within a key). A key with a long backlog therefore delays another key's request by
at most one turn, whatever the sizes of their backlogs; the per-key limits (:class:`~.limits.KeyLimiter`) still
bound how much one key can ask for.

Waiting is bounded in count (``max_waiting``, all keys: beyond, 503 at once) and in time (``max_wait_s``: 503
naming the wait). A request that gives up while waiting (its client gone) leaves the queue; one whose slot was
granted as it gave up hands the slot on. A continuation of a session already admitted (a live piece after the
sequence's start) takes its slot without waiting (:meth:`FairGate.take`): its session holds Triton-side state and
the previous piece's answer may only end when this one arrives, so making it wait behind new work could stall the
session until the wait's ceiling; such sessions are bounded on their own (the tenants' live-session shares).

Runs on the event loop's thread: no locks."""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque

from .errors import GatewayError


class FairGate:
    def __init__(self, capacity: int = 0, max_wait_s: float = 30.0, max_waiting: int | None = None):
        self.capacity = max(0, int(capacity))  # 0: no gate
        self.max_wait_s = float(max_wait_s)
        self.max_waiting = 4 * self.capacity if max_waiting is None else int(max_waiting)
        self.in_flight = 0
        self._queues: OrderedDict[str, deque[asyncio.Future]] = OrderedDict()

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def take(self, key: str) -> None:
        """A slot at once, even beyond the capacity (a continuation of an admitted session)."""
        if self.capacity:
            self.in_flight += 1

    async def acquire(self, key: str) -> None:
        """A slot for ``key``: at once while there is room and nobody waits, else after the keys ahead in turn;
        503 when too many wait or the wait passes ``max_wait_s``. :meth:`release` it when Triton has answered."""
        if not self.capacity:
            return
        if self.in_flight < self.capacity and not self._queues:
            self.in_flight += 1
            return
        if self.waiting >= self.max_waiting:
            raise GatewayError(503, f"the service is at capacity ({self.capacity} requests in flight, "
                               f"{self.max_waiting} waiting); retry later", code="at_capacity",
                               headers={"retry-after": "1"})
        granted = asyncio.get_running_loop().create_future()
        self._queues.setdefault(key, deque()).append(granted)
        try:
            await asyncio.wait_for(asyncio.shield(granted), self.max_wait_s)
        except BaseException as exc:
            if granted.done() and not granted.cancelled():
                self.release()  # granted as it gave up: hand the slot on
            else:
                granted.cancel()
                self._forget(key, granted)
            if isinstance(exc, asyncio.TimeoutError):
                raise GatewayError(503, f"the service is at capacity: no slot came free within {self.max_wait_s:g} "
                                   "s; retry later", code="at_capacity", headers={"retry-after": "1"}) from None
            raise

    def release(self) -> None:
        if not self.capacity:
            return
        self.in_flight -= 1
        while self.in_flight < self.capacity and self._queues:
            key, queue = next(iter(self._queues.items()))
            granted = queue.popleft()
            if queue:
                self._queues.move_to_end(key)  # its next request waits for the other keys' turns
            else:
                del self._queues[key]
            if not granted.done():
                granted.set_result(None)
                self.in_flight += 1

    def _forget(self, key: str, granted: asyncio.Future) -> None:
        queue = self._queues.get(key)
        if queue is None:
            return
        try:
            queue.remove(granted)
        except ValueError:
            return
        if not queue:
            del self._queues[key]
