"""Two ``prefixcache serve`` replicas behind a real ``sglang-router``: every process started here, on loopback.

``shared_tier`` is the seam for a tier the replicas share: each parameter starts what
the tier needs and yields the flags every replica gets ("none": each replica keeps its
own cache only). Tests run in file order; the last one kills a replica.
"""
from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from prefixcache.admin import FanOut
from prefixcache.bench.fleet import ADMIN_KEY, fleet, healthy, tiny_model_folder, wait_for
from prefixcache.bench.replicas import MODEL_NAME, compare, group_keys, send, workload
from prefixcache.cli import main

ROOT = Path(__file__).resolve().parents[2]
GROUPS, QUESTIONS = 4, 5


@pytest.fixture(scope="module", params=["none"])
def shared_tier(request) -> Iterator[tuple[str, ...]]:
    """The flags of the tier every replica shares, its processes running while the fleet does."""
    yield ()


@pytest.fixture(scope="module")
def replicas(shared_tier, tokenizer):
    with tiny_model_folder(tokenizer) as folder, fleet(
            folder, group_keys(GROUPS), 2, replica_args=("--served-model-name", MODEL_NAME, *shared_tier)
    ) as running:
        yield running


@pytest.fixture(scope="module")
def runs(replicas):
    """One replica alone, then the router with each policy, on the same workload from flushed caches."""
    results = {r.name: r for r in compare(replicas, workload(GROUPS, QUESTIONS, system_repeat=16))}
    for r in results.values():
        print(f"\n{r.name}: token hit rate {r.token_hit_rate:.3f}, mean TTFT {r.mean_ttft * 1000:.1f} ms, "
              f"requests per replica {r.per_replica}, groups split {r.split_groups}")
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


def test_round_robin_splits_groups_and_misses_on_each_replica(runs):
    rr, aware = runs["router: round_robin"], runs["router: cache_aware"]
    assert sum(rr.per_replica) == GROUPS * QUESTIONS and abs(rr.per_replica[0] - rr.per_replica[1]) <= GROUPS
    assert rr.split_groups  # which groups depends on the clients' interleaving
    # Without a shared tier each group's first request on each replica is a miss.
    assert rr.token_hit_rate < aware.token_hit_rate


def test_admin_fans_out_to_every_replica_and_aggregates(replicas, capsys):
    urls = ",".join(replicas.urls)
    assert main(["admin", "--replicas", urls, "--admin-key", ADMIN_KEY, "flush"]) == 0
    capsys.readouterr()
    prompt = "A long shared preamble about parcels and ports. " * 20
    assert main(["admin", "--replicas", urls, "--admin-key", ADMIN_KEY, "--tenant", "group-0", "prewarm",
                 "--prompt", prompt, "--pin"]) == 0
    import json

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


def test_a_killed_replica_fails_only_its_requests_in_flight(replicas):
    """Long answers in flight on both replicas; one replica is killed; the router's health checks take it out.

    What fails: the requests in flight on it, and those the router sent it before its health
    checks noticed (they fail at once, with the router's error); each succeeds when retried.
    """
    router = replicas.router("cache_aware")
    calls = workload(GROUPS, 3, max_tokens=400, system_repeat=16)
    for call in calls:
        call.body["ignore_eos"] = True  # long answers: requests are in flight when the replica dies
    victim = replicas.replicas[1]
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
    wait_for(lambda: all(w.get("load", 0) > 0 for w in router.workers()), 30, "both replicas to be busy", 0.02)
    in_flight = next(w["load"] for w in router.workers() if w["url"] == victim.url)
    killed_at = time.monotonic()
    replicas.kill(victim)
    wait_for(lambda: healthy(router) == [replicas.replicas[0].url], 30, "router to drop the killed replica", 0.05)
    dropped_at = time.monotonic()
    for t in threads:
        t.join()
    failed = [(c, a, started) for c, a, started in results if a.error is not None]
    assert failed, "a request in flight on the killed replica failed"
    assert sum(started < killed_at for _, _, started in failed) <= in_flight  # in flight on it, no more
    assert all(started < dropped_at for _, _, started in failed)  # none once the router took it out
    for _, answer, _ in failed:
        assert "the replica serving it was lost" in answer.error or "HTTP 5" in answer.error, answer.error
    with httpx.Client(timeout=120) as client:  # retried, every failed request succeeds on the survivor
        for call, _, _ in failed:
            retried = send(client, router.url, call, f"sk-group-{call.group}")
            assert retried.error is None and retried.text, retried.error
    # The router dashboard's queries name metrics this router exports.
    names = set(re.findall(r"\bsmg_[a-z_]+\b", (ROOT / "deploy/grafana/dashboards/router.json").read_text()))
    exported = httpx.get(router.metrics_url, timeout=10).text
    assert names and {n for n in names if f"\n{n}{{" not in exported} == set()
    print(f"\nkilled replica: {len(failed)} failed ({in_flight} in flight on it), router took it out "
          f"{dropped_at - killed_at:.1f} s after the kill; every failed request succeeded when retried")
