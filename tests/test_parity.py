"""Cached greedy output equals plain model.generate(), token for token."""
from __future__ import annotations

import threading

import pytest
import torch

from prefixcache import CacheConfig, PrefixCache
from tests.conftest import TINY_VOCAB, build_tiny, untouched
from tests.workloads import prompt_stream

NEW_TOKENS = 5


def run_parity(model, cache: PrefixCache, seed: int, count: int, vocab: tuple[int, int], max_len: int = 120,
               new_tokens: int = NEW_TOKENS, expect_hits: bool = True) -> dict[str, int]:
    """Drive ``count`` prompts through both paths; return cached tokens per kind."""
    stream = prompt_stream(seed, vocab, count, max_len)
    prompt = next(stream)
    cached_by_kind: dict[str, int] = {}
    reference = untouched(model)  # the cache switched ``model``'s attention; the copy made before did not
    for _ in range(count):
        ids = torch.tensor([prompt.tokens])
        ref = reference.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        got = cache.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        assert torch.equal(ref, got), f"{prompt.kind} prompt of {len(prompt.tokens)} tokens diverged"
        info = cache.last_call
        assert info.bypass_reason is None
        if expect_hits:  # what was just stored is found again (no eviction in between)
            assert info.cached_tokens >= prompt.expect_cached_at_least, prompt.kind
        assert info.cached_tokens <= len(prompt.tokens) - 1  # the last prompt token is always recomputed
        cached_by_kind[prompt.kind] = cached_by_kind.get(prompt.kind, 0) + info.cached_tokens
        cache.check_integrity()
        try:
            prompt = stream.send(got[0, ids.shape[1]:].tolist())
        except StopIteration:
            break
    return cached_by_kind


def test_parity_tiny_architectures(tiny_model):
    check_architecture(tiny_model, block_size=16, seed=1)


def test_parity_odd_block_size():
    """A block size that does not divide any prompt length: tails end inside blocks everywhere."""
    check_architecture(build_tiny("qwen2", seed=2), block_size=5, seed=2)


def check_architecture(model, block_size: int, seed: int) -> None:
    with PrefixCache(model, None, CacheConfig(block_size=block_size), start_sweeper=False) as cache:
        cached = run_parity(model, cache, seed=seed, count=60, vocab=(2, TINY_VOCAB))
        # Every kind of sharing produced real reuse, not just exact repeats.
        for kind in ("exact", "strict-prefix", "shared-base", "continuation"):
            assert cached.get(kind, 0) > 0, f"no reuse for {kind}: {cached}"
        stats = cache.stats()
        assert stats["queries"] == 60 and stats["cached_tokens"] > 0
        assert all(n.refcount == 0 for n in cache.store.trie.iter_nodes())


def test_parity_with_constant_hash(llama, new_cache):
    """Every block collides: token comparison alone keeps answers right."""
    cache = new_cache(llama, None, CacheConfig(block_size=4), hash_fn=lambda data, seed: 7, start_sweeper=False)
    cached = run_parity(llama, cache, seed=3, count=50, vocab=(2, TINY_VOCAB))
    assert sum(cached.values()) > 0


def test_parity_under_constant_eviction(llama, new_cache):
    """A budget of a few blocks forces evictions on nearly every insert; answers stay exact."""
    per_token = new_cache(llama, None, start_sweeper=False).bytes_per_token
    cache = new_cache(llama, None, CacheConfig(block_size=8, max_bytes=per_token * 40), start_sweeper=False)
    cached = run_parity(llama, cache, seed=5, count=50, vocab=(2, TINY_VOCAB), expect_hits=False)
    stats = cache.stats()
    assert stats["evictions"]["lru"] > 10
    assert stats["bytes"] <= per_token * 40
    # evicting all the time still leaves what fits: some requests reused KV, with exact answers
    assert sum(cached.values()) > 0 and stats["hits"] + stats["partial_hits"] > 0, (cached, stats)
    # a prompt that fits the budget, asked twice in a row, hits on the second call
    prompt = torch.tensor([list(range(150, 180))])
    want = untouched(llama).generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    for expect_cached in (0, 29):
        assert torch.equal(cache.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False), want)
        assert cache.last_call.cached_tokens >= expect_cached
    assert cache.last_call.cached_tokens == 29
    cache.check_integrity()


def test_parity_concurrent_threads(llama, new_cache):
    """Callers on several threads share prefixes; each gets the uncached answer."""
    cache = new_cache(llama, None, CacheConfig(block_size=8), start_sweeper=False)
    base = list(range(10, 70))
    prompts = [base[: 20 + 3 * i] + [100 + i] * (i % 4 + 1) for i in range(12)]
    expected = [untouched(llama).generate(torch.tensor([p]), max_new_tokens=6, do_sample=False) for p in prompts]
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def worker(indices):
        try:
            for i in indices:
                results[i] = cache.generate(torch.tensor([prompts[i]]), max_new_tokens=6, do_sample=False)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(range(k, 12, 3),)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, exp in enumerate(expected):
        assert torch.equal(results[i], exp)
    cache.check_integrity()
    assert cache.stats()["cached_tokens"] > 0


@pytest.mark.slow
def test_parity_default_model(default_model, new_cache):
    model, tokenizer = default_model
    cache = new_cache(model, tokenizer, CacheConfig(block_size=16), start_sweeper=False)
    # 20 prompts of the seeded stream hold every kind of sharing; each reused KV with exact answers.
    cached = run_parity(model, cache, seed=11, count=20, vocab=(100, 20000), max_len=64, new_tokens=5)
    for kind in ("exact", "strict-prefix", "shared-base", "continuation"):
        assert cached.get(kind, 0) > 0, f"no reuse for {kind}: {cached}"
