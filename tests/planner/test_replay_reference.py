"""The replay (real trie, policy and store on byte sizes) agrees exactly with a brute-force reference.

The reference below is written from the planner's stated semantics alone: a cache of whole
prefixes (tuples of block ids), scanned in full at every step. A request reuses its longest
run of live leading blocks (up to its match limit); expired prefixes go first; a tenant over
its quota evicts its own least recently used leaf, then the budget evicts the least recently
used leaf overall; prefixes the request is storing, and pinned ones, never go; every prefix
on the request's path is refreshed with the TTL. Pins are stored first, with no TTL.
"""
from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.planner.replay import Scenario, replay
from prefixcache.planner.trace import Trace

BLOCK_TOKENS, BPT = 4, 10
BLOCK = BLOCK_TOKENS * BPT


class Reference:
    def __init__(self, budget_blocks: int | None, quota_blocks: int | None, ttl: float | None):
        self.cap, self.quota, self.ttl = budget_blocks, quota_blocks, ttl
        self.entries: dict[tuple, dict] = {}  # (tenant, *ids) -> {"last", "deadline", "pinned"}
        self.evicted = {"lru": 0, "quota": 0, "ttl": 0}

    def live(self, key, now):
        e = self.entries.get(key)
        return e is not None and e["deadline"] > now

    def expire(self, now, held=frozenset()):
        for key in [k for k, e in self.entries.items() if e["deadline"] <= now and k not in held]:
            del self.entries[key]
            self.evicted["ttl"] += 1

    def leaves(self, held, tenant=None):
        keys = set(self.entries)
        parents = {k[:-1] for k in keys}
        return [k for k in keys if k not in parents and k not in held and not self.entries[k]["pinned"]
                and (tenant is None or k[0] == tenant)]

    def evict_one(self, held, reason, tenant=None):
        cands = self.leaves(held, tenant)
        if not cands:
            return False
        del self.entries[min(cands, key=lambda k: self.entries[k]["last"])]
        self.evicted[reason] += 1
        return True

    def request(self, tenant, chain, limit, now, ttl, pin=False):
        keys = [(tenant, *chain[: j + 1]) for j in range(len(chain))]
        walked = 0
        while walked < len(keys) and self.live(keys[walked], now):
            walked += 1
        held = set(keys[:walked])
        stored = walked
        for key in keys[walked:]:
            if (self.cap is not None and self.cap < 1) or (self.quota is not None and self.quota < 1):
                break
            self.expire(now, held)
            ok = True
            if self.quota is not None:
                while ok and sum(1 for k in self.entries if k[0] == tenant) + 1 > self.quota:
                    ok = self.evict_one(held, "quota", tenant)
            while ok and self.cap is not None and len(self.entries) + 1 > self.cap:
                ok = self.evict_one(held, "lru")
            if not ok:
                break
            self.entries[key] = {"last": now, "deadline": -math.inf, "pinned": False}
            held.add(key)
            stored += 1
        until = math.inf if ttl is None else now + ttl
        for key in keys[:stored]:
            e = self.entries[key]
            e["last"] = now
            e["deadline"] = until if e["deadline"] <= now else max(e["deadline"], until)
            if pin and stored == len(keys):
                e["pinned"] = True
        return min(walked, limit)


@st.composite
def traces(draw):
    n = draw(st.integers(1, 24))
    chains: list[list[int]] = []
    fresh = iter(range(1000, 10_000))
    trace = Trace(BLOCK_TOKENS, BPT)
    index: dict[str, int] = {}
    t = draw(st.sampled_from([0.0, 1000.0]))
    for _ in range(n):
        if chains and draw(st.booleans()):
            base = draw(st.sampled_from(chains))
            chain = base[: draw(st.integers(0, len(base)))] + [next(fresh) for _ in range(draw(st.integers(0, 3)))]
        else:
            chain = draw(st.lists(st.integers(0, 2), max_size=6))
        chains.append(chain)
        prompt = draw(st.integers(1, (len(chain) + 1) * BLOCK_TOKENS))
        limit = min(len(chain), (prompt - 1) // BLOCK_TOKENS)
        t += draw(st.sampled_from([0.5, 1.0, 3.0, 20.0, 90.0]))
        trace.add(t, draw(st.sampled_from(["a", "b"])), prompt, -1, chain, limit, index)
    return trace


@settings(max_examples=120, deadline=None)
@given(trace=traces(), budget=st.one_of(st.none(), st.integers(1, 12)), ttl=st.sampled_from([None, 2.0, 10.0, 60.0]),
       quota=st.one_of(st.none(), st.integers(1, 8)), pin=st.lists(st.integers(0, 2), max_size=3))
def test_replay_matches_the_brute_force_reference(trace, budget, ttl, quota, pin):
    pins = (("a", tuple(pin)),) if pin else ()
    sc = Scenario(None if budget is None else budget * BLOCK, ttl, BPT,
                  tenant_quota_bytes=None if quota is None else quota * BLOCK, pins=pins, sweep_interval_seconds=None)
    got = replay(trace, sc)

    ref = Reference(budget, quota, ttl)
    t0 = trace.ts[0]
    for tenant, ids in pins:
        ref.request(tenant, list(ids), 0, t0, None, pin=True)
    cached = hits = 0
    for i in range(len(trace)):
        now = trace.ts[i]
        ref.expire(now)
        hit = ref.request(trace.tenants[trace.tenant[i]], list(trace.chain(i)), trace.match_blocks[i], now, ttl)
        cached += hit * BLOCK_TOKENS
        hits += hit > 0
    ref.expire(trace.ts[len(trace) - 1])

    assert (got.cached_tokens, got.hit_requests) == (cached, hits)
    assert {r: got.evictions[r] for r in ("lru", "quota", "ttl")} == ref.evicted
    assert got.prompt_tokens == sum(trace.prompt_tokens)
