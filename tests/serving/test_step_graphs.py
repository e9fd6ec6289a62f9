"""Captured decode steps (``StepGraphs``): what a replay reads is fixed by the step's key, and a replay
with its inputs refilled answers exactly like the eager step.

CUDA graphs need a GPU (``tests/gpu`` captures real ones). Here the capture is ``rerun``: its replay
runs the captured step's Python again on the *captured* cache object, whose inputs were refilled
from the new step, as a graph re-launches the captured kernels on the captured tensors. Anything a
new step needs that the refill does not bring would show as a wrong answer here.
"""
from __future__ import annotations

import threading

import pytest
import torch

from prefixcache.cache.hashing import BlockHasher
from prefixcache.cache.scope import Scope
from prefixcache.cache.store import KVStore
from prefixcache.config import CacheConfig
from prefixcache.model.hf_cache import CascadeCache, CascadeRow, private_pool
from prefixcache.model.layout import KVLayout
from prefixcache.serving.engine import BatchConfig, BatchEngine
from prefixcache.serving.request import SamplingParams
from tests.conftest import FakeClock, build_tiny

NS = ("t", "model")
SCOPE = Scope(NS, "t")


def rerun(fn):
    return fn


def engine_with(model, capture, **cfg):
    clock = FakeClock()
    store = KVStore(CacheConfig(block_size=8), BlockHasher(1), clock)
    return BatchEngine(model, store, clock, BatchConfig(**cfg), step_capture=capture)


def answers(engine, prompts, news, seeds=None):
    """Every prompt submitted at once (they decode together, and leave at different steps)."""
    reqs = []
    with engine._cv:  # the loop plans once all wait (a reentrant lock): at once on any machine
        for i, (p, n) in enumerate(zip(prompts, news)):
            seed = None if seeds is None else seeds[i]
            params = SamplingParams(max_new_tokens=n, temperature=None if seed is None else 0.8, seed=seed)
            reqs.append(engine.submit(p, SCOPE, params))
    return [engine.wait(r, timeout=60).tokens for r in reqs]


PREFIX = [2 + (i * 11) % 300 for i in range(40)]
PROMPTS = [PREFIX + [100 + i] * (1 + i % 3) for i in range(5)]
NEWS = [30, 12, 24, 6, 18]  # a request leaves every 6 steps: each stretch a step shape of its own


@pytest.mark.parametrize("arch", ["llama-gqa", "gpt2"])
def test_replayed_decode_steps_answer_exactly_like_eager_steps(arch):
    """Greedy and seeded sampling, requests leaving at different steps (each departure a new step
    shape, captured after it repeats): the same tokens as the engine that runs every step eagerly."""
    eager = engine_with(build_tiny(arch), None, max_batch=8, private_chunk=4)
    graphed = engine_with(build_tiny(arch), rerun, max_batch=8, private_chunk=4)
    try:
        assert eager.runner.graphs is None  # a CPU has no capture of its own
        eager.generate(PREFIX, SCOPE, SamplingParams(max_new_tokens=1))
        graphed.generate(PREFIX, SCOPE, SamplingParams(max_new_tokens=1))
        for seeds in (None, [11, 12, 13, 14, 15]):
            want = answers(eager, PROMPTS, NEWS, seeds)
            got = answers(graphed, PROMPTS, NEWS, seeds)
            assert got == want
        graphs = graphed.runner.graphs
        assert graphs.disabled is None
        assert graphs.captures >= 8 and graphs.replays >= 30, (graphs.captures, graphs.replays)
    finally:
        eager.close()
        graphed.close()


def test_a_replay_that_differs_switches_capturing_off_and_answers_stay_exact():
    def flipped(fn):
        return lambda: fn().flip(-1)

    eager = engine_with(build_tiny("llama-gqa"), None, max_batch=8)
    broken = engine_with(build_tiny("llama-gqa"), flipped, max_batch=8)
    try:
        assert answers(broken, PROMPTS, NEWS) == answers(eager, PROMPTS, NEWS)
        graphs = broken.runner.graphs
        assert graphs.disabled is not None and "replayed logits" in graphs.disabled
        assert graphs.replays == 0
    finally:
        eager.close()
        broken.close()


def test_a_capture_that_raises_switches_capturing_off_and_answers_stay_exact():
    def refuses(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    eager = engine_with(build_tiny("llama-gqa"), None, max_batch=8)
    broken = engine_with(build_tiny("llama-gqa"), refuses, max_batch=8)
    try:
        assert answers(broken, PROMPTS, NEWS) == answers(eager, PROMPTS, NEWS)
        assert "capturing a decode step failed: RuntimeError" in broken.runner.graphs.disabled
    finally:
        eager.close()
        broken.close()


def test_captured_steps_are_bounded_and_evicted_least_recently_used():
    graphed = engine_with(build_tiny("llama-gqa"), rerun, max_batch=8, captured_steps=2)
    try:
        graphed.generate(PREFIX, SCOPE, SamplingParams(max_new_tokens=1))
        answers(graphed, PROMPTS, NEWS)
        graphs = graphed.runner.graphs
        assert graphs.captures >= 3 and len(graphs._steps) == 2
    finally:
        graphed.close()


def test_a_batched_config_validates_captured_steps():
    from prefixcache.errors import ConfigError

    with pytest.raises(ConfigError, match="captured_steps"):
        BatchConfig(captured_steps=0)
    with pytest.raises(ConfigError, match="step_graphs"):
        BatchConfig(step_graphs="yes")


# -- the key --------------------------------------------------------------------------

LAYOUT = KVLayout(2, 2, 8, torch.float32, torch.device("cpu"), None)


def _step(pool, privates, snap, used, counts=None, whole=True):
    counts = counts or [1] * len(privates)
    rows = []
    for private, count in zip(privates, counts):
        private.reserve(private.length + count)
        rows.append(CascadeRow([(snap, used)], private, private.length, count))
    return CascadeCache(rows, LAYOUT.num_layers, whole_decodes=whole)


def test_the_key_is_what_fixes_a_step_s_shapes_and_addresses():
    snap = torch.randn(2, 2, 2, 12, 8)
    pool = private_pool(LAYOUT, 4, plan_ahead=True)
    privates = pool.acquire_all([8, 8, 8])
    for private in privates:
        private.load(torch.randn(2, 2, 2, 2, 8))
    first = _step(pool, privates, snap, 12)
    for private in privates:
        private.length += 1  # the step's keys written: the next step of the same requests
    second = _step(pool, privates, snap, 12)
    key = second.step_key()
    assert key is not None and first.step_key() == key
    (mask1, targets1), (mask2, targets2) = first.step_inputs(), second.step_inputs()
    assert not torch.equal(mask1, mask2) and not torch.equal(targets1, targets2)  # what a replay refills

    assert _step(pool, privates, snap, 11).step_key() != first.step_key()  # fewer stored tokens read
    assert _step(pool, privates[:2], snap, 12).step_key() != first.step_key()  # a request left
    assert _step(pool, privates, snap.clone(), 12).step_key() != first.step_key()  # another snapshot
    assert _step(pool, privates, snap, 12, counts=[1, 3, 1]).step_key() is None  # a prompt chunk: not decodes only
    # Without whole-slot decodes the keys read grow every step: no two steps alike.
    a = _step(pool, privates, snap, 12, whole=False).step_key()
    for private in privates:
        private.length += 1
    assert _step(pool, privates, snap, 12, whole=False).step_key() != a
    pool.acquire(8)  # the pool grows a slot: a new slab
    assert _step(pool, privates, snap, 12).step_key() != key


def test_concurrent_callers_get_exact_answers_with_capture_on():
    """Callers on their own threads, as the proxy's: each answer equals the eager engine's."""
    eager = engine_with(build_tiny("llama-gqa"), None, max_batch=8)
    graphed = engine_with(build_tiny("llama-gqa"), rerun, max_batch=8)
    try:
        want = answers(eager, PROMPTS, NEWS)
        got: list = [None] * len(PROMPTS)

        def client(i):
            params = SamplingParams(max_new_tokens=NEWS[i])
            got[i] = graphed.generate(PROMPTS[i], SCOPE, params).tokens

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got == want
    finally:
        eager.close()
        graphed.close()
