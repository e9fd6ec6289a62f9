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


# -- staged prompt steps (a hit's new tokens alone in a step) ---------------------------

SUFFIXES = [[7] * 3, [9, 8, 7, 6, 5], [5] * 3, list(range(30, 39)), list(range(40, 57)), [4] * 4, [6] * 3]


def hits(engine, logprobs=None, seed=None, new=5, shift=0):
    """Each suffix (its tokens moved by ``shift``) after the stored ``PREFIX``, one call after another (each
    prefilled alone in a step, over the prefix alone): tokens, and their log-probabilities where asked."""
    out = []
    for i, suffix in enumerate(SUFFIXES):
        params = SamplingParams(max_new_tokens=new, logprobs=logprobs, temperature=None if seed is None else 0.9,
                                seed=None if seed is None else seed + i)
        result = engine.generate(PREFIX + [t + shift for t in suffix], SCOPE, params)
        assert result.stats.cached_tokens == len(PREFIX)
        out.append((result.tokens, [lp.logprob for lp in result.logprobs]))
    return out


def with_prefix(*captures):
    """Engines over fresh tiny llama-gqa models, one per capture (None: eager), each with ``PREFIX`` stored."""
    engines = [engine_with(build_tiny("llama-gqa"), capture, max_batch=8) for capture in captures]
    for engine in engines:
        engine.generate(PREFIX, SCOPE, SamplingParams(max_new_tokens=1))
    return engines


@pytest.mark.parametrize("arch", ["llama-gqa", "gpt2"])
def test_hits_are_staged_captured_once_their_shape_repeats_and_answer_like_eager_steps(arch):
    """Hits of 3-17 new tokens on a stored prefix (buckets of 16 and 32 tokens), greedy then seeded: the
    same tokens as the engine that runs every step unpadded and eagerly, their log-probabilities within
    float32 rounding (padding changes the shapes the kernels see, not what a real row attends to). The
    second hit of a bucket is captured, later ones replayed."""
    eager = engine_with(build_tiny(arch), None, max_batch=8, private_chunk=4)
    graphed = engine_with(build_tiny(arch), rerun, max_batch=8, private_chunk=4)
    try:
        for engine in (eager, graphed):
            engine.generate(PREFIX, SCOPE, SamplingParams(max_new_tokens=1))  # a cold 40-token prompt: staged too
        for seed, shift in ((None, 0), (5, 100)):  # new suffixes: each hit reads the prefix alone
            want = hits(eager, logprobs=0, seed=seed, shift=shift)
            got = hits(graphed, logprobs=0, seed=seed, shift=shift)
            assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
            for (_, ours), (_, theirs) in zip(got, want):
                assert ours == pytest.approx(theirs, abs=1e-4)
        graphs = graphed.runner.graphs
        assert graphs.prefill_disabled is None and graphs.disabled is None
        # Bucket 16: seen on the first hit, captured on the second, replayed on the other 10 of 12;
        # bucket 32: once a round, captured on the second; the cold prompt's bucket of 64: seen once.
        assert (graphs.staged_captures, graphs.staged_replays) == (2, 10)
        assert graphs.staging_bytes == (16 + 32 + 64) * graphed.layout.bytes_per_token
        # The staging slabs count as private KV in the ledger, as the requests' pools do (none is running).
        assert graphed.store.ledger.held()["private"] == graphs.staging_bytes == graphed.scheduler.private_bound()
    finally:
        eager.close()
        graphed.close()
    assert graphs.staging_bytes == 0 and graphed.store.ledger.held()["private"] == 0  # closed: the slabs went


def test_a_staged_step_that_fails_to_capture_switches_off_staging_only():
    """A capture that raises at its first use (a staged hit): staged steps go back to running unpadded,
    decode steps are still captured and replayed, and every answer equals the eager engine's."""
    calls = []

    def refuses_first(fn):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("operation not permitted when stream is capturing")
        return fn

    eager, broken = with_prefix(None, refuses_first)
    try:
        assert hits(broken, new=1) == hits(eager, new=1)  # one token: no decode step to capture
        graphs = broken.runner.graphs
        assert "capturing a staged prompt step failed: RuntimeError" in graphs.prefill_disabled
        assert graphs.bucket(3) is None and graphs.staging_bytes == 0
        assert answers(broken, PROMPTS, NEWS) == answers(eager, PROMPTS, NEWS)
        assert graphs.disabled is None and graphs.replays > 0 and graphs.staged_replays == 0
    finally:
        eager.close()
        broken.close()


def test_a_replay_that_raises_switches_its_kind_off_and_the_step_runs_eagerly():
    """Captures whose replays raise after the check at capture (a device fault at a later launch): the step
    that meets it runs eagerly, the kind of step it was is not captured from then on, and every answer
    equals the eager engine's (staged hits first, then decodes)."""
    def breaks_later(fn):
        calls = []

        def replay():
            calls.append(1)
            if len(calls) > 1:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return fn()
        return replay

    eager, broken = with_prefix(None, breaks_later)
    try:
        assert hits(broken, new=1) == hits(eager, new=1)
        graphs = broken.runner.graphs
        assert "replaying a staged prompt step failed: RuntimeError" in graphs.prefill_disabled
        assert graphs.disabled is None and graphs.staging_bytes == 0
        assert answers(broken, PROMPTS, NEWS) == answers(eager, PROMPTS, NEWS)
        assert "replaying a decode step failed: RuntimeError" in graphs.disabled
    finally:
        eager.close()
        broken.close()


def test_staged_prompt_steps_are_bounded_by_captured_prompt_tokens():
    """Hits of more new tokens than ``captured_prompt_tokens`` run as before; 0 stages none."""
    for limit, staged in ((8, (1, 3)), (0, (0, 0))):
        graphed = engine_with(build_tiny("llama-gqa"), rerun, max_batch=8, captured_prompt_tokens=limit)
        try:
            graphed.generate(PREFIX, SCOPE, SamplingParams(max_new_tokens=1))
            hits(graphed, new=1)
            graphs = graphed.runner.graphs
            # Limit 8: the five hits of 3-5 new tokens (one seen, one captured, three replayed), not the cold
            # prompt of 40 nor the hits of 9 and 17.
            assert (graphs.staged_captures, graphs.staged_replays) == staged
            assert graphs.staging_bytes == (16 * graphed.layout.bytes_per_token if limit else 0)
        finally:
            graphed.close()


def test_staging_slabs_stay_within_the_kv_total_and_give_way_to_requests():
    """All KV within 300 tokens' worth: a staging slab is made only where it fits beside the running requests,
    and the slabs made give way to a request that fits the total without them (they are made again when they
    fit). Stored plus reserved KV never passes the total, and every answer equals the eager engine's."""
    engines = []
    for capture in (None, rerun):
        clock = FakeClock()
        probe = engine_with(build_tiny("llama-gqa"), None)
        total = 300 * probe.layout.bytes_per_token
        probe.close()
        store = KVStore(CacheConfig(block_size=8, max_kv_bytes_total=total), BlockHasher(1), clock)
        engines.append(BatchEngine(build_tiny("llama-gqa"), store, clock, BatchConfig(), step_capture=capture))
    eager, graphed = engines
    bpt = graphed.layout.bytes_per_token
    # A prompt of 200 new tokens: 224 tokens of private KV, 480 with a slab of 256 (not made: it runs unstaged);
    # a stored prefix (its 40 tokens staged over a slab of 64) and two hits (slabs of 16 and 32); another 200:
    # 336 with the slabs made (they go); a hit again.
    long = [[3 + (i * k) % 200 for i in range(200)] for k in (1, 3)]
    prompts = [long[0], PREFIX, PREFIX + [7] * 3, PREFIX + list(range(40, 57)), long[1], PREFIX + [9] * 5]
    try:
        for prompt in prompts:
            want = eager.generate(prompt, SCOPE, SamplingParams(max_new_tokens=10)).tokens
            peaks = []  # all KV accounted at each token (after each step)
            req = graphed.submit(prompt, SCOPE, SamplingParams(max_new_tokens=10),
                                 on_token=lambda _: peaks.append(sum(graphed.store.ledger.held().values())))
            assert graphed.wait(req, timeout=30).tokens == want
            assert max(peaks) <= total, peaks
            held = graphed.store.ledger.held()
            assert held["private"] == graphed.runner.graphs.staging_bytes
            if prompt is prompts[3]:
                assert graphed.runner.graphs.staging_bytes == (64 + 16 + 32) * bpt
            if prompt is long[1]:
                assert graphed.runner.graphs.staging_bytes == 0
        assert graphed.runner.graphs.staging_bytes > 0  # made again once it fits
        assert graphed.runner.graphs.prefill_disabled is None
    finally:
        eager.close()
        graphed.close()


def test_staged_steps_and_decode_steps_are_each_kept_to_captured_steps():
    """One step shape of each kind kept: hits of two sizes (buckets 16 and 32, each captured in turn) evict each
    other, never the captured decode step."""
    graphed = engine_with(build_tiny("llama-gqa"), rerun, max_batch=8, captured_steps=1)
    try:
        graphed.generate(PREFIX, SCOPE, SamplingParams(max_new_tokens=1))
        answers(graphed, PROMPTS[:1], [12])  # one request decoding alone: one step shape, captured
        graphs = graphed.runner.graphs
        decodes = [k for k in graphs._steps if k[0] == "decode"]
        assert len(decodes) == 1
        # The decoding request's own hit was bucket 16's first; then 16 (captured), 16 (replayed), 32, 32
        # (captured: 16 evicted), 16, 16 (captured again: 32 evicted).
        for suffix in ([7] * 3, [8] * 3, [9] * 20, [10] * 20, [11] * 3, [12] * 3):
            graphed.generate(PREFIX + suffix, SCOPE, SamplingParams(max_new_tokens=1))
        assert (graphs.staged_captures, graphs.staged_replays) == (3, 1)
        assert [k for k in graphs._steps if k[0] == "decode"] == decodes
        assert sum(k[0] == "staged" for k in graphs._steps) == 1
    finally:
        graphed.close()


def test_a_batched_config_validates_captured_steps():
    from prefixcache.errors import ConfigError

    with pytest.raises(ConfigError, match="captured_steps"):
        BatchConfig(captured_steps=0)
    with pytest.raises(ConfigError, match="captured_prompt_tokens"):
        BatchConfig(captured_prompt_tokens=-1)
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
    # A staged step's key: its rows' slabs, slots and positions are in it.
    staging = private_pool(LAYOUT, 16).acquire(16)
    staged = _step(None, [staging], snap, 12, counts=[16])
    assert staged.step_key(own=True) == _step(None, [staging], snap, 12, counts=[16]).step_key(own=True)
    assert staged.step_key(own=True) != _step(None, [staging], snap, 11, counts=[16]).step_key(own=True)
    other = private_pool(LAYOUT, 16).acquire(16)
    assert staged.step_key(own=True) != _step(None, [other], snap, 12, counts=[16]).step_key(own=True)
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
