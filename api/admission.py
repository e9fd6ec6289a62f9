"""Admission: the worker threads behind a bounded queue, shared fairly between tenant keys.

At most ``capacity`` jobs are admitted at once (more: 429 ``queue_full``), and at most
``tenant_capacity`` of one tenant key (more: 429 ``tenant_busy``; the admin key and local
mode are exempt). An admitted job waits in its tenant's queue; whenever a worker is free it
takes the next job of the tenant with the fewest jobs running (in turn among equals:
``FairQueue``), so a tenant with a long backlog never holds back another tenant's next request.

A request takes its place (``reserve``) before its body is read, so the places bound the bodies
being read too, not only the jobs: a key cannot have more requests reading, waiting and running
than its places, however many connections it opens. The place becomes the job's (``submit``) or
is given back (``Place.release``; every path of the request does, and a second release is a no-op).

Calls beside the queue that still cost a thread (counting tokens, cache stats, a flush) run on a
few threads of their own (``run_side``), never on the event loop's default pool that parses every
tenant's bodies; a key may have ``side_capacity`` of them at once (places reserved likewise).
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
#: Seconds the workers may take to start (threads: milliseconds, unless the machine is starved).
START_TIMEOUT = 60.0
#: Threads for the calls beside the queue (count_tokens, stats, flush), and how many one key may have at once.
SIDE_WORKERS, SIDE_PER_TENANT = 4, 2


class Skipped(Exception):
    """A job cancelled while it waited in the queue; it never ran."""


def started_pool(workers: int, prefix: str) -> ThreadPoolExecutor:
    """A pool whose threads all run now, not with the first jobs: a started server holds all its threads and
    none appear under load (what the tests' thread-leak check relies on). Each start job waits for all the
    others, so the pool gives each its own thread."""
    pool = ThreadPoolExecutor(workers, thread_name_prefix=prefix)
    up = threading.Barrier(workers + 1)
    for _ in range(workers):
        pool.submit(up.wait, START_TIMEOUT)
    up.wait(START_TIMEOUT)
    return pool


class _JobCancel(threading.Event):
    """A job's cancel event: setting it also calls ``withdraw`` (which takes the job out of the queue if no
    worker has taken it yet)."""

    def __init__(self, withdraw: Callable[[], None]):
        super().__init__()
        self._withdraw = withdraw

    def set(self) -> None:
        super().set()
        self._withdraw()


class Place:
    """A request's place, reserved before its body is read: one of the queue's (``queued``), or one of the
    key's calls beside it. ``release`` gives it back unless a job took it (idempotent)."""

    __slots__ = ("_admission", "tenant", "queued", "exempt", "held")

    def __init__(self, admission: Admission, tenant: str, queued: bool, exempt: bool):
        self._admission, self.tenant, self.queued, self.exempt = admission, tenant, queued, exempt
        self.held = True  # by the request; False once a job took it or it was given back

    def release(self) -> None:
        self._admission.release(self)


class Admission:
    """``workers`` threads and the admitted jobs waiting for them; thread-safe.

    ``on_start(seconds)`` is told how long each job waited for its worker.
    """

    def __init__(self, workers: int, capacity: int, tenant_capacity: int, exempt: Iterable[str],
                 on_start: Callable[[float], None], clock: Callable[[], float] = time.perf_counter,
                 side_workers: int = SIDE_WORKERS, side_capacity: int = SIDE_PER_TENANT):
        self.capacity, self.tenant_capacity, self.side_capacity = capacity, tenant_capacity, side_capacity
        self._exempt, self._on_start, self._clock = frozenset(exempt), on_start, clock
        self._pool = started_pool(workers, "prefixcache-worker")
        self._side = started_pool(side_workers, "prefixcache-side")
        self._lock = threading.Lock()
        self._admitted = 0  # reserved + waiting + running
        self._reserved = 0  # places of requests still reading their body (no job yet)
        self._running = 0
        self._side_per: Counter[str] = Counter()  # side calls (reserved or running), of tenants that are not exempt
        self._per_tenant: Counter[str] = Counter()  # waiting + running, of tenants that are not exempt
        self._running_per: Counter[str] = Counter()  # running, of every tenant
        self._waiting: FairQueue[Callable[[], None]] = FairQueue()  # admitted jobs no worker has taken yet
        self._active: set[threading.Event] = set()  # cancel events of admitted jobs not finished
        self.closing = False

    def counts(self) -> tuple[int, int]:
        """(running, waiting): jobs, not the places of requests still reading their body."""
        with self._lock:
            return self._running, self._admitted - self._running - self._reserved

    def in_flight(self, tenant: str) -> int:
        """Places of ``tenant`` taken: requests reading their body, jobs waiting and running (0 if exempt)."""
        with self._lock:
            return self._per_tenant[tenant]

    def reserve(self, tenant: str, queued: bool = True) -> Place:
        """Take a place for a request of ``tenant`` before its body is read: a queue place (``queued``), or one
        of the key's calls beside the queue. Raises 503 closing, 429 queue full or the key's places taken."""
        exempt = tenant in self._exempt
        with self._lock:
            if queued:
                self._check(tenant, exempt)
                self._admitted += 1
                self._reserved += 1
                if not exempt:
                    self._per_tenant[tenant] += 1
            else:
                if self.closing:
                    raise UnavailableError("the server is shutting down", code="shutting_down")
                if not exempt and self._side_per[tenant] >= self.side_capacity:
                    raise TenantBusyError(f"this API key has {self.side_capacity} cache calls (stats, flush, token "
                                          "counts) in flight, as many as one key may; retry when one has finished")
                if not exempt:
                    self._side_per[tenant] += 1
        return Place(self, tenant, queued, exempt)

    def release(self, place: Place) -> None:
        """Give back a place no job took (a no-op once taken or given back)."""
        with self._lock:
            if not place.held:
                return
            place.held = False
            if place.queued:
                self._admitted -= 1
                self._reserved -= 1
                if not place.exempt:
                    _decrement(self._per_tenant, place.tenant)
            elif not place.exempt:
                _decrement(self._side_per, place.tenant)

    def run_side(self, fn: Callable[[], T], place: Place | None = None) -> Future[T]:
        """Run ``fn`` on the side threads; ``place`` (a side place, or None) is then the call's, given back
        when it ends (or is cancelled before it started). Raises 503 when shutting down."""
        owned = False
        if place is not None and not place.queued:
            with self._lock:
                owned, place.held = place.held, False

        def done(_: Future[T]) -> None:
            if owned and not place.exempt:
                with self._lock:
                    _decrement(self._side_per, place.tenant)

        try:
            future = self._side.submit(fn)
        except RuntimeError as exc:  # shut down
            done(Future())
            raise UnavailableError("the server is shutting down", code="shutting_down") from exc
        future.add_done_callback(done)
        return future

    @property
    def ready(self) -> bool:
        with self._lock:
            return not self.closing and self._admitted < self.capacity

    def check(self, tenant: str) -> None:
        """Raise what ``submit`` would raise for ``tenant`` now (503 closing, 429 queue full or the
        tenant's places taken), so a request bound to be refused can be refused before its body is read."""
        with self._lock:
            self._check(tenant, tenant in self._exempt)

    def submit(self, work: Callable[[threading.Event], T], tenant: str, exempt: bool = False,
               place: Place | None = None) -> tuple[Future[T], threading.Event]:
        """Admit ``work(cancel)`` into ``tenant``'s queue (``exempt``: not counted against the tenant's
        places), in ``place`` if it holds one of ``tenant``'s (reserved before the body was read: then not
        checked again). Returns its future and its cancel event: set while it waits, the job leaves the queue
        at once, its place given back, and never runs (``Skipped``); set while it runs, the work is expected
        to stop. Raises 503 closing, 429 full."""
        exempt = exempt or tenant in self._exempt
        if place is not None and place.queued and place.tenant == tenant:
            exempt = place.exempt  # how its place was counted
        else:
            place = None
        result, enqueued = Future(), self._clock()

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
                        _decrement(self._per_tenant, tenant)

        def withdraw() -> None:
            """``cancel`` was set: a job still queued leaves now and gives its place back (its worker's turn
            then finds the next job, or none), so a client gone while queued holds no place meanwhile."""
            with self._lock:
                if not self._waiting.remove(tenant, job):
                    return  # a worker took it (the work sees ``cancel``), or shutdown did
                self._admitted -= 1
                self._active.discard(cancel)
                if not exempt:
                    _decrement(self._per_tenant, tenant)
            if result.set_running_or_notify_cancel():
                result.set_exception(UnavailableError("the server is shutting down", code="shutting_down")
                                     if self.closing else Skipped())

        cancel = _JobCancel(withdraw)
        with self._lock:
            reserved = place is not None and place.held
            if reserved:
                if self.closing:
                    raise UnavailableError("the server is shutting down", code="shutting_down")
            else:
                self._check(tenant, exempt)
            try:  # the worker's turn first: it waits for this lock, so it finds the job queued below
                self._pool.submit(self._next)
            except RuntimeError as exc:  # the pool was shut down
                raise UnavailableError("the server is shutting down", code="shutting_down") from exc
            if reserved:  # the place (counted when it was reserved) is the job's now
                place.held = False
                self._reserved -= 1
            else:
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
        """After ``close``: wait for the workers to stop; jobs still queued are refused (503). Calls beside
        the queue already submitted finish (they are short)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        while self._next():
            pass
        self._side.shutdown(wait=True)

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


def _decrement(counts: Counter[str], tenant: str) -> None:
    counts[tenant] -= 1
    if not counts[tenant]:
        del counts[tenant]
