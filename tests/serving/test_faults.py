"""Faults in the batching loop never leave a caller waiting; a stopped loop is reported and bypassed.

Faults are injected into the real engine (tiny real models): an allocation error while a
finishing request frees or stores its KV, an error in a step, and a ``BaseException`` that
ends the loop thread. "Within a second" is real time, with a generous bound for a loaded
machine; every wait also has a timeout so a regression fails instead of hanging.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from prefixcache import CacheConfig, PrefixCache
from prefixcache.cache.store import KVStore
from prefixcache.errors import EngineFaultError, GenerationTimeoutError
from prefixcache.model.private_kv import PrivateKV
from prefixcache.serving.request import SamplingParams
from tests.conftest import build_tiny
from tests.serving.test_batching import SCOPE, check_released, expected, make_engine

PROMPTS = [list(range(10, 40)) + [50 + i] for i in range(4)]
FAST = 1.0  # seconds: the bound on how long a caller may wait after a fault


class LoopKilled(BaseException):
    """Not an ``Exception``: nothing in the loop may swallow it, so it ends the loop thread."""


def _fail(times: int, make_error, real, log: list[float], armed: threading.Event | None = None):
    """``real`` wrapped to raise ``make_error()`` on its first ``times`` calls once ``armed`` (default:
    at once); the times they raised go to ``log``."""
    def broken(*args, **kwargs):
        if len(log) < times and (armed is None or armed.is_set()):
            log.append(time.monotonic())
            raise make_error()
        return real(*args, **kwargs)
    return broken


@pytest.fixture
def llama():
    return build_tiny("llama-gqa")


@pytest.mark.parametrize("times", [1, 1000], ids=["once", "every-time"])
def test_an_allocation_error_freeing_private_kv_at_finish_wakes_every_caller_and_the_loop_serves_on(
        llama, monkeypatch, times):
    engine = make_engine(llama)
    try:
        faults: list[float] = []
        monkeypatch.setattr(PrivateKV, "release", _fail(times, lambda: torch.OutOfMemoryError("alloc"),
                                                        PrivateKV.release, faults))
        reqs = [engine.submit(p, SCOPE, SamplingParams(max_new_tokens=3 + i)) for i, p in enumerate(PROMPTS)]
        for req, prompt, new in zip(reqs, PROMPTS, range(3, 7)):
            got = engine.wait(req, timeout=30)  # a dead loop would time out here
            assert got.tokens == expected(llama, prompt, new)  # the answer was complete: it stands
            assert req.stats.total_seconds >= 0 and req.done.is_set()
        assert faults and all(r.done.is_set() for r in reqs)
        monkeypatch.undo()
        after = engine.wait(engine.submit(PROMPTS[0] + [7], SCOPE, SamplingParams(max_new_tokens=2)), timeout=30)
        assert after.tokens == expected(llama, PROMPTS[0] + [7], 2) and engine.failure is None
        engine.store.check_integrity()
        assert all(n.refcount == 0 for n in engine.store.trie.iter_nodes())
    finally:
        engine.close()


@pytest.mark.parametrize("method", ["insert", "release"])
def test_an_allocation_error_in_the_store_at_finish_costs_the_cache_not_the_answer(llama, monkeypatch, method):
    engine = make_engine(llama)
    try:
        faults: list[float] = []
        armed = threading.Event()  # from the first token on: the fault hits the finish path, not admission
        monkeypatch.setattr(KVStore, method, _fail(1, lambda: RuntimeError("alloc"), getattr(KVStore, method),
                                                   faults, armed))
        got = engine.wait(engine.submit(PROMPTS[0], SCOPE, SamplingParams(max_new_tokens=4),
                                        on_token=lambda _t: armed.set()), timeout=30)
        assert faults and got.tokens == expected(llama, PROMPTS[0], 4)
        got = engine.wait(engine.submit(PROMPTS[1], SCOPE, SamplingParams(max_new_tokens=4)), timeout=30)
        assert got.tokens == expected(llama, PROMPTS[1], 4)
        check_released(engine)  # the failed lease release was retried: nothing stays pinned
    finally:
        engine.close()


def test_an_error_in_a_step_fails_its_requests_fast_with_an_engine_fault(llama, monkeypatch):
    engine = make_engine(llama)
    try:
        faults: list[float] = []
        monkeypatch.setattr(engine.runner, "run", _fail(1, lambda: torch.OutOfMemoryError("alloc"),
                                                        engine.runner.run, faults))
        reqs = [engine.submit(p, SCOPE, SamplingParams(max_new_tokens=4)) for p in PROMPTS]
        failed = 0
        for req, prompt in zip(reqs, PROMPTS):
            try:
                assert engine.wait(req, timeout=30).tokens == expected(llama, prompt, 4)
            except EngineFaultError as exc:
                failed += 1
                assert "alloc" in str(exc) and isinstance(exc.__cause__, torch.OutOfMemoryError)
                assert time.monotonic() - faults[0] < FAST
        assert failed >= 1  # the step's requests; any admitted later were served
        got = engine.wait(engine.submit(PROMPTS[0], SCOPE, SamplingParams(max_new_tokens=2)), timeout=30)
        assert got.tokens == expected(llama, PROMPTS[0], 2) and engine.failure is None
        check_released(engine)
    finally:
        engine.close()


def test_a_killed_loop_fails_every_caller_fast_and_calls_go_to_the_serial_engine(llama, monkeypatch):
    cache = PrefixCache(llama, None, CacheConfig(block_size=8, ttl_seconds=None), start_sweeper=False)
    engine = cache.batcher
    try:
        started = threading.Event()
        release = threading.Event()
        real = engine.runner.run

        def run(plan):
            started.set()
            release.wait(30)  # hold the step so later requests are queued when the loop dies
            raise LoopKilled("killed")
        monkeypatch.setattr(engine.runner, "run", run)
        reqs = [engine.submit(p, SCOPE, SamplingParams(max_new_tokens=4)) for p in PROMPTS[:2]]
        assert started.wait(30)
        reqs += [engine.submit(p, SCOPE, SamplingParams(max_new_tokens=4)) for p in PROMPTS[2:]]
        killed_at = time.monotonic()
        release.set()
        for req in reqs:
            with pytest.raises(EngineFaultError, match="loop stopped"):
                engine.wait(req, timeout=30)
            assert time.monotonic() - killed_at < FAST
        assert "LoopKilled" in engine.failure and "LoopKilled" in cache.engine_failure
        with pytest.raises(EngineFaultError):
            engine.submit(PROMPTS[0], SCOPE, SamplingParams(max_new_tokens=2))
        monkeypatch.setattr(engine.runner, "run", real)  # nothing may call it any more
        ids = torch.tensor([PROMPTS[0]])
        out = cache.generate(ids, max_new_tokens=3, do_sample=False)
        assert cache.last_call.executor == "serial" and "loop stopped" in cache.batching_disabled_reason
        assert out[0, len(PROMPTS[0]):].tolist() == expected(llama, PROMPTS[0], 3)
        check_released(engine)
    finally:
        cache.close()


def test_a_timed_out_waiter_cancels_its_request_which_leaves_at_the_next_step(llama):
    engine = make_engine(llama)
    try:
        slow = lambda _t: time.sleep(0.02)  # noqa: E731 - on the loop's thread: 200 tokens take seconds
        req = engine.submit(PROMPTS[0], SCOPE, SamplingParams(max_new_tokens=200), on_token=slow)
        start = time.monotonic()
        with pytest.raises(GenerationTimeoutError):
            engine.wait(req, timeout=0.2)
        assert time.monotonic() - start < FAST
        assert req.done.wait(FAST), "the abandoned request still runs"
        assert req.finish_reason == "cancelled" and len(req.output) < 200
        check_released(engine)
    finally:
        engine.close()


def test_the_sdk_passes_its_timeout_to_the_engine(llama):
    cache = PrefixCache(llama, None, CacheConfig(block_size=8, ttl_seconds=None), start_sweeper=False)
    try:
        slow = type("Slow", (), {"put": lambda self, v: time.sleep(0.02), "end": lambda self: None})()
        start = time.monotonic()
        with pytest.raises(GenerationTimeoutError):
            cache.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=200, do_sample=False, streamer=slow,
                           timeout_seconds=0.2)
        assert time.monotonic() - start < FAST
        assert cache.batcher.steps > 0  # it was served (and cancelled) by the batching engine
    finally:
        cache.close()


def test_a_streak_of_failed_steps_marks_the_engine_faulting_until_a_quiet_window_or_a_good_step(llama, monkeypatch):
    engine = make_engine(llama, fault_streak=2, fault_window_seconds=10.0)
    try:
        clock = engine._clock
        faults: list[float] = []
        monkeypatch.setattr(engine.runner, "run", _fail(3, lambda: RuntimeError("bad step"), engine.runner.run, faults))
        for i in range(2):
            assert engine.faulting is None
            with pytest.raises(EngineFaultError):
                engine.generate(PROMPTS[i], SCOPE, SamplingParams(max_new_tokens=2), timeout=30)
        assert "bad step" in engine.faulting
        clock.advance(11.0)  # no fault for a window: a probe may come in again
        assert engine.faulting is None
        with pytest.raises(EngineFaultError):
            engine.generate(PROMPTS[2], SCOPE, SamplingParams(max_new_tokens=2), timeout=30)
        assert engine.faulting is not None  # the streak goes on: the third fault follows the second
        engine.generate(PROMPTS[3], SCOPE, SamplingParams(max_new_tokens=2), timeout=30)
        assert engine.faulting is None  # a good step ends it
    finally:
        engine.close()
