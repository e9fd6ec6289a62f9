"""/metrics values (not just names) after a known sequence of requests, on a server of its own."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from prefixcache_api import create_app
from prefixcache_api.errors import ClientClosedError
from prefixcache_api.serving import CUT_SHORT, SERVED, Outcome
from prometheus_client.parser import text_string_to_metric_families
from proxy_support import ADMIN, ALPHA, BETA, MODEL, live, make_cache, metric_samples, settings, wait_until

from tests.step_hooks import HOLD_LIMIT, hold_until_cancelled

SYSTEM = "Policy: refunds within 30 days, exchanges within 60, no questions asked. " * 8
NEW = 4
WORD = 28899  # " harbour": one whole word, so the first token is a text delta at once


@pytest.fixture
def fresh(tiny_model, tokenizer):
    """Counters start at zero: a cache and an app (own registry) for this test alone."""
    cache = make_cache(tiny_model, tokenizer, block_size=16)
    with live(create_app(settings(), cache=cache)) as srv:
        yield srv
    cache.close()


def value(samples, name: str, **labels: str) -> float:
    """The one sample of ``name`` with exactly ``labels`` (0 if absent, as Prometheus would treat it)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def ask(client, question: str, system: str = SYSTEM) -> dict:
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == NEW
    return usage


def test_metric_values_follow_a_known_sequence(fresh):
    per_token = fresh.cache.bytes_per_token
    with fresh.client(ALPHA) as alpha, fresh.client(BETA) as beta:
        a1, a2 = ask(alpha, "What is the refund window?"), ask(alpha, "What is the exchange window?")
        b1 = ask(beta, "What is the refund window?")
        bad = beta.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
        assert bad.status_code == 400
        pinned = beta.post("/v1/cache/prewarm", json={"prompt": "a pinned preamble " * 10, "pin": True}).json()
    m = metric_samples(fresh)
    n = "prefixcache_requests_total"
    assert a1["prompt_tokens_details"]["cached_tokens"] == 0 and b1["prompt_tokens_details"]["cached_tokens"] == 0
    assert a2["prompt_tokens_details"]["cached_tokens"] > 100  # the shared system prompt
    assert value(m, n, endpoint="chat", tenant="alpha", outcome="miss") == 1
    assert value(m, n, endpoint="chat", tenant="alpha", outcome="partial") == 1
    assert value(m, n, endpoint="chat", tenant="beta", outcome="miss") == 1
    assert sum(v for (name, _), v in m.items() if name == n) == 3  # nothing else was counted
    for tenant, calls in (("alpha", (a1, a2)), ("beta", (b1,))):
        assert value(m, "prefixcache_prompt_tokens_total", tenant=tenant) == sum(u["prompt_tokens"] for u in calls)
        assert value(m, "prefixcache_cached_tokens_total", tenant=tenant) == sum(
            u["prompt_tokens_details"]["cached_tokens"] for u in calls)
        assert value(m, "prefixcache_completion_tokens_total", tenant=tenant) == NEW * len(calls)
    assert value(m, "prefixcache_request_errors_total", route="/v1/chat/completions", status="400") == 1
    for histogram in ("time_to_first_token_seconds", "lookup_seconds"):
        assert value(m, f"prefixcache_{histogram}_count") == 3
        assert value(m, f"prefixcache_{histogram}_sum") > 0  # measured on whichever engine served them
    assert value(m, "prefixcache_time_per_output_token_seconds_count") == 3
    assert value(m, "prefixcache_request_duration_seconds_count", endpoint="chat") == 3
    prompt_total = a1["prompt_tokens"] + a2["prompt_tokens"] + b1["prompt_tokens"]
    cached_total = a2["prompt_tokens_details"]["cached_tokens"]
    assert value(m, "prefixcache_hit_ratio", basis="requests") == pytest.approx(1 / 3)
    assert value(m, "prefixcache_hit_ratio", basis="tokens") == pytest.approx(cached_total / prompt_total)
    # Bytes: exact accounting, so a tenant's single conversation is its stored tokens' KV.
    beta_bytes = (b1["prompt_tokens"] + NEW - 1 + pinned["stored_tokens"]) * per_token
    assert value(m, "prefixcache_cache_tenant_bytes", tenant="beta") == beta_bytes
    alpha_bytes = value(m, "prefixcache_cache_tenant_bytes", tenant="alpha")
    assert alpha_bytes >= (a1["prompt_tokens"] + a2["prompt_tokens"] + 2 * (NEW - 1) - cached_total) * per_token
    stats = fresh.cache.stats()
    assert value(m, "prefixcache_cache_bytes") == alpha_bytes + beta_bytes == stats["bytes"]
    assert value(m, "prefixcache_cache_entries") == stats["entries"] > 0
    assert value(m, "prefixcache_cache_pinned_bytes") == pinned["stored_tokens"] * per_token > 0
    assert value(m, "prefixcache_cache_budget_bytes") == fresh.cache.config.max_bytes
    assert value(m, "prefixcache_queue_depth") == 0 and value(m, "prefixcache_requests_running") == 0
    for reason in ("lru", "ttl", "quota", "flush"):
        assert value(m, "prefixcache_evictions_total", reason=reason) == 0
        assert value(m, "prefixcache_reclaimed_bytes_total", reason=reason) == 0

    # Flushing alpha evicts exactly its blocks and frees exactly its bytes.
    alpha_entries = fresh.cache.stats("alpha")["entries"]
    with fresh.client(ALPHA) as alpha:
        assert alpha.delete("/v1/cache").json()["freed_bytes"] == alpha_bytes
    m = metric_samples(fresh)
    assert value(m, "prefixcache_evictions_total", reason="flush") == alpha_entries > 0
    assert value(m, "prefixcache_reclaimed_bytes_total", reason="flush") == alpha_bytes
    assert value(m, "prefixcache_cache_bytes") == beta_bytes
    assert value(m, "prefixcache_cache_tenant_bytes", tenant="alpha") == 0
    assert value(m, "prefixcache_requests_total", endpoint="chat", tenant="alpha", outcome="miss") == 1  # unchanged


def test_lru_evictions_are_counted_with_their_bytes(tiny_model, tokenizer):
    """A budget of one conversation: the second tenant's request evicts the first's blocks."""
    probe = make_cache(tiny_model, tokenizer)
    per_token = probe.bytes_per_token
    probe.close()
    cache = make_cache(tiny_model, tokenizer, block_size=16, max_bytes=per_token * 200)
    with live(create_app(settings(), cache=cache)) as srv:
        with srv.client(ALPHA) as alpha, srv.client(BETA) as beta:
            first = ask(alpha, "one")
            before = cache.stats("alpha")
            assert before["bytes"] == (first["prompt_tokens"] + NEW - 1) * per_token
            ask(beta, "two")
        m = metric_samples(srv)
        after = cache.stats()
        assert after["bytes"] <= per_token * 200 and cache.stats("alpha")["bytes"] < before["bytes"]
        assert value(m, "prefixcache_evictions_total", reason="lru") == after["evictions"]["lru"] > 0
        freed = before["bytes"] - cache.stats("alpha")["bytes"]
        assert value(m, "prefixcache_reclaimed_bytes_total", reason="lru") == freed
    cache.close()


def test_hit_ratio_counts_a_generation_cut_short_as_cache_stats_do_and_says_so(fresh):
    """A miss delivered, a 400, then a stream on the same system prompt the client leaves mid-answer: the
    request counters hold the one answer; the hit ratio and /v1/cache/stats count both generations."""
    with fresh.client(ALPHA) as alpha:
        cold = ask(alpha, "What is the refund window?")
        assert alpha.post("/v1/chat/completions", json={"model": MODEL, "messages": []}).status_code == 400
    with hold_until_cancelled(fresh.cache):  # still answering when the client leaves
        stream = fresh.openai(ALPHA).chat.completions.create(
            model=MODEL, max_tokens=1500, stream=True, logit_bias={str(WORD): 100},
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell a long story."}])
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break
        stream.close()
        wait_until(lambda: value(metric_samples(fresh), "prefixcache_request_errors_total",
                                 route="/v1/chat/completions", status="499") == 1, timeout=10)
    with fresh.client(ADMIN) as admin:
        stats = admin.get("/v1/cache/stats", params={"tenant": "alpha"}).json()
        text = admin.get("/metrics").text
    m = metric_samples(fresh)
    served = {k: v for k, v in m.items() if k[0] == "prefixcache_requests_total"}
    assert served == {("prefixcache_requests_total", (("endpoint", "chat"), ("outcome", "miss"),
                                                      ("tenant", "alpha"))): 1}
    assert value(m, "prefixcache_prompt_tokens_total", tenant="alpha") == cold["prompt_tokens"]
    # The engine counted the cut-short generation too: a partial hit on the system prompt.
    assert (stats["queries"], stats["misses"], stats["hits"] + stats["partial_hits"]) == (2, 1, 1)
    assert stats["prompt_tokens"] > cold["prompt_tokens"] and stats["cached_tokens"] > 100
    assert value(m, "prefixcache_hit_ratio", basis="requests") == stats["hit_rate"] == 0.5
    assert value(m, "prefixcache_hit_ratio", basis="tokens") == pytest.approx(stats["token_hit_rate"])
    assert value(m, "prefixcache_time_to_first_token_seconds_count") == 1  # the answer delivered
    assert value(m, "prefixcache_request_duration_seconds_count", endpoint="chat") == 2  # both timed
    # What the exposition says the ratio counts is what it counts.
    (ratio,) = [f for f in text_string_to_metric_families(text) if f.name == "prefixcache_hit_ratio"]
    assert "cut short included" in ratio.documentation and "/v1/cache/stats" in ratio.documentation


def test_outcomes_are_counted_as_the_help_defines_them(fresh):
    """A cold prompt is a miss, its exact repeat a hit (all of it but the last token read from the cache),
    another question after the same system prompt a partial hit; the counter's help says which is which."""
    with fresh.client(ALPHA) as alpha:
        cold, repeat = ask(alpha, "What is the refund window?"), ask(alpha, "What is the refund window?")
        other = ask(alpha, "What is the exchange window?")
    assert cold["prompt_tokens_details"]["cached_tokens"] == 0
    assert repeat["prompt_tokens_details"]["cached_tokens"] == repeat["prompt_tokens"] - 1
    assert 0 < other["prompt_tokens_details"]["cached_tokens"] < other["prompt_tokens"] - 1
    m = metric_samples(fresh)
    for outcome in ("miss", "hit", "partial"):
        assert value(m, "prefixcache_requests_total", endpoint="chat", tenant="alpha", outcome=outcome) == 1
    with fresh.client(ADMIN) as admin:
        families = {f.name: f for f in text_string_to_metric_families(admin.get("/metrics").text)}
    help_text = families["prefixcache_requests"].documentation
    assert "hit (the whole prompt but at most its last token came from the cache)" in help_text
    assert "partial (some of it did)" in help_text and "miss (none did)" in help_text


def test_a_partial_hit_on_the_template_opening_alone_counts_in_requests_not_in_hits(fresh):
    """Unrelated prompts share only the chat template's opening: the second reads just that from the cache, a
    partial hit the requests basis counts, as its help says; the hits basis counts the exact repeat alone."""
    weather = "Weather desk: forecasts for the coast, updated hourly. " * 8
    with fresh.client(ALPHA) as alpha:
        first = ask(alpha, "What is the refund window?")
        other = ask(alpha, "Will it rain tomorrow?", system=weather)
        repeat = ask(alpha, "Will it rain tomorrow?", system=weather)
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert 0 < other["prompt_tokens_details"]["cached_tokens"] < 8  # the template's opening, no more
    assert repeat["prompt_tokens_details"]["cached_tokens"] == repeat["prompt_tokens"] - 1
    m = metric_samples(fresh)
    assert value(m, "prefixcache_hit_ratio", basis="requests") == pytest.approx(2 / 3)
    assert value(m, "prefixcache_hit_ratio", basis="hits") == pytest.approx(1 / 3)
    with fresh.client(ADMIN) as admin:
        families = {f.name: f for f in text_string_to_metric_families(admin.get("/metrics").text)}
    help_text = families["prefixcache_hit_ratio"].documentation
    assert "template's opening" in help_text and "hits, of generations that read all of the prompt" in help_text


@contextmanager
def answers_held_until_cancelled(cache) -> Iterator[threading.Event]:
    """Inside the block, a call ``cache`` has answered (``PrefixCache.run`` returned) sets the event yielded, then
    waits until it is cancelled (at most ``HOLD_LIMIT`` s) before the proxy's worker takes the answer: the
    handler gives up on it after the answer is complete and before it is handed over, on any machine."""
    run = cache.run
    answered = threading.Event()

    def held(ids, options, scope):
        result = run(ids, options, scope)
        answered.set()
        deadline = time.monotonic() + HOLD_LIMIT
        while not options.cancel.is_set() and time.monotonic() < deadline:
            time.sleep(0.005)
        return result

    cache.run = held
    try:
        yield answered
    finally:
        del cache.run  # the class's method again


def test_a_client_gone_as_its_answer_is_handed_over_is_counted_once(fresh):
    """A request that does not stream, its client leaving after the answer is complete and before it reaches the
    handler: counted once, as a 499 or as served, never both."""
    body = json.dumps({"model": MODEL, "max_tokens": NEW, "temperature": 0,
                       "messages": [{"role": "user", "content": "What is the refund window?"}]}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {ALPHA}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with answers_held_until_cancelled(fresh.cache) as answered:
        with socket.create_connection(("127.0.0.1", fresh.port)) as client:
            client.sendall(head + body)
            assert answered.wait(30)
        wait_until(lambda: fresh.serving.queue() == (0, 0), timeout=30)
    fresh.stop()  # every handler has ended: whatever they count is counted
    registry = fresh.app.state.metrics.registry
    served = sum(s.value for family in registry.collect() if family.name == "prefixcache_requests"
                 for s in family.samples if s.name == "prefixcache_requests_total")
    gone = registry.get_sample_value("prefixcache_request_errors_total",
                                     {"route": "/v1/chat/completions", "status": "499"}) or 0
    assert served + gone == 1, (served, gone)


def test_a_handler_that_loses_the_claim_hands_the_answer_over(fresh):
    """The handler's side of that race: its client gone, it raises 499 when it claims the request first; when the
    worker counted the answer as served first, it waits for that answer and returns it (no second count)."""
    async def handle(counted: Outcome) -> str:
        loop = asyncio.get_running_loop()
        fut, cancel = loop.create_future(), threading.Event()

        async def gone() -> None:
            return None

        async def hand_over() -> None:  # the worker returns its answer once the handler has given up
            while not cancel.is_set():
                await asyncio.sleep(0)
            fut.set_result("answer")

        worker = asyncio.ensure_future(hand_over())
        try:
            return await fresh.serving._wait(fut, cancel, gone, counted)
        finally:
            await worker

    served_first = Outcome()
    assert served_first.claim(SERVED)
    assert asyncio.run(handle(served_first)) == "answer"
    assert not served_first.claim(CUT_SHORT)
    unclaimed = Outcome()
    with pytest.raises(ClientClosedError):
        asyncio.run(handle(unclaimed))
    assert not unclaimed.claim(SERVED)  # the worker's answer is not counted as served now
