"""All KV memory under one total on the engines: the serial engine's working caches, prewarm
buffers and the batching engine's private pools reserve their bytes beside the stored snapshots;
snapshots give way first, then a request waits (bounded), then it is refused with ``KVMemoryError``."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from prefixcache import CacheConfig, PrefixCache
from prefixcache.errors import KVMemoryError
from prefixcache.serving.request import SamplingParams
from tests.conftest import build_tiny, untouched
from tests.serving.test_batching import SCOPE, expected

BPT = 512  # KV bytes per token of the tiny Llama: 2 layers x K/V x 2 heads x 16 dims x 4 bytes


def prompt(tag: int, n: int = 30) -> list[int]:
    return [(tag * 37 + 11 * i) % 300 + 2 for i in range(n)]


def idle(cache: PrefixCache) -> None:
    """Nothing in flight, and the stored bytes are the bytes of live tensors."""
    held = cache.store.ledger.held()
    assert {k: v for k, v in held.items() if k != "stored"} == {"private": 0, "serial": 0, "prewarm": 0}
    audit = cache.audit()
    assert audit["refcounts"] == 0 and audit["live_tensor_bytes"] == audit["accounted_bytes"] == held["stored"]
    cache.check_integrity()


def make(total_tokens: int, batching: bool, wait: float = 5.0) -> PrefixCache:
    model = build_tiny("llama-gqa")
    return PrefixCache(model, None, CacheConfig(max_bytes=1 << 20, block_size=8, max_kv_bytes_total=total_tokens * BPT,
                                                kv_wait_seconds=wait), start_sweeper=False, batching=batching)


def test_a_serial_call_whose_working_cache_exceeds_the_total_is_refused_before_any_work():
    with make(100, batching=False) as cache:
        assert cache.bytes_per_token == BPT
        start = time.monotonic()
        with pytest.raises(KVMemoryError):
            cache.generate(torch.tensor([prompt(1, 60)]), max_new_tokens=41, do_sample=False)
        assert time.monotonic() - start < 1 and cache.stats()["queries"] == 0
        with pytest.raises(KVMemoryError):
            cache.warm(prompt(2, 101))
        idle(cache)


def test_stored_snapshots_give_way_to_a_serial_call_and_a_prewarm():
    with make(100, batching=False) as cache:
        cache.warm(prompt(1, 64))  # 64 tokens stored
        ids = torch.tensor([prompt(2, 40)])
        want = untouched(cache.model).generate(ids, max_new_tokens=8, do_sample=False)
        assert torch.equal(cache.generate(ids, max_new_tokens=8, do_sample=False), want)  # 48 reserved: evicts
        assert cache.stats()["evictions"]["lru"] > 0 and cache.stats()["bytes"] <= 100 * BPT
        # 90 reserved, then stored as the prewarm's last use of them (its buffer's bytes pass to its blocks):
        # within 100 only if the rest goes.
        assert cache.warm(prompt(3, 90)).stored_tokens == 90
        assert 90 * BPT <= cache.stats()["bytes"] <= 100 * BPT
        idle(cache)


def test_a_serial_call_and_a_prewarm_store_what_fits_once_their_own_working_cache_is_freed():
    """A call's own reservation (its working cache) does not squeeze out what it stores from that cache:
    the stored blocks take the reservation over, so the total holds throughout and what fits without the
    cache is stored."""
    with make(100, batching=False) as cache:
        ids = torch.tensor([prompt(1, 40)])
        want = untouched(cache.model).generate(ids, max_new_tokens=20, do_sample=False)
        assert torch.equal(cache.generate(ids, max_new_tokens=20, do_sample=False), want)  # 60 reserved
        assert cache.stats()["bytes"] == 59 * BPT  # prompt and answer but its last token (whose KV is not computed)
        idle(cache)
        warmed = cache.warm(prompt(2, 60), pin=True, privileged=True)  # 60 reserved, and 60 stored and pinned
        assert warmed.pinned and warmed.stored_tokens == 60 and cache.stats()["pinned_bytes"] == 60 * BPT
        assert cache.stats()["bytes"] <= 100 * BPT
        idle(cache)


def test_a_batched_request_that_cannot_fit_even_alone_fails_fast():
    with make(100, batching=True) as cache:
        engine = cache.batcher
        start = time.monotonic()
        with pytest.raises(KVMemoryError):
            engine.generate(prompt(1), SCOPE, SamplingParams(max_new_tokens=100), timeout=30)
        assert time.monotonic() - start < 1
        idle(cache)


def test_batched_requests_that_do_not_fit_together_run_one_after_another_within_the_total():
    with make(100, batching=True) as cache:  # each needs a 64-token slot (30 + 20, in 32-token chunks)
        engine, total, peaks = cache.batcher, 100 * BPT, []
        ref = untouched(cache.model)

        def sample(_token: int) -> None:  # on the loop's thread: the pools as they are
            peaks.append((engine.kv_bytes(), cache.store.bytes + cache.store.ledger.reserved))
        params = SamplingParams(max_new_tokens=20, eos_token_ids=frozenset({1}))
        reqs = [engine.submit(prompt(i), SCOPE, params, on_token=sample)
                for i in range(3)]
        for i, req in enumerate(reqs):
            assert engine.wait(req, timeout=60).tokens == expected(ref, prompt(i), 20)
        assert max(actual for actual, _ in peaks) <= total and max(booked for _, booked in peaks) <= total
        idle(cache)


def test_a_batched_request_waits_for_memory_a_serial_call_holds_then_is_served_or_refused():
    with make(100, batching=True, wait=10.0) as cache:
        engine = cache.batcher
        held = cache.store.ledger.reserve("serial", 60 * BPT)
        result: list = []
        waiter = threading.Thread(target=lambda: result.append(
            engine.generate(prompt(1), SCOPE, SamplingParams(max_new_tokens=20), timeout=30)))
        waiter.start()
        time.sleep(0.3)
        assert not result and len(engine.scheduler.waiting) == 1  # waiting for memory, not refused
        held.release()
        waiter.join(30)
        assert result and len(result[0].tokens) == 20
        idle(cache)
    with make(100, batching=True, wait=0.3) as cache:
        with cache.store.ledger.reserve("serial", 60 * BPT):
            start = time.monotonic()
            with pytest.raises(KVMemoryError):
                cache.batcher.generate(prompt(1), SCOPE, SamplingParams(max_new_tokens=20), timeout=30)
            assert time.monotonic() - start < 2  # refused after the bounded wait
        idle(cache)
