"""Fairness between tenant keys: the rate limiter, the round-robin queue and the admission of jobs
to the worker threads (real threads, no model)."""
from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prefixcache_api.admission import Admission, Skipped
from prefixcache_api.errors import QueueFullError, TenantBusyError, UnavailableError
from prefixcache_api.fairness import FairQueue, InvalidBudget, RateLimiter, retry_after_seconds


# -- the rate limiter -------------------------------------------------------------------
def test_a_token_bucket_per_tenant_refuses_above_the_burst_and_says_when_to_retry(clock):
    limiter = RateLimiter(rate=2.0, burst=3, clock=clock)
    assert [limiter.take("evil") for _ in range(3)] == [0.0, 0.0, 0.0]  # the burst
    assert limiter.take("evil") == pytest.approx(0.5)  # one token every 0.5 s
    assert limiter.take("good") == 0.0  # another tenant's bucket is its own
    clock.advance(0.25)
    assert limiter.take("evil") == pytest.approx(0.25)  # refused requests take nothing
    clock.advance(0.25)
    assert limiter.take("evil") == 0.0 and limiter.take("evil") > 0
    clock.advance(100)  # refills up to the burst only
    assert sum(limiter.take("evil") == 0.0 for _ in range(10)) == 3
    assert retry_after_seconds(0.01) == 1 and retry_after_seconds(1.2) == 2


def test_no_rate_means_no_limit(clock):
    limiter = RateLimiter(rate=None, burst=1, clock=clock)
    assert all(limiter.take("t") == 0.0 for _ in range(1000))


def test_an_invalid_budget_is_spent_by_refusals_only_and_holds_a_bounded_number_of_requests(clock):
    budget = InvalidBudget(rate=0.5, burst=2, hold_seconds=1.0, clock=clock, max_held=2)
    assert budget.hold("evil") == (0.0, 0.0)  # asking spends nothing
    budget.charge("evil")
    assert budget.hold("evil") == (0.0, 0.0)  # one refusal left in the burst
    budget.charge("evil")
    assert budget.hold("evil") == (1.0, pytest.approx(2.0))  # empty: held 1 s, a token in 2 s
    budget.charge("evil")  # refusals while empty keep it empty
    assert budget.hold("good") == (0.0, 0.0)  # another key's budget is its own
    budget.held["evil"] = 2
    assert budget.hold("evil") == (0.0, pytest.approx(2.0))  # as many held as may be: refused at once
    budget.held["evil"] = 0
    clock.advance(1.5)
    assert budget.hold("evil") == (pytest.approx(0.5), pytest.approx(0.5))  # held no longer than the wait
    assert budget.take("evil") == pytest.approx(0.5)  # no token yet: nothing taken
    clock.advance(0.5)
    assert budget.take("evil") == 0.0  # the token that came back goes with the request ...
    assert budget.hold("evil") == (1.0, pytest.approx(2.0))  # ... so the next one waits again
    budget.settle("evil", took=True, refused=False)  # ... unless it was served
    assert budget.hold("evil") == (0.0, 0.0)
    budget.settle("evil", took=False, refused=False)  # served without waiting: nothing changes
    assert budget.hold("evil") == (0.0, 0.0)
    budget.settle("evil", took=False, refused=True)  # refused: a token spent
    assert budget.hold("evil") == (1.0, pytest.approx(2.0))
    clock.advance(2.0)
    assert budget.take("evil") == 0.0
    budget.settle("evil", took=True, refused=True)  # refused with the token it took: nothing more spent
    assert budget.hold("evil")[1] == pytest.approx(2.0)
    clock.advance(2.0)
    assert budget.hold("evil") == (0.0, 0.0)
    for _ in range(5):
        budget.settle("evil", took=True, refused=False)
    budget.charge("evil"), budget.charge("evil")
    assert budget.hold("evil")[1] > 0  # tokens given back never fill it above the burst
    assert InvalidBudget(None, 1, 1.0, clock).hold("evil") == (0.0, 0.0)  # no rate: no budget


@settings(max_examples=60, deadline=None)
@given(rate=st.floats(0.1, 50), burst=st.integers(1, 20),
       gaps=st.lists(st.floats(0, 2, allow_nan=False), min_size=1, max_size=200))
def test_a_bucket_never_admits_more_than_burst_plus_rate_times_time(rate, burst, gaps):
    now = [0.0]
    limiter = RateLimiter(rate, burst, clock=lambda: now[0])
    admitted = 0
    for gap in gaps:
        now[0] += gap
        wait = limiter.take("t")
        admitted += wait == 0.0
        assert wait >= 0.0
        assert admitted <= burst + rate * now[0] + 1e-6


# -- the round-robin queue ----------------------------------------------------------------
def test_a_tenant_with_a_backlog_holds_back_another_tenant_by_one_item():
    queue: FairQueue[str] = FairQueue()
    for i in range(5):
        queue.push("evil", f"e{i}")
    queue.push("good", "g0")
    assert [queue.pop()[1] for _ in range(3)] == ["e0", "g0", "e1"]
    queue.push("good", "g1")  # its turn comes before evil's, which was served last
    assert [item for _, item in queue.drain()] == ["g1", "e2", "e3", "e4"]
    queue.push("good", "g2")
    assert queue.pop() == ("good", "g2")  # good was served last
    for i in range(3):
        queue.push("evil", f"e{i}")
    queue.push("good", "g3")
    running = {"evil": 4, "good": 0}  # with its load known, the least loaded tenant goes first all the same
    assert [queue.pop(running.get)[1] for _ in range(2)] == ["g3", "e0"]
    assert len(queue) == 2 and queue.waiting("evil") == 2
    list(queue.drain())
    with pytest.raises(IndexError):
        queue.pop()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from("abcd"), min_size=1, max_size=60))
def test_popping_serves_tenants_in_turn_and_each_in_order(tenants):
    queue: FairQueue[int] = FairQueue()
    for i, t in enumerate(tenants):
        queue.push(t, i)
    left = Counter(tenants)
    served: Counter[str] = Counter()
    order = []
    while queue:
        tenant, item = queue.pop()
        order.append(item)
        served[tenant] += 1
        left[tenant] -= 1
        # No tenant that still waits has been served more than one item less than any other.
        assert all(served[t] <= served[u] + 1 for t in served for u in left if left[u] > 0)
    assert sorted(order) == list(range(len(tenants)))
    for t in set(tenants):  # each tenant's items in the order it queued them
        mine = [i for i in order if tenants[i] == t]
        assert mine == sorted(mine)


# -- admission to the worker threads --------------------------------------------------------
def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class Gate:
    """Work that blocks until opened, recording the order in which jobs started."""

    def __init__(self):
        self.opened, self.started, self.lock = threading.Event(), [], threading.Lock()

    def work(self, name: str):
        def run(cancel: threading.Event) -> str:
            with self.lock:
                self.started.append(name)
            assert self.opened.wait(10)
            return name
        return run


def test_another_tenants_job_runs_next_whatever_the_first_tenant_has_queued():
    gate, waits = Gate(), []
    admission = Admission(1, capacity=20, tenant_capacity=10, exempt=(), on_start=waits.append)
    try:
        first, _ = admission.submit(gate.work("e0"), "evil")
        assert wait_for(lambda: gate.started == ["e0"])
        for i in range(1, 6):  # queued behind the one worker
            admission.submit(gate.work(f"e{i}"), "evil")
        good, _ = admission.submit(gate.work("g0"), "good")
        assert admission.counts() == (1, 6) and admission.in_flight("evil") == 6
        gate.opened.set()
        assert good.result(10) == "g0" and first.result(10) == "e0"
        admission.close()
        admission.shutdown()
        assert gate.started[:2] == ["e0", "g0"]  # the worker freed: good had none running, evil one
        assert len(waits) == 7 and all(w >= 0 for w in waits)
    finally:
        gate.opened.set()
        admission.close()


def test_a_tenant_over_its_places_is_refused_before_the_queue_is_full_and_others_are_not():
    gate = Gate()
    admission = Admission(1, capacity=5, tenant_capacity=2, exempt={"admin"}, on_start=lambda s: None)
    try:
        admission.submit(gate.work("e0"), "evil")
        admission.submit(gate.work("e1"), "evil")
        with pytest.raises(TenantBusyError):
            admission.check("evil")
        with pytest.raises(TenantBusyError):
            admission.submit(gate.work("e2"), "evil")
        assert admission.in_flight("evil") == 2
        admission.check("good")
        admission.submit(gate.work("g0"), "good")
        admission.submit(gate.work("a0"), "admin")  # the admin key is exempt from the per-key places
        admission.submit(gate.work("a1"), "admin")
        with pytest.raises(QueueFullError):  # all 5 places taken: the queue is full for everyone
            admission.submit(gate.work("g1"), "good")
        gate.opened.set()
        admission.close()
        admission.shutdown()
        assert admission.counts() == (0, 0) and admission.in_flight("evil") == 0
    finally:
        gate.opened.set()
        admission.close()


def test_a_job_cancelled_while_queued_never_runs_and_shutdown_refuses_the_rest():
    gate = Gate()
    admission = Admission(1, capacity=10, tenant_capacity=10, exempt=(), on_start=lambda s: None)
    try:
        admission.submit(gate.work("a"), "t")
        skipped, cancel = admission.submit(gate.work("b"), "t")
        left, _ = admission.submit(gate.work("c"), "u")
        cancel.set()
        gate.opened.set()
        with pytest.raises(Skipped):
            skipped.result(10)
        left.result(10)
        admission.close()
        with pytest.raises(UnavailableError):
            admission.submit(gate.work("d"), "t")
        admission.shutdown()
        assert gate.started == ["a", "c"]
    finally:
        gate.opened.set()
        admission.close()


def test_a_job_cancelled_while_queued_gives_its_places_back_at_once():
    """Its client gone, a queued job holds neither a queue place nor one of its key's while the workers are
    busy: another request of the key fits again, and the job is refused (``Skipped``) without a worker."""
    gate = Gate()
    admission = Admission(1, capacity=3, tenant_capacity=2, exempt=(), on_start=lambda s: None)
    try:
        admission.submit(gate.work("a"), "t")
        assert wait_for(lambda: gate.started == ["a"])
        skipped, cancel = admission.submit(gate.work("b"), "t")
        with pytest.raises(TenantBusyError):
            admission.check("t")
        cancel.set()
        assert skipped.done() and isinstance(skipped.exception(), Skipped)
        assert admission.counts() == (1, 0) and admission.in_flight("t") == 1
        after, _ = admission.submit(gate.work("c"), "t")  # the key's place is free again
        gate.opened.set()
        assert after.result(10) == "c"
        admission.close()
        admission.shutdown()
        assert gate.started == ["a", "c"] and admission.counts() == (0, 0) and admission.in_flight("t") == 0
    finally:
        gate.opened.set()
        admission.close()
