"""Tenants take turns in the batching engine: admission into the batch and prefill chunks."""
from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache.scope import Scope
from prefixcache.serving.request import Request, SamplingParams
from prefixcache.serving.scheduler import admission_order, in_turn, plan_step

NS = ("ns",)


def _req(tenant: str, cached: int, arrival: float, prompt: int = 50, held: int = 0) -> Request:
    r = Request([1] * prompt, Scope(NS + (tenant,), tenant), SamplingParams(), arrival)
    r.lease = type("L", (), {"cached_tokens": cached, "steps": []})()
    r.private = type("P", (), {"length": held})()
    return r


def test_another_tenants_request_is_admitted_next_whatever_the_first_has_queued():
    # evil: 6 requests, earlier and on longer cached prefixes (the cache-aware order alone puts them all first)
    evil = [_req("evil", 40, float(i)) for i in range(6)]
    good = _req("good", 5, 10.0)
    order = admission_order([*evil, good], now=11.0, max_wait=60.0)
    assert order[:2] == [evil[0], good] and order[2:] == evil[1:]
    # evil already has requests in the batch: good's goes first of all
    running = [_req("evil", 40, -1.0)]
    assert admission_order([*evil, good], now=11.0, max_wait=60.0, running=running)[0] is good
    # one tenant alone keeps the cache-aware order: longest cached prefix first
    short, long_ = _req("t", 5, 1.0), _req("t", 40, 2.0)
    assert admission_order([short, long_], now=3.0, max_wait=60.0) == [long_, short]


def test_starved_requests_still_go_first_and_take_turns_too():
    old_evil = [_req("evil", 0, float(i)) for i in range(3)]
    old_good = _req("good", 0, 5.0)
    fresh = _req("good", 40, 100.0)
    order = admission_order([*old_evil, old_good, fresh], now=101.0, max_wait=30.0)
    assert order == [old_evil[0], old_good, old_evil[1], old_evil[2], fresh]


def test_prefill_chunks_take_turns_between_tenants():
    # many short prompts of one tenant do not hold back another tenant's longer one
    evil = [_req("evil", 0, float(i), prompt=100) for i in range(4)]
    good = _req("good", 0, 10.0, prompt=300)
    plan = plan_step([*evil, good], token_budget=512, prefill_chunk=128)
    assert plan == [(evil[0], 100), (evil[1], 100), (evil[2], 12), (good, 300)]  # evil alone would take 400 first
    # long prompts of one tenant: the other's question goes first; the oldest keeps its share
    evil = [_req("evil", 0, float(i), prompt=2000) for i in range(4)]
    plan = plan_step([*evil, good], token_budget=512, prefill_chunk=128)
    assert plan == [(evil[0], 212), (good, 300)]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 3), st.integers(0, 40)), min_size=1, max_size=30),
       st.lists(st.sampled_from("abc"), max_size=6))
def test_admission_order_is_a_fair_interleaving_of_each_tenants_cache_aware_order(specs, running_tenants):
    waiting = [_req(t, cached, float(i)) for i, (t, _, cached) in enumerate(specs)]
    running = [_req(t, 0, -1.0) for t in running_tenants]
    order = admission_order(waiting, now=100.0, max_wait=1000.0, running=running)
    assert sorted(map(id, order)) == sorted(map(id, waiting))
    for tenant in "abc":  # each tenant's own requests: longest cached prefix first, then arrival
        mine = [r for r in order if r.scope.tenant == tenant]
        assert mine == sorted(mine, key=lambda r: (-r.cached_len, r.arrival))
    taken = Counter(running_tenants)
    admitted: Counter[str] = Counter()
    left = Counter(r.scope.tenant for r in waiting)
    for r in order:  # whoever goes next has no more (running + admitted) than any tenant still waiting
        assert all(taken[r.scope.tenant] + admitted[r.scope.tenant] <= taken[u] + admitted[u] for u in left if left[u])
        admitted[r.scope.tenant] += 1
        left[r.scope.tenant] -= 1


def test_in_turn_keeps_one_tenants_order():
    a = [_req("a", 0, float(i)) for i in range(3)]
    assert in_turn(a) == a
    b = _req("b", 0, 9.0)
    assert in_turn([*a, b]) == [a[0], b, a[1], a[2]]
