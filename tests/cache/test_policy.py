"""Memory policy through the SDK: the budget under many requests with aborts, the TTL
sweeper, admission, and pressure that never fails a request."""
from __future__ import annotations

import random
import time

import pytest
import torch

from prefixcache import CacheConfig, PrefixCache
from prefixcache.errors import EngineFaultError
from tests.conftest import untouched


class Abort(RuntimeError):
    pass


def test_thousand_requests_with_random_aborts(llama, new_cache):
    per_token = new_cache(llama, None, start_sweeper=False).bytes_per_token
    cache = new_cache(llama, None, CacheConfig(block_size=4, max_bytes=per_token * 300), start_sweeper=False)
    rng = random.Random(0)
    bases = [[rng.randrange(2, 300) for _ in range(40)] for _ in range(5)]
    aborted = completed = 0
    for _ in range(1000):
        tokens = rng.choice(bases)[: rng.randrange(1, 41)] + [rng.randrange(2, 300) for _ in range(rng.randrange(0, 6))]
        mode = rng.random()
        hook = None
        kwargs = {}
        if mode < 0.1:  # raise inside the prefill forward
            def boom(*_a, **_k):
                raise Abort("prefill")
            hook = llama.model.layers[1].register_forward_pre_hook(boom)
        elif mode < 0.2:  # raise mid-decode, after the first token
            calls = []

            def late(input_ids, scores):
                calls.append(1)
                if len(calls) == 2:
                    raise Abort("decode")
                return scores
            kwargs["logits_processor"] = [late]
        try:
            cache.generate(torch.tensor([tokens]), max_new_tokens=3, do_sample=False, **kwargs)
            completed += 1
        except (Abort, EngineFaultError) as exc:  # the batching engine reports a failed step as a fault
            assert isinstance(exc, Abort) or isinstance(exc.__cause__, Abort)
            aborted += 1
        finally:
            if hook is not None:
                hook.remove()
        assert cache.store.bytes <= per_token * 300
    assert aborted > 150 and completed > 700
    cache.check_integrity()  # bytes == bytes of the live snapshots
    nodes = list(cache.store.trie.iter_nodes())
    assert all(n.refcount == 0 for n in nodes) and all(r.refcount == 0 for r in cache.store.trie.roots())
    # Blocks stored together view one run tensor: count each distinct storage once.
    storages = {n.kv.untyped_storage().data_ptr(): n.kv.untyped_storage().nbytes() for n in nodes}
    assert cache.stats()["bytes"] == sum(storages.values()) > 0
    assert cache.stats()["evictions"]["lru"] > 0
    cache.flush()
    assert cache.stats()["bytes"] == 0 and cache.stats()["entries"] == 0


def test_background_sweeper_frees_expired_prefixes(llama, clock):
    cache = PrefixCache(llama, None, CacheConfig(ttl_seconds=5, sweep_interval_seconds=0.02), clock=clock)
    try:
        cache.generate(torch.tensor([list(range(10, 50))]), max_new_tokens=2, do_sample=False)
        assert cache.stats()["bytes"] > 0
        clock.advance(6)
        deadline = time.monotonic() + 5
        while cache.stats()["bytes"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cache.stats()["bytes"] == 0 and cache.stats()["evictions"]["ttl"] > 0
    finally:
        cache.close()


def test_admission_check(llama, new_cache):
    per_token = new_cache(llama, None, start_sweeper=False).bytes_per_token
    cache = new_cache(llama, None, CacheConfig(max_bytes=per_token * 100), start_sweeper=False)
    assert cache.can_admit(100) and not cache.can_admit(101)
    cache.warm(list(range(10, 70)), pin=True, privileged=True)  # the operator: no pin quota
    assert cache.can_admit(40) and not cache.can_admit(41)


@pytest.mark.parametrize("budget_tokens", [0, 3])
def test_budget_smaller_than_one_snapshot_serves_uncached(llama, budget_tokens, new_cache):
    per_token = new_cache(llama, None, start_sweeper=False).bytes_per_token
    cache = new_cache(llama, None, CacheConfig(max_bytes=per_token * budget_tokens), start_sweeper=False)
    prompt = torch.tensor([list(range(10, 40))])
    expected = untouched(llama).generate(prompt, max_new_tokens=3, do_sample=False)
    for _ in range(2):
        assert torch.equal(cache.generate(prompt, max_new_tokens=3, do_sample=False), expected)
        assert cache.last_call.cached_tokens <= budget_tokens
    assert cache.stats()["bytes"] <= per_token * budget_tokens
