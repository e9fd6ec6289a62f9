"""Concurrency: disconnects cancel generation and release pins; many clients; a free event loop."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from proxy_support import ADMIN, ALPHA, BETA, MODEL, auth, counter_sum, leased_refs, wait_until

CHAT = "/v1/chat/completions"
LONG = 1500


def idle(server) -> bool:
    return server.serving.queue() == (0, 0) and leased_refs(server.cache) == 0


def long_stream(tokenizer, **extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a very long story."}],
            "max_tokens": LONG, "stream": True, "logit_bias": {str(tokenizer.eos_token_id): -100}, **extra}


def test_disconnect_mid_stream_stops_generation_and_releases_pins_promptly(server, tokenizer):
    cache = server.cache
    wait_until(lambda: idle(server))
    before = cache.stats("alpha")
    with server.client(ALPHA) as client, client.stream("POST", CHAT, json=long_stream(tokenizer)) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        seen = [line for line, _ in zip(lines, range(6), strict=False) if line]
        assert len(seen) >= 3
        assert leased_refs(cache) > 0 or server.serving.queue()[0] == 1  # it is running, holding its prefix
    # The response context is closed: the client hung up mid-stream. Generous bounds: the
    # machine is shared; "stopped early" is asserted by the token count below.
    wait_until(lambda: idle(server), timeout=10.0)
    after = cache.stats("alpha")
    assert after["queries"] == before["queries"] + 1
    assert after["completion_tokens"] - before["completion_tokens"] < LONG  # stopped early, not run to the end
    assert after["pinned_bytes"] == before["pinned_bytes"]
    cache.check_integrity()


def test_disconnect_of_a_non_streaming_request_cancels_it(server, tokenizer):
    wait_until(lambda: idle(server))
    before = server.cache.stats("alpha")["completion_tokens"]
    body = {**long_stream(tokenizer), "stream": False}
    queries = server.cache.stats("alpha")["queries"]
    counted = {name: counter_sum(server, name) for name in ("prefixcache_requests_total",
                                                       "prefixcache_completion_tokens_total")}
    # The client gives up while the answer is being generated: an answer within 0.5 s would
    # mean the long request was not run at all, and fails the test.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}{CHAT}", json=body, headers=auth(ALPHA), timeout=httpx.Timeout(30, read=0.5))
    wait_until(lambda: idle(server), timeout=10.0)
    assert server.cache.stats("alpha")["queries"] == queries + 1  # it ran, and was cancelled
    assert server.cache.stats("alpha")["completion_tokens"] - before < LONG
    # Nobody got an answer: the served-generation counters leave it out.
    assert {name: counter_sum(server, name) for name in counted} == counted


def test_the_event_loop_stays_free_during_generation(server, tokenizer):
    stop = threading.Event()

    def generate():
        with server.client(BETA) as client, client.stream("POST", CHAT, json=long_stream(tokenizer)) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    worker = threading.Thread(target=generate)
    worker.start()
    try:
        wait_until(lambda: server.serving.queue()[0] == 1, timeout=5)
        with server.client() as client:
            for _ in range(5):
                start = time.monotonic()
                assert client.get("/healthz").status_code == 200
                assert time.monotonic() - start < 2.0  # a blocked loop would wait for the whole generation
    finally:
        stop.set()
        worker.join(10)
    wait_until(lambda: idle(server), timeout=10)


def test_a_client_that_leaves_while_queued_never_starts(server, tokenizer):
    """Both workers busy: a third request waits; its client gives up; it leaves the queue at once (the
    workers still busy) and is never generated."""
    stop, holders = threading.Event(), []

    def hold():
        with server.client(ALPHA) as client, client.stream("POST", CHAT, json=long_stream(tokenizer)) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    wait_until(lambda: idle(server))
    for _ in range(server.serving.settings.workers):
        holders.append(threading.Thread(target=hold))
        holders[-1].start()
    try:
        wait_until(lambda: server.serving.queue()[0] == server.serving.settings.workers, timeout=5)
        before = server.cache.stats("beta")["queries"]
        for stream in (True, False):
            with pytest.raises(httpx.ReadTimeout):  # queued behind the busy workers: no answer yet
                httpx.post(f"{server.url}{CHAT}", json={**long_stream(tokenizer), "stream": stream},
                           headers=auth(BETA), timeout=httpx.Timeout(30, read=0.3))
            # Gone from the queue while both workers are still held: it holds no place meanwhile.
            wait_until(lambda: server.serving.queue() == (server.serving.settings.workers, 0), timeout=10)
    finally:
        stop.set()
        for thread in holders:
            thread.join(10)
    wait_until(lambda: idle(server), timeout=10)
    assert server.cache.stats("beta")["queries"] == before


SYSTEMS = ["You are a terse logistics assistant. " * 12, "You answer questions about tides and harbours. " * 10]


def _requests() -> list[tuple[str, dict]]:
    """32 varied requests: two shared system prompts, chat and completions, some streamed."""
    out = []
    for i in range(32):
        if i % 4 == 3:
            body = {"model": MODEL, "prompt": f"Harbour log entry {i}: the tide", "max_tokens": 8, "temperature": 0}
            out.append(("/v1/completions", body))
        else:
            msgs = [{"role": "system", "content": SYSTEMS[i % 2]}, {"role": "user", "content": f"Question {i}?"}]
            out.append((CHAT, {"model": MODEL, "messages": msgs, "max_tokens": 8, "temperature": 0}))
        if i % 3 == 0:
            out[-1][1].update(stream=True, stream_options={"include_usage": True})
    return out


def _answer(client: httpx.Client, path: str, body: dict) -> str:
    if not body.get("stream"):
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"]
    text = []
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                for choice in event["choices"]:
                    text.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
    return "".join(text)


def test_32_concurrent_clients_all_answered_equal_to_serial(server):
    """One tenant's 32 requests at once: the admin key's, which a tenant key's places (a quarter of the
    queue) do not bound."""
    requests = _requests()
    server.cache.flush("admin")
    with server.client(ADMIN) as client:
        serial = [_answer(client, path, body) for path, body in requests]
    server.cache.flush("admin")
    barrier = threading.Barrier(32)

    def one(item):
        path, body = item
        with server.client(ADMIN) as client:
            barrier.wait(10)  # all 32 requests in flight together
            return _answer(client, path, body)

    with ThreadPoolExecutor(32) as pool:
        cold = list(pool.map(one, requests))  # concurrent, cache filling as they run
        barrier.reset()
        warm = list(pool.map(one, requests))  # concurrent, on a warm cache
    assert cold == serial
    assert warm == serial
    assert all(serial)
    wait_until(lambda: idle(server), timeout=10)
    server.cache.check_integrity()
