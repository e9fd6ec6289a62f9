"""Requests that end abnormally (a client gone mid-stream or while queued, half of a burst leaving, a
cancelled SDK call in a shared step): what they held is given back, the metrics count each once, and
the requests beside them get the answers they get alone."""
from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prefixcache_api import create_app
from proxy_support import (
    ADMIN,
    ALPHA,
    MODEL,
    anthropic_client,
    auth,
    leased_refs,
    live,
    make_cache,
    metric_samples,
    settings,
    wait_until,
)

from prefixcache import CacheConfig, PrefixCache
from tests.step_hooks import hold_until_cancelled

CHAT, COMPLETIONS, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/messages"
SYSTEM = "You are a careful assistant for a harbour office; answer briefly. " * 6
WORD = 28899  # " harbour": one whole word, so the first token is a text delta at once
#: Counters that hold answers delivered: a request cut short leaves them as they were.
SERVED = ("prefixcache_requests_total", "prefixcache_prompt_tokens_total", "prefixcache_cached_tokens_total",
          "prefixcache_completion_tokens_total", "prefixcache_executor_requests_total")


@pytest.fixture(scope="module")
def fresh(tiny_model, tokenizer):
    """A server of its own: its counters start at zero and only this module moves them."""
    cache = make_cache(tiny_model, tokenizer)
    with live(create_app(settings(), cache=cache)) as srv:
        yield srv
    cache.close()


def totals(srv) -> dict[str, float]:
    """Each counter's sum over its labels (no ``_created`` series)."""
    out: dict[str, float] = {}
    for (name, _), value in metric_samples(srv).items():
        if name.endswith("_total"):
            out[name] = out.get(name, 0.0) + value
    return out


def errors(srv, route: str, status: int) -> float:
    return metric_samples(srv).get(("prefixcache_request_errors_total", (("route", route), ("status", str(status)))),
                                   0.0)


def assert_idle_and_exact(srv) -> None:
    """Nothing runs or waits, nothing is leased, no KV is reserved beside the store, and the store's bytes
    are the bytes of the snapshots it holds (the admin's audit, /metrics and the store's own checks)."""
    wait_until(lambda: srv.serving.queue() == (0, 0) and leased_refs(srv.cache) == 0, timeout=10)
    with srv.client(ADMIN) as admin:
        stats = admin.get("/v1/cache/stats", params={"audit": "true"}).json()
    assert stats["refcounts"] == 0 and stats["live_tensor_bytes"] == stats["bytes"]
    assert stats["kv_bytes"] == {"stored": stats["bytes"], "private": 0, "serial": 0, "prewarm": 0}
    assert stats["queue"]["running"] == 0 and stats["queue"]["waiting"] == 0
    samples = metric_samples(srv)
    assert samples[("prefixcache_requests_running", ())] == 0 and samples[("prefixcache_queue_depth", ())] == 0
    assert samples[("prefixcache_kv_bytes", (("kind", "private"),))] == 0
    srv.cache.check_integrity()


def _leave_openai_chat(srv) -> None:
    stream = srv.openai(ALPHA).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell a long story."}], max_tokens=1500, stream=True,
        logit_bias={str(WORD): 100})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    stream.close()


def _leave_openai_completion(srv) -> None:
    stream = srv.openai(ALPHA).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=1500,
                                                  stream=True, logit_bias={str(WORD): 100})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            break
    stream.close()


def _leave_anthropic(srv) -> None:
    client = anthropic_client(srv.url, ALPHA)
    with client.messages.stream(model=MODEL, max_tokens=1500,
                                messages=[{"role": "user", "content": "Tell a long story."}]) as stream:
        for item in stream:
            if item.type == "message_start":
                break  # the request runs; the client leaves before its answer


@pytest.mark.parametrize(("route", "leave"), [(CHAT, _leave_openai_chat), (COMPLETIONS, _leave_openai_completion),
                                              (MESSAGES, _leave_anthropic)], ids=["chat", "completions", "messages"])
def test_a_client_gone_mid_stream_is_a_499_and_gives_back_all_it_held(fresh, route, leave):
    before = totals(fresh)
    closed = errors(fresh, route, 499)
    with hold_until_cancelled(fresh.cache):  # it is still answering (1,500 tokens) when the client leaves
        leave(fresh)
        assert_idle_and_exact(fresh)
    # Counted once, as the 499 it was (when its generation stopped); never as an answer served.
    wait_until(lambda: errors(fresh, route, 499) > closed, timeout=10)
    assert errors(fresh, route, 499) == closed + 1
    after = totals(fresh)
    assert {name: after.get(name, 0.0) for name in SERVED} == {name: before.get(name, 0.0) for name in SERVED}
    assert after["prefixcache_request_errors_total"] == before.get("prefixcache_request_errors_total", 0.0) + 1


def _stream_text(srv, body: dict, leave: bool) -> str | None:
    """The streamed answer's text; with ``leave``, the client hangs up after two chunks (None)."""
    with srv.client(ALPHA) as client, client.stream("POST", CHAT, json=body) as r:
        assert r.status_code == 200
        out = []
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                out += [choice["delta"].get("content") or "" for choice in chunk["choices"]]
                if leave and len(out) >= 2:
                    return None
        return "".join(out)


def test_half_of_a_burst_on_one_prefix_leaves_and_the_rest_answer_as_alone(fresh, tokenizer):
    bodies = [{"model": MODEL, "messages": [{"role": "system", "content": SYSTEM},
                                           {"role": "user", "content": f"Question {i}: when is high tide?"}],
               "max_tokens": 16, "stream": True, "logit_bias": {str(tokenizer.eos_token_id): -100}}
              for i in range(8)]
    alone = []
    for body in bodies:
        fresh.cache.flush()
        alone.append(_stream_text(fresh, body, leave=False))
    fresh.cache.flush()
    before = totals(fresh)
    together = threading.Barrier(len(bodies))

    def one(i: int) -> str | None:
        together.wait(10)
        return _stream_text(fresh, bodies[i], leave=i % 2 == 0)

    with ThreadPoolExecutor(len(bodies)) as pool:
        got = list(pool.map(one, range(len(bodies))))
    assert_idle_and_exact(fresh)
    assert got[1::2] == alone[1::2] and all(alone)
    # Each stayer is counted once as served; a leaver as served (it ended before its client left) or as a 499.
    def counted() -> tuple[float, float]:
        after = totals(fresh)
        return (after["prefixcache_requests_total"] - before["prefixcache_requests_total"],
                after.get("prefixcache_request_errors_total", 0.0) - before.get("prefixcache_request_errors_total", 0.0))

    wait_until(lambda: sum(counted()) >= len(bodies), timeout=10)
    served, closed = counted()
    assert served >= 4 and served + closed == len(bodies)


def test_a_client_gone_while_queued_gives_its_place_back_at_once(tiny_model, tokenizer):
    """One worker, busy: a queued request whose client leaves frees its queue place and its key's place
    while the worker is still busy, and is never run."""
    cache = make_cache(tiny_model, tokenizer)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 1500,
            "logit_bias": {str(WORD): 100}}
    with live(create_app(settings(workers=1), cache=cache)) as srv, hold_until_cancelled(cache):
        started = threading.Event()

        def hold_the_worker() -> None:
            with srv.client(ALPHA) as client, client.stream("POST", CHAT, json={**body, "stream": True}) as r:
                for line in r.iter_lines():
                    if "harbour" in line:
                        started.set()

        holder = threading.Thread(target=hold_the_worker)
        holder.start()
        try:
            assert started.wait(10)  # mid-answer, held until cancelled
            queries = cache.stats("alpha")["queries"]
            with pytest.raises(httpx.ReadTimeout):  # queued behind the held request: no answer comes
                httpx.post(f"{srv.url}{CHAT}", json=body, headers=auth(ALPHA), timeout=httpx.Timeout(30, read=0.5))
            # The worker is still held, yet the queue and the key hold only the running request.
            wait_until(lambda: srv.serving.queue() == (1, 0) and srv.serving.admission.in_flight("alpha") == 1,
                       timeout=10)
            samples = metric_samples(srv)
            assert samples[("prefixcache_queue_depth", ())] == 0 and samples[("prefixcache_requests_running", ())] == 1
        finally:
            for req in list(cache.batcher.scheduler.running):  # let the held request go: it ends cancelled
                req.abandoned.set()
            holder.join(30)
        assert_idle_and_exact(srv)
        assert cache.stats("alpha")["queries"] == queries + 1  # the queued request never ran
    cache.close()


def test_cancelled_sdk_calls_in_a_shared_step_leave_the_others_answers_unchanged(tiny_model, tokenizer):
    """Six calls on one prefix share the batching engine's steps; three cancel themselves at their first text.
    The other three answer token for token as they do alone, and nothing stays held."""
    prompts = [SYSTEM + f"Question {i}: when is high tide?" for i in range(6)]
    options = {"max_new_tokens": 24, "ignore_eos": True}
    with PrefixCache(tiny_model, tokenizer, CacheConfig(max_bytes=64 << 20)) as cache:
        alone = []
        for prompt in prompts:
            cache.flush()
            alone.append(cache.complete(prompt, **options).token_ids)
        cache.flush()
        together = threading.Barrier(len(prompts))

        def one(i: int):
            cancel = threading.Event()
            on_text = (lambda _text: cancel.set()) if i % 2 == 0 else None
            together.wait(10)
            return cache.complete(prompts[i], cancel=cancel, on_text=on_text, **options)

        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(one, range(len(prompts))))
        assert [r.token_ids for r in results[1::2]] == alone[1::2]
        for result, expected in zip(results[::2], alone[::2], strict=True):
            assert result.finish_reason == "cancelled" and result.token_ids == expected[: len(result.token_ids)]
        assert cache.audit()["refcounts"] == 0
        assert cache.store.ledger.held() == {"stored": cache.store.bytes, "private": 0, "serial": 0, "prewarm": 0}
        cache.check_integrity()


def test_a_leader_cancelled_mid_prefill_leaves_its_followers_answers_unchanged(tiny_model, tokenizer):
    """Two calls wait for a running call's prefill of their shared prefix (followers); that call is cancelled
    in the middle of it. The followers answer token for token as they do alone, and nothing stays held."""
    prompts = [SYSTEM * 3 + f"Question {i}: when is high tide?" for i in range(3)]
    options = {"max_new_tokens": 12, "ignore_eos": True}
    with PrefixCache(tiny_model, tokenizer, CacheConfig(max_bytes=64 << 20),
                     batching={"token_budget": 16, "prefill_chunk": 16}) as cache:  # a prefill of many steps
        alone = []
        for prompt in prompts[1:]:
            cache.flush()
            alone.append(cache.complete(prompt, **options).token_ids)
        cache.flush()
        scheduler, runner, cancel = cache.batcher.scheduler, cache.batcher.runner, threading.Event()
        run, cut = runner.run, {}

        def step(plan):
            """The leader's first prefill step waits for both followers to queue; the next one (admission has
            held them for the leader's prefill since) is cancelled."""
            if "queued" not in cut:
                cut["queued"] = wait_until(lambda: len(scheduler.waiting) == 2, timeout=30) >= 0
            elif not cancel.is_set():
                cut.update(held=len(scheduler.waiting), prefilling=all(req.prefilling for req, _ in plan))
                cancel.set()
            return run(plan)

        runner.run = step
        try:
            with ThreadPoolExecutor(3) as pool:
                leader = pool.submit(cache.complete, prompts[0], cancel=cancel, **options)
                wait_until(lambda: bool(scheduler.running) or leader.done(), timeout=10)
                followers = [pool.submit(cache.complete, prompt, **options) for prompt in prompts[1:]]
                assert [f.result(30).token_ids for f in followers] == alone
                assert leader.result(30).finish_reason == "cancelled"
        finally:
            del runner.run
        assert cut == {"queued": True, "held": 2, "prefilling": True}  # cancelled mid-prefill, followers held
        assert cache.audit()["refcounts"] == 0
        assert cache.store.ledger.held() == {"stored": cache.store.bytes, "private": 0, "serial": 0, "prewarm": 0}
        cache.check_integrity()
