"""Prewarm: prefilled in chunks that publish the KV of one forward, cancellable between chunks,
refused before any work when a tenant's pin could never fit its pin quota."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from prefixcache import CacheConfig, PinQuotaExceededError, PrefixCache
from prefixcache.cache.scope import Scope
from prefixcache.errors import GenerationTimeoutError, RequestCancelledError
from tests.conftest import build_tiny, untouched

PREFIX = [(7 * i) % 300 + 2 for i in range(90)]


@pytest.fixture
def cache():
    with PrefixCache(build_tiny("llama-gqa"), None, CacheConfig(block_size=16), start_sweeper=False,
                     batching=False) as c:
        yield c


def stored_kv(cache: PrefixCache, tokens: list[int]) -> torch.Tensor:
    """The stored KV of ``tokens`` [L, 2, H, n, D] (all of it must be cached)."""
    lease = cache.store.acquire(Scope(cache.namespace("default"), "default"), tokens, len(tokens))
    try:
        assert lease.cached_tokens == len(tokens)
        return torch.cat([s.node.kv[:, :, :, : s.used] for s in lease.steps], dim=3).clone()
    finally:
        cache.store.release(lease)


def idle(cache: PrefixCache) -> None:
    cache.check_integrity()
    assert all(n.refcount == 0 for n in cache.store.trie.iter_nodes())


def count_forwards(model: torch.nn.Module, monkeypatch, on_call=None) -> list[int]:
    """Record the tokens of every forward of ``model``; ``on_call(calls)`` runs before each."""
    calls: list[int] = []
    real = model.forward

    def forward(*args, **kwargs):
        calls.append(int(kwargs["input_ids"].shape[1]))
        if on_call is not None:
            on_call(calls)
        return real(*args, **kwargs)
    monkeypatch.setattr(model, "forward", forward)
    return calls


def test_a_prewarm_in_chunks_stores_the_kv_of_one_forward(cache, monkeypatch):
    calls = count_forwards(cache.model, monkeypatch)
    cache.serial.prewarm_chunk = 16
    cache.warm(PREFIX)
    assert calls == [16] * 5 + [10]  # six chunks, not one forward
    chunked = stored_kv(cache, PREFIX)
    cache.flush()
    cache.serial.prewarm_chunk = 10_000
    cache.warm(PREFIX)
    assert calls[6:] == [90]
    # fp32: equal up to the rounding of attention over a different number of queries (~1e-7)
    torch.testing.assert_close(chunked, stored_kv(cache, PREFIX), rtol=0, atol=1e-5)
    # and the answer on top of it is the uncached answer
    prompt = torch.tensor([PREFIX + [5, 6, 7]])
    want = untouched(cache.model).generate(prompt, max_new_tokens=6, do_sample=False)
    cache.flush()
    cache.serial.prewarm_chunk = 16
    cache.warm(PREFIX)
    assert torch.equal(cache.generate(prompt, max_new_tokens=6, do_sample=False), want)
    assert cache.last_call.cached_tokens == len(PREFIX)
    idle(cache)


def test_a_cancelled_prewarm_stops_at_the_next_chunk_and_stores_nothing(cache, monkeypatch):
    cache.serial.prewarm_chunk = 16
    cache.warm(PREFIX[:20])  # an earlier prefix stays as it was
    before = cache.store.bytes
    cancel = threading.Event()
    calls = count_forwards(cache.model, monkeypatch, lambda c: cancel.set() if len(c) == 2 else None)
    with pytest.raises(RequestCancelledError):
        cache.warm(PREFIX, cancel=cancel, pin=True)
    assert calls == [16, 16]  # the chunk running when it was cancelled, and no more
    assert cache.store.bytes == before and cache.stats()["pinned_bytes"] == 0
    idle(cache)


def test_a_prewarm_past_its_timeout_stops_within_a_chunk_and_stores_nothing(cache, monkeypatch):
    calls = count_forwards(cache.model, monkeypatch, lambda c: time.sleep(0.1))
    cache.serial.prewarm_chunk = 4
    start = time.monotonic()
    with pytest.raises(GenerationTimeoutError):
        cache.warm(PREFIX, timeout_seconds=0.3)
    assert time.monotonic() - start < 1.5 and 2 <= len(calls) < len(PREFIX) // 4
    assert cache.store.bytes == 0
    idle(cache)


def test_a_tenant_pin_larger_than_its_pin_quota_is_refused_before_any_work(monkeypatch):
    model = build_tiny("llama-gqa")
    with PrefixCache(model, None, CacheConfig(block_size=16, max_bytes=1 << 20, tenant_pin_quota_bytes=4096),
                     start_sweeper=False, batching=False) as cache:
        calls = count_forwards(model, monkeypatch)
        with pytest.raises(PinQuotaExceededError):
            cache.warm(PREFIX, pin=True, tenant="t")
        assert calls == [] and cache.store.bytes == 0
        assert cache.warm(PREFIX, pin=True, tenant="t", privileged=True).stored_tokens == len(PREFIX)
