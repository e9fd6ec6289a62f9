"""Engine faults at the HTTP edge: callers get an answer or a 503 fast, never a hang; a stopped
batching loop makes /healthz and /readyz fail while calls are still answered (serially)."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from prefixcache_api import create_app
from proxy_support import ADMIN, ALPHA, MODEL, live, make_cache, settings, wait_until

from prefixcache.model.private_kv import PrivateKV

CHAT = "/v1/chat/completions"
FAST = 1.0  # seconds a caller may wait after a fault (real time, generous for a loaded machine)


class LoopKilled(BaseException):
    """Not an ``Exception``: it ends the loop thread."""


def chat(i: int) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 4}


@pytest.fixture
def fresh(tiny_model, tokenizer):
    """A server with a cache of its own, so a broken engine cannot leak into other tests."""
    cache = make_cache(tiny_model, tokenizer)
    with live(create_app(settings(), cache=cache)) as srv:
        yield srv
    cache.close()


def test_an_allocation_error_freeing_kv_at_finish_answers_everyone_and_the_server_stays_ready(fresh, monkeypatch):
    real, raised = PrivateKV.release, []

    def release_once(kv, trim=True):
        if not raised:
            raised.append(time.monotonic())
            raise torch.OutOfMemoryError("alloc")
        return real(kv, trim)
    monkeypatch.setattr(PrivateKV, "release", release_once)
    with fresh.client(ALPHA) as client, ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda i: client.post(CHAT, json=chat(i)), range(4)))
        done = time.monotonic()
        assert raised and done - raised[0] < FAST + 1  # the other answers finish after it, no hang
        assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
        assert client.get("/readyz").status_code == 200 and client.get("/healthz").status_code == 200
        assert client.post(CHAT, json=chat(9)).status_code == 200
    fresh.cache.check_integrity()


def test_an_error_in_a_step_is_a_fast_503_and_the_next_request_is_served(fresh, monkeypatch):
    runner, raised = fresh.cache.batcher.runner, []
    real = runner.run

    def run_fails_once(plan):
        if not raised:
            raised.append(time.monotonic())
            raise torch.OutOfMemoryError("alloc")
        return real(plan)
    monkeypatch.setattr(runner, "run", run_fails_once)
    with fresh.client(ALPHA) as client:
        r = client.post(CHAT, json=chat(1))
        assert time.monotonic() - raised[0] < FAST
        assert r.status_code == 503 and r.headers.get("Retry-After"), r.text
        assert r.json()["error"]["code"] == "engine_fault" and "alloc" in r.json()["error"]["message"]
        assert client.get("/readyz").status_code == 200  # one fault: the engine is not broken
        assert client.post(CHAT, json=chat(2)).status_code == 200


def test_a_killed_loop_fails_callers_fast_reports_unhealthy_and_calls_are_served_serially(fresh, monkeypatch):
    engine = fresh.cache.batcher
    entered, go = threading.Event(), threading.Event()

    def killed(plan):
        entered.set()
        go.wait(30)
        raise LoopKilled("killed")
    monkeypatch.setattr(engine.runner, "run", killed)
    with fresh.client(ALPHA) as client, ThreadPoolExecutor(2) as pool:
        pending = [pool.submit(client.post, CHAT, json=chat(i)) for i in range(2)]
        assert entered.wait(30)
        # both requests in the engine (one in the step, one waiting) before the loop dies
        wait_until(lambda: len(engine.scheduler.running) + len(engine.scheduler.waiting) == 2, timeout=30)
        killed_at = time.monotonic()
        go.set()
        replies = [f.result(timeout=30) for f in pending]
        assert time.monotonic() - killed_at < FAST
        assert [r.status_code for r in replies] == [503, 503]
        assert all(r.json()["error"]["code"] == "engine_fault" for r in replies)
        for path in ("/healthz", "/readyz", "/health"):
            r = client.get(path)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed", (path, r.text)
            assert "LoopKilled" not in r.text  # anyone may ask: a fixed reason, the detail for the admin only
        served = client.post(CHAT, json=chat(3))
        assert served.status_code == 200, served.text
        assert fresh.cache.stats()["batching_enabled"] is False
        with fresh.client(ADMIN) as admin:
            assert "LoopKilled" in admin.get("/v1/cache/stats").json()["batching_disabled_reason"]


def test_an_engine_whose_every_step_fails_is_not_ready_until_steps_succeed_again(fresh, monkeypatch):
    runner, broken = fresh.cache.batcher.runner, threading.Event()
    real = runner.run

    def run(plan):
        if broken.is_set():
            raise torch.OutOfMemoryError("alloc")
        return real(plan)
    monkeypatch.setattr(runner, "run", run)
    streak = fresh.cache.batcher.config.fault_streak
    with fresh.client(ALPHA) as client:
        broken.set()
        for i in range(streak):
            assert client.get("/readyz").status_code == 200  # fewer than a streak of failed steps: ready
            assert client.post(CHAT, json=chat(i)).status_code == 503
        r = client.get("/readyz")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_faulting", r.text
        assert r.headers.get("Retry-After") and "alloc" not in r.text  # the detail is the admin's
        with fresh.client(ADMIN) as admin:
            assert "alloc" in admin.get("/v1/cache/stats").json()["engine_faulting"]
        assert client.get("/healthz").status_code == 200  # the loop lives: not a restart
        broken.clear()
        assert client.post(CHAT, json=chat(9)).status_code == 200  # requests still reach the engine
        assert client.get("/readyz").status_code == 200  # one good step ends the streak
