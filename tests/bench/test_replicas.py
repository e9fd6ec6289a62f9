"""Two ``prefixcache serve`` replicas behind a real ``sglang-router``: every process started here, on loopback.

``shared_tier`` is what the replicas share below their devices, and the tests run once
per kind (the admin fan-out only on the first): "none" (each replica keeps its own cache
only) and "redis" (a real ``redis-server``, the same hash secret on both replicas,
write-through). Tests run in file order; the last one kills a replica.
"""
from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks.replicas import MODEL_NAME, Call, compare, drive, group_keys, measure, send, workload
from prefixcache.admin import FanOut
from prefixcache.cli import main
from tests.conftest import STEP_DELAY
from tests.step_hooks import replica_cli
from tests.support.fleet import ADMIN_KEY, SharedTier, fleet, healthy, shared_redis, tiny_model_folder, wait_for

ROOT = Path(__file__).resolve().parents[2]
GROUPS, QUESTIONS, SYSTEM_REPEAT = 3, 4, 16  # an odd number of groups: round-robin splits them
#: New tokens of the answers in flight when a replica is killed: with the step floor below they last
#: at least 6 s, and the kill comes as soon as the victim has one in flight.
LONG = 120
RUNS = ("one replica", "router: cache_aware", "router: round_robin")
#: Seconds each replica step takes at least. The router spreads new prefixes by load alone (with none in
#: flight, every group goes to one replica), so an answer (4 tokens: 4 steps, >= 0.2 s) must still run
#: when the next group starts (50 ms later, ``drive``'s stagger), however fast the machine.
REPLICA_STEP = 0.05


@pytest.fixture(scope="module", params=["none", "redis"])
def shared_tier(request) -> Iterator[SharedTier]:
    """What every replica shares, its processes running while the fleet does."""
    with shared_redis(request.param == "redis") as tier:
        yield tier


@pytest.fixture(scope="module")
def replicas(shared_tier, tokenizer):
    with tiny_model_folder(tokenizer) as folder, fleet(
            folder, group_keys(GROUPS), 2, replica_args=("--served-model-name", MODEL_NAME, *shared_tier.replica_args),
            replica_env=shared_tier.replica_env, cli=replica_cli(REPLICA_STEP + STEP_DELAY)) as running:
        yield running


@pytest.fixture(scope="module")
def runs(replicas, shared_tier):
    """One replica alone, then the router with each policy, on the same workload from flushed caches."""
    # settle: with the Redis tier, a group's next call waits for the tier writes of its last (they are queued,
    # never waited for by a request), so the assertions below see what write-through restores, not a race.
    results = dict(zip(RUNS, compare(replicas, workload(GROUPS, QUESTIONS, system_repeat=SYSTEM_REPEAT),
                                     tier=shared_tier, settle=True), strict=True))
    for r in results.values():
        print(f"\n{r.name}: token hit rate {r.token_hit_rate:.3f}, mean TTFT {r.mean_ttft * 1000:.1f} ms, "
              f"requests per replica {r.per_replica}, groups split {r.split_groups}, "
              f"Redis tier restores per replica {r.tier_restores}")
    return results


def test_answers_through_the_router_equal_one_replicas(runs):
    reference = runs["one replica"]
    assert all(a.error is None for r in runs.values() for a in r.answers)
    assert len(reference.answers) == GROUPS * QUESTIONS
    assert reference.per_replica == [GROUPS * QUESTIONS, 0]
    for name in ("router: cache_aware", "router: round_robin"):
        assert [(a.group, a.index, a.text) for a in runs[name].answers] == \
            [(a.group, a.index, a.text) for a in reference.answers], name


def test_cache_aware_keeps_each_group_on_one_replica_and_its_hit_rate(runs):
    aware, reference = runs["router: cache_aware"], runs["one replica"]
    assert aware.split_groups == []
    assert all(n > 0 for n in aware.per_replica), aware.per_replica  # both replicas serve
    assert sum(aware.per_replica) == GROUPS * QUESTIONS
    assert reference.token_hit_rate > 0.5
    assert aware.token_hit_rate >= 0.95 * reference.token_hit_rate, (aware.token_hit_rate, reference.token_hit_rate)


def test_round_robin_splits_groups_and_the_shared_tier_restores_the_other_replicas_misses(runs, shared_tier):
    rr, aware = runs["router: round_robin"], runs["router: cache_aware"]
    assert sum(rr.per_replica) == GROUPS * QUESTIONS and abs(rr.per_replica[0] - rr.per_replica[1]) <= GROUPS
    assert rr.split_groups  # which groups depends on the clients' interleaving
    # A group's first request on a replica other than the one it started on (its requests go one by one).
    new_to_it = sum(len(on) - 1 for on in rr.groups_on.values())
    if shared_tier.server is None:
        # Without a shared tier each of those is a miss.
        assert len(rr.late_misses) == new_to_it
        assert rr.token_hit_rate < aware.token_hit_rate
        assert rr.tier_restores is None
    else:
        # With it, each restores the prefix the other replica computed and wrote through to Redis.
        assert rr.late_misses == [], [(a.group, a.index) for a in rr.late_misses]
        assert sum(rr.tier_restores) == new_to_it, (rr.tier_restores, rr.groups_on)
        assert all(a.cached_tokens > 0 for a in rr.answers if a.index > 0)
        # Only the group's first request misses; the restored prefix is its full blocks (the partial
        # last block is recomputed), so the hit rate stays a little under cache-aware routing's.
        assert aware.token_hit_rate >= rr.token_hit_rate > 0.8 * aware.token_hit_rate


@pytest.mark.parametrize("shared_tier", ["none"], indirect=True)  # the fan-out does not depend on the tier
def test_admin_fans_out_to_every_replica_and_aggregates(replicas, capsys):
    urls = ",".join(replicas.urls)
    assert main(["admin", "--replicas", urls, "--admin-key", ADMIN_KEY, "flush"]) == 0
    capsys.readouterr()
    prompt = "A long shared preamble about parcels and ports. " * 20
    assert main(["admin", "--replicas", urls, "--admin-key", ADMIN_KEY, "--tenant", "group-0", "prewarm",
                 "--prompt", prompt, "--pin"]) == 0
    warm = json.loads(capsys.readouterr().out)
    assert warm["ok"] and set(warm["replicas"]) == set(replicas.urls)
    assert all(a["pinned"] and a["stored_tokens"] > 100 and a["tenant"] == "group-0"
               for a in warm["replicas"].values())
    with FanOut(replicas.urls, ADMIN_KEY) as fan:
        stats = fan.stats("group-0")
        assert stats["ok"] and all(s["pinned_bytes"] > 0 for s in stats["replicas"].values())
        assert stats["total"]["pinned_bytes"] == sum(s["pinned_bytes"] for s in stats["replicas"].values())
        # A request through either replica now hits the prewarmed prefix.
        for url in replicas.urls:
            body = {"model": MODEL_NAME, "prompt": prompt + "Where is parcel 7?", "max_tokens": 2}
            answer = httpx.post(url + "/v1/completions", json=body, timeout=60,
                                headers={"Authorization": "Bearer sk-group-0"}).json()
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 100, url
        after = fan.stats("group-0")["total"]
        assert after["queries"] == stats["total"]["queries"] + 2 and after["cached_tokens"] > 200
        assert 0 < after["token_hit_rate"] <= 1
        flushed = fan.flush()
        assert flushed["ok"] and flushed["total"]["freed_bytes"] > 0
        assert fan.stats()["total"]["bytes"] == 0
    # A replica that does not answer is reported, the others still served, and the exit code says so.
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    assert main(["admin", "--replicas", f"{urls},{dead}", "--admin-key", ADMIN_KEY, "stats"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and "error" in report["replicas"][dead]
    assert all("queries" in report["replicas"][u] for u in replicas.urls)
    assert main(["admin", "--replicas", urls, "--admin-key", "wrong", "stats"]) == 1
    capsys.readouterr()
    with FanOut(replicas.urls, "wrong") as fan:
        assert {a["status"] for a in fan.stats()["replicas"].values()} == {401}
    # A tenant's key passes the replicas' checks but acts on its own tenant only: an error, never "ok".
    for action in ("stats", "flush"):
        assert main(["admin", "--replicas", urls, "--admin-key", "sk-group-0", action]) == 1
        report = json.loads(capsys.readouterr().out)
        assert not report["ok"] and report["total"] is None
        assert all("not the admin key" in a["error"] for a in report["replicas"].values())
    assert main(["admin", "--replicas", urls, "--admin-key", ADMIN_KEY, "prewarm", "--messages-file",
                 "/nonexistent/messages.json"]) == 2
    assert "cannot read --messages-file" in capsys.readouterr().err


def test_a_killed_replica_fails_only_its_requests_in_flight_and_its_prefixes_survive_in_the_tier(
        replicas, shared_tier, runs):
    """Each group's first question through a cache-aware router puts each group on one replica. Then long
    answers are in flight on both replicas; one replica is killed; the router's health checks take it out.

    What fails: the requests in flight on it, and those the router sent it before its health
    checks noticed (they fail at once, with the router's error); each succeeds when retried.
    The groups only the killed replica had served then run on the survivor: with the shared
    Redis tier their prefixes are restored there (written through before the kill), without
    it their first request there is a full recompute.
    """
    reference = {(a.group, a.index): a.text for a in runs["one replica"].answers}
    questions = workload(GROUPS, QUESTIONS, system_repeat=SYSTEM_REPEAT)
    router = replicas.router("cache_aware")
    fan = FanOut(replicas.urls, ADMIN_KEY)
    base = {g: fan.stats(f"group-{g}")["replicas"] for g in range(GROUPS)}  # counters outlive flushes
    placed = measure(replicas, router.url, "before the kill", [c for c in questions if c.index == 0], shared_tier)
    assert [(a.group, a.text) for a in placed.answers] == [(g, reference[g, 0]) for g in range(GROUPS)]
    victim = replicas.replicas[1] if placed.per_replica[1] else replicas.replicas[0]
    survivor = next(r for r in replicas.replicas if r is not victim)
    dead_only = [g for g, on in placed.groups_on.items() if on == [replicas.replicas.index(victim)]]
    assert dead_only, placed.groups_on

    def on_survivor(g: int) -> dict[str, int]:
        """Group ``g``'s requests on the survivor since the flush: queries, misses, cached tokens."""
        now = fan.stats(f"group-{g}")["replicas"][survivor.url]
        return {k: now[k] - base[g][survivor.url][k] for k in ("queries", "misses", "cached_tokens")}

    if shared_tier.server is not None:  # write-through: the victim's prefixes reach Redis before the kill
        wait_for(lambda: fan.stats()["replicas"][victim.url]["tiers"]["redis"]["write_backs"] > 0, 30,
                 "killed replica's prefixes to reach Redis", 0.05)
    # Per group: a long answer (in flight when the replica dies), then two short questions.
    calls = [c for g in range(GROUPS) for c in (Call(g, 0, {**questions[g * QUESTIONS].body, "ignore_eos": True,
                                                              "max_tokens": LONG}), *questions[g * QUESTIONS + 1:][:2])]
    results, lock = [], threading.Lock()

    def group(g: int) -> None:
        time.sleep(g * 0.05)
        with httpx.Client(timeout=120) as client:
            for call in (c for c in calls if c.group == g):
                started = time.monotonic()
                answer = send(client, router.url, call, f"sk-group-{g}")
                with lock:
                    results.append((call, answer, started))

    threads = [threading.Thread(target=group, args=(g,)) for g in range(GROUPS)]
    for t in threads:
        t.start()
    wait_for(lambda: any(w.get("load", 0) > 0 for w in router.workers() if w["url"] == victim.url), 30,
             "replica to be killed to be busy", 0.02)
    survivor_before = {g: on_survivor(g) for g in dead_only}
    assert all(s["queries"] == 0 for s in survivor_before.values()), survivor_before  # only the victim had them
    restores_before = redis_restores(fan, survivor.url)
    # The victim's load read right before the kill: requests the other groups started meanwhile count too.
    sampled_at = time.monotonic()
    in_flight = next(w["load"] for w in router.workers() if w["url"] == victim.url)
    killed_at = time.monotonic()
    replicas.kill(victim)
    wait_for(lambda: healthy(router) == [survivor.url], 30, "router to drop the killed replica", 0.05)
    dropped_at = time.monotonic()
    for t in threads:
        t.join()
    failed = [(c, a, started) for c, a, started in results if a.error is not None]
    assert failed, "a request in flight on the killed replica failed"
    assert sum(started < sampled_at for _, _, started in failed) <= in_flight  # in flight on it, no more
    assert all(started < dropped_at for _, _, started in failed)  # none once the router took it out
    for _, answer, _ in failed:
        assert "the replica serving it was lost" in answer.error or "HTTP 5" in answer.error, answer.error
    # Retried (each group's in order, the groups at once), every failed request succeeds on the survivor.
    retried = drive(router.url, [c for c, _, _ in failed])
    assert all(a.error is None and a.text for a in retried), [a.error for a in retried]
    # Greedy answers, on either replica and after restores from the tier, equal one replica's.
    served = [a for c, a, _ in results if a.error is None and c.body["max_tokens"] != LONG]
    served += [a for (c, _, _), a in zip(sorted(failed, key=lambda f: (f[0].group, f[0].index)), retried,
                                         strict=True) if c.body["max_tokens"] != LONG]
    assert len(served) == 2 * GROUPS
    assert all(a.text == reference[a.group, a.index] for a in served)
    after = {g: on_survivor(g) for g in dead_only}
    restored = redis_restores(fan, survivor.url) - restores_before
    fan.close()
    assert all(s["queries"] > 0 for s in after.values()), after
    if shared_tier.server is None:  # the dead replica's prefixes died with it: one full recompute per group
        assert all(s["misses"] == 1 for s in after.values()), after
    else:  # the survivor restored them from Redis: no request of those groups missed there
        assert all(s["misses"] == 0 and s["cached_tokens"] > 0 for s in after.values()), after
        assert restored >= len(dead_only), (restored, dead_only)
    # The router dashboard's queries name metrics this router exports.
    names = set(re.findall(r"\bsmg_[a-z_]+\b", (ROOT / "deploy/grafana/dashboards/router.json").read_text()))
    exported = httpx.get(router.metrics_url, timeout=10).text
    assert names and {n for n in names if f"\n{n}{{" not in exported} == set()
    print(f"\nkilled replica ({shared_tier.name} shared): {len(failed)} failed ({in_flight} in flight on it), "
          f"router took it out {dropped_at - killed_at:.1f} s after the kill; every failed request succeeded when "
          f"retried; groups only it had served: {dead_only}, their misses on the survivor "
          f"{[after[g]['misses'] for g in dead_only]}, Redis restores there {restored}")


def redis_restores(fan: FanOut, url: str) -> int:
    return ((fan.stats()["replicas"][url].get("tiers") or {}).get("redis") or {}).get("restores", 0)
