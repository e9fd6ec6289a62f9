"""Batched, cascaded generation equals plain per-request generate(); leases and memory stay exact."""
from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import pytest
import torch

from prefixcache import PrefixCache
from prefixcache.cache.hashing import BlockHasher
from prefixcache.cache.scope import Scope
from prefixcache.cache.store import KVStore
from prefixcache.config import CacheConfig
from prefixcache.errors import UnsupportedModelError
from prefixcache.serving.engine import BatchConfig, BatchEngine
from prefixcache.serving.request import Request, SamplingParams
from prefixcache.serving.scheduler import admission_order, plan_step
from tests.conftest import ARCHS, EOS, FakeClock, build_tiny, untouched

NS = ("t", "model")
SCOPE = Scope(NS, "t")


def make_engine(model, block_size=8, **cfg):
    clock = FakeClock()
    store = KVStore(CacheConfig(block_size=block_size), BlockHasher(1), clock)
    return BatchEngine(model, store, clock, BatchConfig(**cfg))


def expected(ref_model, prompt, new):
    out = ref_model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
    return out[0, len(prompt):].tolist()


def params(new):
    return SamplingParams(max_new_tokens=new, eos_token_ids=frozenset({EOS}))


def check_released(engine):
    engine.store.check_integrity()
    assert all(n.refcount == 0 for n in engine.store.trie.iter_nodes())


@pytest.mark.parametrize("arch", ARCHS)
def test_parity_join_leave_and_two_prefixes(arch):
    model, ref = build_tiny(arch), build_tiny(arch)
    engine = make_engine(model, max_batch=6, token_budget=24, prefill_chunk=7, private_chunk=4)
    try:
        assert engine.disabled_reason is None
        base_a, base_b = list(range(10, 60)), list(range(200, 237))
        for base in (base_a, base_b):  # both prefixes stored: one batch cascades over two prefixes
            assert engine.generate(base + [5], SCOPE, params(1)).finish_reason in ("length", "stop")
        first = [base_a + [70 + i] * (i + 1) for i in range(3)] + [base_b + [90, 91]]
        later = [base_a + [80, 81, 82, 83][: i + 1] for i in range(3)] + [base_b[:20] + [95]]
        news = [9, 3, 6, 4, 5, 2, 8, 7]
        reqs = [engine.submit(p, SCOPE, params(n)) for p, n in zip(first, news)]
        deadline = time.monotonic() + 60
        while engine.steps < 3:  # the first wave is mid-generation when the second joins
            assert time.monotonic() < deadline, f"the engine made {engine.steps} steps in 60 s"
            threading.Event().wait(0.001)
        reqs += [engine.submit(p, SCOPE, params(n)) for p, n in zip(later, news[4:])]
        for req, prompt, new in zip(reqs, first + later, news):
            got = engine.wait(req, timeout=60)
            assert got.tokens == expected(ref, prompt, new), prompt
        assert [r.stats.cached_tokens for r in reqs[:4]] == [50, 50, 50, 37]
        check_released(engine)
    finally:
        engine.close()


def test_sliding_window_and_eager_are_refused_by_the_engine_and_served_serially():
    """Requests longer than a sliding window, and non-SDPA models, are not the batching engine's:
    it says why, and ``PrefixCache`` serves them on the serial engine, still exact."""
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=16)
    model = MistralForCausalLM(cfg).eval()
    ref = copy.deepcopy(model)
    prompt = list(range(3, 30))
    with PrefixCache(model, None, CacheConfig(block_size=4), start_sweeper=False) as cache:
        assert "sliding window" in cache.batcher.unservable(len(prompt), SamplingParams(max_new_tokens=4))
        with pytest.raises(UnsupportedModelError, match="sliding window"):
            cache.batcher.submit(prompt, SCOPE, SamplingParams(max_new_tokens=4))
        got = cache.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)
        assert cache.last_call.executor == "serial"
        assert got.tolist() == ref.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False).tolist()
    eager = build_tiny("llama-gqa")
    eager.set_attn_implementation("eager")
    with PrefixCache(eager, None, CacheConfig(block_size=4), start_sweeper=False) as cache:
        assert "eager" in cache.batcher.disabled_reason
        got = cache.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False)
        assert cache.last_call.executor == "serial" and got.shape == (1, 6)


def test_memory_is_prefix_once_plus_private_per_request():
    """N concurrent requests on one P-token prefix hold about P + N·(q + out) tokens of KV."""
    model = build_tiny("llama-gqa")
    p_len, n_req, q_len, out_len = 256, 6, 16, 16
    engine = make_engine(model, block_size=16, max_batch=n_req, token_budget=256, prefill_chunk=64, private_chunk=8)
    try:
        prefix = [2 + (i * 7) % 300 for i in range(p_len)]
        engine.generate(prefix + [3], SCOPE, SamplingParams(max_new_tokens=1))
        per_token = engine.layout.bytes_per_token
        assert engine.store.bytes == (p_len + 1) * per_token
        engine.store.flush()
        engine.generate(prefix, SCOPE, SamplingParams(max_new_tokens=1))  # exactly P tokens stored
        held: list[int] = []
        reqs = [engine.submit(prefix + [10 + i] * q_len, SCOPE, SamplingParams(max_new_tokens=out_len),
                              on_token=lambda _t: held.append(engine.kv_bytes())) for i in range(n_req)]
        for r in reqs:
            engine.wait(r, timeout=60)
        ideal = (p_len + n_req * (q_len + out_len)) * per_token
        assert max(held) <= 1.1 * ideal, (max(held) / per_token, ideal / per_token)
        assert max(held) < 0.5 * n_req * p_len * per_token  # not one prefix copy per request
        check_released(engine)
    finally:
        engine.close()


def test_a_lone_first_request_reads_the_prefix_in_place_so_followers_do_not_pay_for_it():
    """The first request of a burst, admitted while nobody else holds the stored prefix, does
    not copy it into its private KV (every slot of the shared pool would be padded to it)."""
    model = build_tiny("llama-gqa")
    p_len, n_req, q_len, out_len = 256, 6, 16, 16
    engine = make_engine(model, block_size=16, max_batch=n_req, private_chunk=8)
    try:
        prefix = [2 + (i * 7) % 300 for i in range(p_len)]
        engine.generate(prefix, SCOPE, SamplingParams(max_new_tokens=1))  # one stored run of P tokens
        held: list[int] = []
        started = threading.Event()

        def record(_t):
            held.append(engine.kv_bytes())
            started.set()
        first = engine.submit(prefix + [10] * q_len, SCOPE, SamplingParams(max_new_tokens=out_len), on_token=record)
        assert started.wait(30)  # admitted and decoding alone
        rest = [engine.submit(prefix + [11 + i] * q_len, SCOPE, SamplingParams(max_new_tokens=out_len),
                              on_token=record) for i in range(n_req - 1)]
        for r in [first, *rest]:
            engine.wait(r, timeout=60)
        read_steps, base = first.read_steps, first.base_len
        assert read_steps is None and base == p_len, (read_steps, base)  # read in place, not copied
        per_token = engine.layout.bytes_per_token
        ideal = (p_len + n_req * (q_len + out_len)) * per_token
        assert max(held) <= 1.1 * ideal, (max(held) / per_token, ideal / per_token)
        check_released(engine)
    finally:
        engine.close()


def test_cancel_callback_error_and_sampling():
    model = build_tiny("qwen2")
    engine = make_engine(model)
    try:
        prompt = list(range(20, 60))
        cancel = threading.Event()
        seen: list[int] = []

        def on_token(t):
            seen.append(t)
            if len(seen) == 2:
                cancel.set()
        got = engine.generate(prompt, SCOPE, SamplingParams(max_new_tokens=50), on_token=on_token, cancel=cancel)
        assert got.finish_reason == "cancelled" and got.tokens == seen and len(seen) == 2

        def broken(_t):
            raise RuntimeError("client went away")
        bad = engine.submit(prompt + [7], SCOPE, SamplingParams(max_new_tokens=5), on_token=broken)
        good = engine.submit(prompt + [8], SCOPE, SamplingParams(max_new_tokens=5))
        with pytest.raises(RuntimeError, match="client went away"):
            engine.wait(bad, timeout=30)
        assert len(engine.wait(good, timeout=30).tokens) == 5
        sampled = [engine.generate(prompt, SCOPE, SamplingParams(max_new_tokens=6, temperature=0.9, top_p=0.9,
                                                                   top_k=50, seed=4)).tokens for _ in range(2)]
        assert sampled[0] == sampled[1]
        top1 = engine.generate(prompt, SCOPE, SamplingParams(max_new_tokens=6, temperature=1.0, top_k=1, seed=1))
        greedy = engine.generate(prompt, SCOPE, SamplingParams(max_new_tokens=6))
        assert top1.tokens == greedy.tokens
        check_released(engine)
    finally:
        engine.close()


def test_a_request_cancelled_while_it_waits_leaves_at_the_next_step_even_behind_a_full_batch():
    """One request fills the batch (``max_batch=1``); the one waiting behind it is cancelled at the running
    one's first token: it leaves at the next step, its lease released, not when the batch has room."""
    model, ref = build_tiny("qwen2"), build_tiny("qwen2")
    engine = make_engine(model, max_batch=1)
    try:
        running_prompt, waiting_prompt = list(range(20, 60)), list(range(100, 130))
        cancel, done_at_each_token, waiting = threading.Event(), [], []

        def on_token(_t):  # the loop's thread, once per step of the running request
            if cancel.is_set():
                done_at_each_token.append(waiting[0].done.is_set())
            cancel.set()

        with engine._cv:  # both queued before the loop plans a step: the first one submitted runs first
            running = engine.submit(running_prompt, SCOPE, SamplingParams(max_new_tokens=12), on_token=on_token)
            waiting.append(engine.submit(waiting_prompt, SCOPE, SamplingParams(max_new_tokens=12), cancel=cancel))
        left = engine.wait(waiting[0], timeout=30)
        assert left.finish_reason == "cancelled" and left.tokens == []
        assert engine.wait(running, timeout=30).tokens == expected(ref, running_prompt, 12)  # unaffected
        assert done_at_each_token[0], done_at_each_token  # gone by the running request's next token
        check_released(engine)
        assert engine.store.ledger.held()["private"] == 0
    finally:
        engine.close()


def _req(cached_arrival, group=0):
    r = Request([1] * 50, SCOPE, SamplingParams(), cached_arrival[1])
    r.lease = type("L", (), {"cached_tokens": cached_arrival[0], "steps": []})()
    return r


def test_admission_order_is_cache_aware_and_bounded():
    short, long_, old = _req((5, 10.0)), _req((40, 11.0)), _req((0, 0.0))
    assert admission_order([short, long_], now=11.0, max_wait=5.0) == [long_, short]
    assert admission_order([short, long_, old], now=11.0, max_wait=5.0)[0] is old  # starved goes first


def test_plan_step_keeps_decodes_running_during_long_prefill():
    decoding = _req((49, 0.0))
    decoding.private = type("P", (), {"length": 1})()
    prefilling = _req((0, 1.0))
    prefilling.prompt = [1] * 1000
    prefilling.private = type("P", (), {"length": 0})()
    plan = plan_step([decoding, prefilling], token_budget=64, prefill_chunk=512)
    assert plan == [(decoding, 1), (prefilling, 63)]


def _prompt(tokens, arrival, held=0):
    r = _req((0, arrival))
    r.prompt = [1] * tokens
    r.private = type("P", (), {"length": held})()
    return r


def test_plan_step_feeds_the_prompts_closest_to_their_first_token_first():
    lone = _prompt(2000, 0.0)
    assert plan_step([lone], token_budget=512, prefill_chunk=128) == [(lone, 512)]
    assert plan_step([], token_budget=512, prefill_chunk=128) == []
    # a burst of equal prompts: one after another (first tokens spread out), not all in parallel
    burst = [_prompt(576, float(i)) for i in range(8)]
    assert plan_step(burst, 512, 128) == [(burst[0], 512)]
    burst[0].private.length = 512
    assert plan_step(burst, 512, 128) == [(burst[0], 64), (burst[1], 448)]
    # a short question arriving after a long document is fed first; the document keeps its
    # guaranteed share, so it is not starved by the questions that keep coming
    question = _prompt(100, 1.0)
    assert plan_step([lone, question], 512, 128) == [(lone, 412), (question, 100)]
    questions = [_prompt(300, 1.0 + i) for i in range(3)]
    assert plan_step([lone, *questions], 512, 128) == [(lone, 128), (questions[0], 300), (questions[1], 84)]
    decoding = _prompt(50, 3.0, held=50)  # decodes first, then the prompts
    assert plan_step([lone, decoding], 512, 128) == [(decoding, 1), (lone, 511)]
    assert plan_step([decoding], 1, 128) == [(decoding, 1)]  # no budget left for prompts


def test_a_failure_while_planning_fails_the_active_requests_and_the_loop_lives_on(monkeypatch):
    model = build_tiny("llama-gqa")
    engine = make_engine(model)
    try:
        import prefixcache.serving.scheduler as batching
        real, broken = batching.plan_step, {"left": 1}

        def fail_once(*args):
            if broken["left"]:
                broken["left"] -= 1
                raise RuntimeError("planning broke")
            return real(*args)
        monkeypatch.setattr(batching, "plan_step", fail_once)
        with pytest.raises(RuntimeError, match="planning broke"):
            engine.wait(engine.submit([5, 6, 7, 8], SCOPE, SamplingParams(max_new_tokens=2)), timeout=30)
        got = engine.wait(engine.submit([5, 6, 7, 9], SCOPE, SamplingParams(max_new_tokens=2)), timeout=30)
        assert got.tokens == expected(untouched(model), [5, 6, 7, 9], 2)
        check_released(engine)
    finally:
        engine.close()


def _own_pool_sizes(monkeypatch, engine: BatchEngine) -> list[int]:
    """Capacities every pool but the engine's shared one is (re)allocated with, in order."""
    from prefixcache.model.private_kv import PrivatePool
    sizes: list[int] = []
    real = PrivatePool._resize

    def resize(pool, slots, capacity):
        if pool is not engine.scheduler.pool:
            sizes.append(capacity)
        real(pool, slots, capacity)
    monkeypatch.setattr(PrivatePool, "_resize", resize)
    return sizes


def test_a_long_prompt_gets_its_own_pool_sized_for_the_prompt_at_once(monkeypatch):
    """A prompt too long for the shared pool prefills in several chunks into a pool of its own:
    one allocation for the whole prompt (not one copy per chunk); only the answer grows it."""
    model = build_tiny("llama-gqa")
    engine = make_engine(model, token_budget=8, prefill_chunk=8, private_chunk=4, pool_max_tokens=16)
    sizes = _own_pool_sizes(monkeypatch, engine)
    try:
        prompt = list(range(10, 74))  # 64 tokens: 8 prefill steps
        got = engine.generate(prompt, SCOPE, SamplingParams(max_new_tokens=3))
        assert got.tokens == expected(untouched(model), prompt, 3)
        assert sizes == [0, 64, 68], sizes  # its (empty) slot, the whole prompt, one chunk for the answer
        check_released(engine)
    finally:
        engine.close()


def test_a_long_prompt_own_pool_grows_by_an_eighth_for_its_answer_capped_at_its_need(monkeypatch):
    """Each growth of an own pool copies the whole prompt's KV: it grows by >= 1/8 of its capacity
    (rounded to chunks), never past what its request may hold, not by one chunk at a time."""
    model = build_tiny("llama-gqa")
    engine = make_engine(model, token_budget=64, prefill_chunk=8, private_chunk=4, pool_max_tokens=16)
    sizes = _own_pool_sizes(monkeypatch, engine)
    try:
        prompt = list(range(10, 74))  # 64 tokens; the answer's 40 tokens need 64 + 40 = 104 at most
        got = engine.generate(prompt, SCOPE, SamplingParams(max_new_tokens=40))
        assert got.tokens == expected(untouched(model), prompt, 40)
        # 64 + 8 = 72, 72 + 9 -> 84, 84 + 10 -> 96 (chunks of 4), then capped at the need, 104; by
        # chunks it was 68, 72, ..., 104: 10 growths
        assert sizes == [0, 64, 72, 84, 96, 104], sizes
        check_released(engine)
    finally:
        engine.close()


def test_next_turn_hits_prompt_and_answer():
    """Inserted KV (prefix snapshot + private, straddling blocks) serves the next turn exactly."""
    model, ref = build_tiny("gpt2"), build_tiny("gpt2")
    engine = make_engine(model, block_size=8, prefill_chunk=5)
    try:
        first = list(range(30, 43))  # 13 tokens: blocks end inside the private part
        answer = engine.generate(first, SCOPE, SamplingParams(max_new_tokens=6)).tokens
        second = first + answer + [9, 10]
        got = engine.generate(second, SCOPE, SamplingParams(max_new_tokens=5))
        assert got.stats.cached_tokens == len(first) + len(answer) - 1
        assert got.tokens == expected(ref, second, 5)
        check_released(engine)
        # Steps run under inference mode; what they publish must not be inference tensors
        # (those cannot be edited in place or used by autograd outside it).
        lease = engine.store.acquire(SCOPE, second, len(second))
        try:
            assert lease.steps and not any(st.node.kv.is_inference() for st in lease.steps)
        finally:
            engine.store.release(lease)
    finally:
        engine.close()


def test_reduced_precision_is_batched_and_chained_blocks_attend_as_one():
    """bf16 passes the self-check (no fallback); a prefix of many blocks is one key set per layer."""
    model = build_tiny("llama-gqa").to(torch.bfloat16)
    store = KVStore(CacheConfig(block_size=4), BlockHasher(0), FakeClock())
    engine = BatchEngine(model, store, FakeClock(), BatchConfig())
    try:
        assert engine.disabled_reason is None
        prefix = list(range(10, 50))  # 10 blocks of 4
        engine.generate(prefix, Scope(("t",), "t"), SamplingParams(max_new_tokens=1))
        requests = [engine.submit(prefix + [60 + i], Scope(("t",), "t"), SamplingParams(max_new_tokens=2)) for i in range(3)]
        results = [engine.wait(r) for r in requests]
        assert all(r.stats.cached_tokens == len(prefix) for r in results)
    finally:
        engine.close()
    from prefixcache.model.hf_cache import CascadeCache, CascadeRow, private_pool, probe_layout
    layout = probe_layout(build_tiny("llama-gqa"))
    snaps = [(torch.zeros(layout.num_layers, 2, layout.num_kv_heads, 4, layout.head_dim), 4) for _ in range(10)]
    pool = private_pool(layout, 4)
    rows = [CascadeRow(snaps, pool.acquire(), 0, 1) for _ in range(3)]
    cache = CascadeCache(rows, layout.num_layers)
    assert len(cache.groups) == 1 and len(cache.groups[0][1]) == 10  # one call over all 10 blocks


def test_followers_wait_for_a_running_prefill_of_their_prefix():
    """Concurrent cold requests on one prefix: one computes it, the others reuse it."""
    model = build_tiny("llama-gqa")
    engine = make_engine(model, block_size=8, prefill_chunk=8, token_budget=16)
    try:
        prefix = list(range(10, 74))  # 64 tokens: several prefill steps
        prompts = [prefix + [100 + i, 101] for i in range(4)]
        requests = [engine.submit(p, SCOPE, params(3)) for p in prompts]
        results = [engine.wait(r) for r in requests]
        cached = sorted(r.stats.cached_tokens for r in results)
        assert cached[0] == 0 and all(c >= len(prefix) for c in cached[1:]), cached
        for p, r in zip(prompts, results):
            assert r.tokens == expected(untouched(model), p, 3)
        check_released(engine)
    finally:
        engine.close()


def test_followers_of_a_stored_prefix_prefill_together():
    """Once the leader has stored the shared prefix, every follower is admitted in the same step:
    none waits for another follower's question (they share the prefix, not the tokens after it)."""
    model = build_tiny("llama-gqa")
    engine = make_engine(model, block_size=8, prefill_chunk=8, token_budget=32)
    first_step: dict[int, int] = {}
    try:
        prefix = list(range(10, 74))  # 64 tokens: several prefill steps for the leader
        prompts = [prefix + [100 + i, 101, 102] for i in range(4)]
        with engine._cv:  # the loop plans once all four wait (a reentrant lock): a burst, on any machine
            requests = [engine.submit(p, SCOPE, params(3),
                                      on_token=lambda _t, i=i: first_step.setdefault(i, engine.steps))
                        for i, p in enumerate(prompts)]
        results = [engine.wait(r) for r in requests]
        leader = min(range(4), key=lambda i: results[i].stats.cached_tokens)
        followers = [i for i in range(4) if i != leader]
        assert all(results[i].stats.cached_tokens >= len(prefix) for i in followers)
        assert len({first_step[i] for i in followers}) == 1, first_step  # one step, not one per follower
        assert first_step[followers[0]] == first_step[leader] + 1
        for p, r in zip(prompts, results):
            assert r.tokens == expected(untouched(model), p, 3)
        check_released(engine)
    finally:
        engine.close()


def test_a_leader_reads_its_stored_prompt_in_place_with_its_followers():
    """Cold burst: once the leader stores its prompt for its followers, it reads their shared prefix
    from the store too, and only its question and answer stay private, in the shared pool."""
    model, ref = build_tiny("llama-gqa"), build_tiny("llama-gqa")
    engine = make_engine(model, block_size=8, prefill_chunk=8, token_budget=32, pool_max_tokens=16)
    first: dict[int, tuple[int, int, bool]] = {}
    requests: list[Request] = []

    def on_token(i):
        def record(_token):
            if i not in first:
                r = requests[i]
                first[i] = (r.base_len, r.private.length, r.private.pool is engine.scheduler.pool)
        return record

    try:
        prefix = list(range(10, 74))  # 64 tokens: more than pool_max_tokens, so the leader starts in its own pool
        prompts = [prefix + [100 + i, 101, 102] for i in range(4)]
        with engine._cv:  # the loop plans once all four wait (a reentrant lock): a burst, on any machine
            for i, p in enumerate(prompts):
                requests.append(engine.submit(p, SCOPE, params(4), on_token=on_token(i)))
        results = [engine.wait(r) for r in requests]
        assert [r.stats.cached_tokens for r in results] == [0, 64, 64, 64]  # request 0 led
        assert first == {i: (64, 3, True) for i in range(4)}, first  # leader too: 64 read in place, 3 private
        for p, r in zip(prompts, results):
            assert r.tokens == expected(ref, p, 4)
        check_released(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("fold_max", [0, 1024])
def test_own_history_is_copied_into_private_system_prompt_read_in_place(fold_max):
    """Concurrent conversations on one system prompt: each one's own history (several stored
    runs, read by nobody else) is copied into its private KV once; answers stay exact."""
    model, ref = build_tiny("llama-gqa"), build_tiny("llama-gqa")
    engine = make_engine(model, block_size=8, max_batch=4, fold_max_tokens=fold_max)
    try:
        system = list(range(10, 50))  # 40 tokens = 5 blocks
        history = [list(system) for _ in range(3)]
        for turn in range(2):  # one insert per turn: each history is a chain of runs
            for u, h in enumerate(history):
                h += [60 + 10 * u + turn, 61 + 10 * u, 62 + turn]
                h += engine.generate(h, SCOPE, SamplingParams(max_new_tokens=5)).tokens
        prompts = [h + [90 + u, 91] for u, h in enumerate(history)]
        with engine._cv:  # the loop plans once all three wait (a reentrant lock): each sees the others share the system prompt
            reqs = [engine.submit(p, SCOPE, params(6)) for p in prompts]
        for req, prompt in zip(reqs, prompts):
            got = engine.wait(req, timeout=60)
            assert got.tokens == expected(ref, prompt, 6)
            assert got.stats.cached_tokens == len(prompt) - 3  # all but the new question's last block
            if fold_max:
                assert req.base_len == len(system) and len(req.copied) >= 2  # own turns copied, system shared
                assert sum(used for _, used in req.copied) == req.cached_len - len(system)
            else:
                assert req.read_steps is None and req.base_len == req.cached_len
        check_released(engine)
    finally:
        engine.close()


def test_a_failure_while_admitting_fails_that_request_only():
    """An error while admitting (here: choosing what to copy) reaches that caller; the loop lives on."""
    model = build_tiny("llama-gqa")
    engine = make_engine(model)
    try:
        real = engine.scheduler._read_in_place
        broken = {"left": 1}

        def fail_once(req):
            if broken["left"]:
                broken["left"] -= 1
                raise RuntimeError("admission broke")
            return real(req)
        engine.scheduler._read_in_place = fail_once
        first = engine.submit([5, 6, 7, 8], SCOPE, SamplingParams(max_new_tokens=2))
        with pytest.raises(RuntimeError, match="admission broke"):
            engine.wait(first, timeout=30)  # a dead loop would time out instead
        got = engine.wait(engine.submit([5, 6, 7, 9], SCOPE, SamplingParams(max_new_tokens=2)), timeout=30)
        assert got.tokens == expected(untouched(model), [5, 6, 7, 9], 2)
        check_released(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("field,value", [("max_batch", 0), ("token_budget", -1), ("prefill_chunk", 0),

                                         ("private_chunk", 1.5), ("pool_max_tokens", -1), ("fold_max_tokens", -5),
                                         ("max_private_tokens", 0), ("max_wait_seconds", 0), ("max_batch", True)])
def test_batch_config_rejects_out_of_range_values(field, value):
    from prefixcache.errors import ConfigError
    with pytest.raises(ConfigError, match=field):
        BatchConfig(**{field: value})
    BatchConfig(fold_max_tokens=0, pool_max_tokens=0)  # both 0 are meaningful: never copy / always own pool


def test_an_engine_never_closed_stops_before_the_interpreter_exits():
    """A script that never closes its cache: the batching loop is stopped at exit (a hook registered before the
    cache runs after the engine's own and finds the loop thread gone), not left running into finalization."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import atexit, threading
        atexit.register(lambda: print("loop alive at exit:",
                                      any(t.name == "prefixcache-batching" for t in threading.enumerate())))
        from prefixcache import PrefixCache
        from tests.conftest import build_tiny
        cache = PrefixCache(build_tiny("llama-gqa"), start_sweeper=False)
        assert cache.batching_disabled_reason is None
        cache.generate([[5, 6, 7, 8]], max_new_tokens=2, do_sample=False)
    """)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "loop alive at exit: False" in proc.stdout, proc.stdout
