"""Admission: the worker threads behind a bounded queue, shared fairly between tenant keys.

At most ``capacity`` jobs are admitted at once (more: 429 ``queue_full``), and at most
``tenant_capacity`` of one tenant key (more: 429 ``tenant_busy``; the admin key and local
mode are exempt). An admitted job waits in its tenant's queue; whenever a worker is free it
takes the next job of the tenant with the fewest jobs running (in turn among equals:
``FairQueue``), so a tenant with a long backlog never holds back another tenant's next request.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from .errors import QueueFullError, TenantBusyError, UnavailableError
from .fairness import FairQueue

T = TypeVar("T")


class Skipped(Exception):
    """A job cancelled while it waited in the queue; it never ran."""


class Admission:
    """``workers`` threads and the admitted jobs waiting for them; thread-safe.

    ``on_start(seconds)`` is told how long each job waited for its worker.
    """

    def __init__(self, workers: int, capacity: int, tenant_capacity: int, exempt: Iterable[str],
                 on_start: Callable[[float], None], clock: Callable[[], float] = time.perf_counter):
        self.capacity, self.tenant_capacity = capacity, tenant_capacity
        self._exempt, self._on_start, self._clock = frozenset(exempt), on_start, clock
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="prefixcache-worker")
        self._lock = threading.Lock()
        self._admitted = 0  # waiting + running
        self._running = 0
        self._per_tenant: Counter[str] = Counter()  # waiting + running, of tenants that are not exempt
        self._running_per: Counter[str] = Counter()  # running, of every tenant
        self._waiting: FairQueue[Callable[[], None]] = FairQueue()  # admitted jobs no worker has taken yet
        self._active: set[threading.Event] = set()  # cancel events of admitted jobs not finished
        self.closing = False

    def counts(self) -> tuple[int, int]:
        """(running, waiting)."""
        with self._lock:
            return self._running, self._admitted - self._running

    def in_flight(self, tenant: str) -> int:
        """Jobs of ``tenant`` admitted and not finished (0 for an exempt tenant)."""
        with self._lock:
            return self._per_tenant[tenant]

    @property
    def ready(self) -> bool:
        with self._lock:
            return not self.closing and self._admitted < self.capacity

    def check(self, tenant: str) -> None:
        """Raise what ``submit`` would raise for ``tenant`` now (503 closing, 429 queue full or the
        tenant's places taken), so a request bound to be refused can be refused before its body is read."""
        with self._lock:
            self._check(tenant, tenant in self._exempt)

    def submit(self, work: Callable[[threading.Event], T], tenant: str,
               exempt: bool = False) -> tuple[Future[T], threading.Event]:
        """Admit ``work(cancel)`` into ``tenant``'s queue (``exempt``: not counted against the tenant's
        places). Returns its future and its cancel event: set while it waits, the job never runs
        (``Skipped``); set while it runs, the work is expected to stop. Raises 503 closing, 429 full."""
        exempt = exempt or tenant in self._exempt
        cancel, result, enqueued = threading.Event(), Future(), self._clock()

        def job() -> None:
            """Run by a worker when this job's turn comes (or at shutdown, to refuse it); counted running."""
            try:
                if self.closing:
                    raise UnavailableError("the server is shutting down", code="shutting_down")
                if cancel.is_set() or not result.set_running_or_notify_cancel():
                    raise Skipped()
                self._on_start(self._clock() - enqueued)
                result.set_result(work(cancel))
            except BaseException as exc:  # noqa: BLE001 - the caller's future carries it
                if not result.done():
                    result.set_exception(exc)
            finally:
                with self._lock:
                    self._running -= 1
                    self._running_per[tenant] -= 1
                    self._admitted -= 1
                    self._active.discard(cancel)
                    if not exempt:
                        self._per_tenant[tenant] -= 1
                        if not self._per_tenant[tenant]:
                            del self._per_tenant[tenant]

        with self._lock:
            self._check(tenant, exempt)
            try:  # the worker's turn first: it waits for this lock, so it finds the job queued below
                self._pool.submit(self._next)
            except RuntimeError as exc:  # the pool was shut down
                raise UnavailableError("the server is shutting down", code="shutting_down") from exc
            if not exempt:
                self._per_tenant[tenant] += 1
            self._admitted += 1
            self._waiting.push(tenant, job)
            self._active.add(cancel)
        return result, cancel

    def close(self) -> None:
        """Refuse new work and cancel every admitted job (running ones stop at their next check)."""
        with self._lock:
            self.closing = True
            active = list(self._active)
        for cancel in active:
            cancel.set()

    def shutdown(self) -> None:
        """After ``close``: wait for the workers to stop; jobs still queued are refused (503)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        while self._next():
            pass

    def _check(self, tenant: str, exempt: bool) -> None:
        if self.closing:
            raise UnavailableError("the server is shutting down", code="shutting_down")
        if self._admitted >= self.capacity:
            # Not how many requests are admitted: that is every tenant's load, shown to the admin only.
            raise QueueFullError(f"the server is busy: all {self.capacity} places of its queue are taken; "
                                 "retry shortly")
        if not exempt and self._per_tenant[tenant] >= self.tenant_capacity:
            raise TenantBusyError(f"this API key has {self.tenant_capacity} requests in flight, as many as one "
                                  "key may; retry when one has finished")

    def _next(self) -> bool:
        """A worker's turn (one is submitted per job admitted): run the job of the tenants' turn.
        Whether there was one (none: shutdown took it)."""
        with self._lock:
            if not self._waiting:
                return False
            tenant, job = self._waiting.pop(self._running_per.__getitem__)  # the least served tenant first
            self._running += 1
            self._running_per[tenant] += 1
        job()
        return True
