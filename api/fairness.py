"""Fairness between tenants at the proxy's door: request-rate limits and a round-robin queue.

Both are pure bookkeeping (no threads, no I/O; the clock is passed in), used by ``Serving``
and the routes:

- ``RateLimiter``: a token bucket per tenant key (``tenant_rate_limit`` requests a second,
  ``tenant_rate_burst`` at once). A request over it is refused before its body is read, with
  the seconds until the bucket holds a token again as its Retry-After. The same bucket, fed
  only by a key's refused requests (``tenant_invalid_rate``, ``tenant_invalid_burst``), slows a
  key that keeps sending bad input (``InvalidBudget``): while it is empty, each request of that
  key waits for a token before its body is read (up to ``tenant_invalid_hold_seconds``), or is
  refused.
- ``FairQueue``: the requests admitted and waiting for a worker, one queue per tenant, served
  in turn (round robin), the tenant with the fewest requests running first: however many
  requests one tenant has queued or running, another tenant's next request does not wait
  behind them.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated: float


class RateLimiter:
    """A token bucket per tenant: ``rate`` tokens a second, at most ``burst`` held; a request takes one.

    ``rate`` None: no limit. Buckets exist only for tenants that made requests (tenants come
    from the configured keys only, so their number is bounded).
    """

    def __init__(self, rate: float | None, burst: int, clock: Callable[[], float]):
        if rate is not None and rate <= 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        if burst < 1:
            raise ValueError(f"burst must be >= 1, got {burst}")
        self.rate, self.burst, self._clock = rate, burst, clock
        self._buckets: dict[str, _Bucket] = {}

    def take(self, tenant: str) -> float:
        """Take one token of ``tenant``'s bucket. Returns 0.0 if it had one, else the seconds until it
        will (nothing is taken then)."""
        wait = self.wait(tenant)
        if self.rate is not None and wait == 0.0:
            self._buckets[tenant].tokens -= 1.0
        return wait

    def give_back(self, tenant: str) -> None:
        """Return a token taken from ``tenant``'s bucket (never above the burst)."""
        bucket = self._buckets.get(tenant)
        if bucket is not None:
            bucket.tokens = min(float(self.burst), bucket.tokens + 1.0)

    def wait(self, tenant: str) -> float:
        """Seconds until ``tenant``'s bucket holds a token (0.0: it holds one now); takes nothing."""
        if self.rate is None:
            return 0.0
        now = self._clock()
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = _Bucket(float(self.burst), now)
        bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.updated) * self.rate)
        bucket.updated = now
        return 0.0 if bucket.tokens >= 1.0 else (1.0 - bucket.tokens) / self.rate


class InvalidBudget:
    """How many refused requests (400, 404, 408, 413) a tenant key may cause: a ``RateLimiter`` that only they
    draw from. While a key's budget is empty its requests wait for a token (``hold``), then go on
    holding it (``take``): a valid one gives it back, a refused one has spent it (``settle``).

    ``held`` counts the requests waiting per key; at most ``max_held`` wait at once (more are
    refused at once), so waiting costs a bounded number of idle connections per key.
    """

    def __init__(self, rate: float | None, burst: int, hold_seconds: float, clock: Callable[[], float],
                 max_held: int = 8):
        self.bucket = RateLimiter(rate, burst, clock)
        self.hold_seconds, self.max_held = hold_seconds, max_held
        self.held: dict[str, int] = {}

    def charge(self, tenant: str) -> None:
        """``tenant`` caused a refused request: it takes a token (or the bucket stays empty)."""
        self.bucket.take(tenant)

    def hold(self, tenant: str) -> tuple[float, float]:
        """(seconds to hold ``tenant``'s request, seconds until its budget holds a token again); (0.0, 0.0)
        if the key may send now."""
        wait = self.bucket.wait(tenant)
        if wait == 0.0 or self.held.get(tenant, 0) >= self.max_held:
            return 0.0, wait
        return min(wait, self.hold_seconds), wait

    def take(self, tenant: str) -> float:
        """After a hold: take the token that came back (0.0), or the seconds still to wait (nothing taken)."""
        return self.bucket.take(tenant)

    def settle(self, tenant: str, took: bool, refused: bool) -> None:
        """After ``tenant``'s request: a refused one spends a token (the one it ``took``, or one now); one that
        took a token and was not refused gives it back."""
        if refused and not took:
            self.charge(tenant)
        elif took and not refused:
            self.bucket.give_back(tenant)


def retry_after_seconds(wait: float) -> int:
    """A Retry-After header's whole seconds for a wait of ``wait`` seconds (at least 1)."""
    return max(1, math.ceil(wait))


class FairQueue(Generic[T]):
    """Items waiting per tenant, popped in turn: the tenant served longest ago (or never) that has an
    item goes next, and its oldest item. Not thread-safe: the caller holds its own lock.

    Turns are remembered when a tenant's queue empties: a tenant just served that queues again
    still goes after one that has waited. (One entry per tenant ever seen: tenants come from the
    configured keys.)
    """

    def __init__(self) -> None:
        self._queues: dict[str, deque[T]] = {}  # insertion order breaks ties between tenants never served
        self._served: dict[str, int] = {}  # tenant -> the pop that last served it
        self._pops = 0

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def push(self, tenant: str, item: T) -> None:
        """Queue ``item`` for ``tenant``."""
        self._queues.setdefault(tenant, deque()).append(item)

    def pop(self, load: Callable[[str], int] | None = None) -> tuple[str, T]:
        """The next (tenant, item). With ``load`` (a tenant's jobs already running), the tenant with the
        least load goes first, in turn among equals. Raises ``IndexError`` if empty."""
        if not self._queues:
            raise IndexError("pop from an empty FairQueue")
        tenant = min(self._queues, key=lambda t: (load(t) if load else 0, self._served.get(t, -1)))
        queue = self._queues[tenant]
        item = queue.popleft()
        if not queue:
            del self._queues[tenant]
        self._pops += 1
        self._served[tenant] = self._pops
        return tenant, item

    def remove(self, tenant: str, item: T) -> bool:
        """Take ``item`` out of ``tenant``'s queue (its turn is kept); whether it was there."""
        queue = self._queues.get(tenant)
        if queue is None or item not in queue:
            return False
        queue.remove(item)
        if not queue:
            del self._queues[tenant]
        return True

    def drain(self) -> Iterator[tuple[str, T]]:
        """Pop everything, in turn order."""
        while self._queues:
            yield self.pop()

    def waiting(self, tenant: str) -> int:
        queue = self._queues.get(tenant)
        return 0 if queue is None else len(queue)
