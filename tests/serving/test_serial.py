"""Engine behaviour: suffix-only prefill, immutable snapshots, isolation, bypasses."""
from __future__ import annotations

import threading

import pytest
import torch
from transformers import DynamicCache

from prefixcache import CacheConfig, InvalidRequestError, PrefixCache
from prefixcache.cache.scope import Scope
from prefixcache.loading import model_fingerprint
from tests.conftest import build_tiny, untouched


def forwarded_tokens(model):
    """Record how many tokens each forward call of ``model`` receives."""
    seen: list[int] = []
    handle = model.register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append((kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).shape[-1]),
        with_kwargs=True)
    return seen, handle


def test_hit_forwards_only_the_suffix(llama, new_cache):
    cache = new_cache(llama, None, CacheConfig(block_size=8), start_sweeper=False)
    system = list(range(5, 105))
    cache.generate(torch.tensor([system + [200, 201]]), max_new_tokens=3, do_sample=False)
    prompt = system + [210, 211, 212, 213, 214, 215, 216]
    seen, handle = forwarded_tokens(llama)
    try:
        cache.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False)
    finally:
        handle.remove()
    cached = cache.last_call.cached_tokens
    assert cached == len(system)  # token-granular: the whole shared system prompt, not a block multiple
    assert seen[0] == len(prompt) - cached  # prefill forwards only the suffix
    assert seen[1:] == [1, 1]  # then one token per decode step


def test_exact_repeat_recomputes_only_last_token(llama, new_cache):
    cache = new_cache(llama, None, start_sweeper=False)
    prompt = torch.tensor([list(range(30, 90))])
    cache.generate(prompt, max_new_tokens=2, do_sample=False)
    seen, handle = forwarded_tokens(llama)
    try:
        cache.generate(prompt, max_new_tokens=2, do_sample=False)
    finally:
        handle.remove()
    assert cache.last_call.cached_tokens == 59 and seen[0] == 1


def _checksums(cache: PrefixCache) -> dict[int, torch.Tensor]:
    return {id(n): n.kv.clone() for n in cache.store.trie.iter_nodes()}


def test_snapshots_unchanged_after_reuse_including_threads(llama, new_cache):
    cache = new_cache(llama, None, CacheConfig(block_size=8, cache_generated=False), start_sweeper=False)
    system = list(range(40, 140))
    cache.warm(system)
    before = _checksums(cache)
    prompts = [system + [150 + i % 7, 151] for i in range(50)]

    def reuse(chunk):
        for p in chunk:
            cache.generate(torch.tensor([p]), max_new_tokens=3, do_sample=False)
            assert cache.last_call.cached_tokens >= len(system)

    reuse(prompts[:20])
    threads = [threading.Thread(target=reuse, args=(prompts[20 + 10 * k: 30 + 10 * k],)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = {id(n): n for n in cache.store.trie.iter_nodes()}
    for key, snapshot in before.items():
        assert key in after and torch.equal(after[key].kv, snapshot), "a published snapshot changed"
    assert all(n.refcount == 0 for n in after.values())
    cache.check_integrity()


def test_other_tenant_gets_nothing(llama, new_cache):
    cache = new_cache(llama, None, start_sweeper=False)
    prompt = torch.tensor([list(range(10, 80))])
    cache.generate(prompt, max_new_tokens=2, do_sample=False, tenant="acme")
    cache.generate(prompt, max_new_tokens=2, do_sample=False, tenant="globex")
    assert cache.last_call.cached_tokens == 0
    cache.generate(prompt, max_new_tokens=2, do_sample=False, tenant="acme")
    assert cache.last_call.cached_tokens == 69
    assert cache.stats("globex")["hits"] == 0 and cache.stats("acme")["hits"] == 1


def test_other_model_revision_gets_nothing(llama, new_cache):
    """Same tokens, same store, another revision of the weights: no KV is shared."""
    other = build_tiny("llama-gqa", seed=1)
    assert model_fingerprint(other) != model_fingerprint(llama)
    cache = new_cache(llama, None, start_sweeper=False)
    tokens = list(range(10, 80))
    cache.warm(tokens)
    foreign = ("default", *model_fingerprint(other), cache.namespace("default")[-1])
    lease = cache.store.acquire(Scope(foreign, "default"), tokens, len(tokens) - 1)
    assert lease.cached_tokens == 0
    cache.store.release(lease)
    lease = cache.store.acquire(Scope(cache.namespace("default"), "default"), tokens, len(tokens) - 1)
    assert lease.cached_tokens == len(tokens) - 1
    cache.store.release(lease)


def test_namespace_parts_cannot_alias(llama, new_cache):
    """("a", "bc") and ("ab", "c") join to one string. Roots differ by hash (length prefixes),
    and with every hash colliding the namespace tuple still keeps them apart."""
    cache = new_cache(llama, None, CacheConfig(namespace_extra=("a", "bc")), start_sweeper=False)
    assert cache.store.trie.hasher.root(("a", "bc")) != cache.store.trie.hasher.root(("ab", "c"))
    colliding = new_cache(llama, None, CacheConfig(namespace_extra=("a", "bc")), hash_fn=lambda data, seed: 7,
                            start_sweeper=False)
    tokens = list(range(10, 50))
    colliding.warm(tokens)
    own = colliding.namespace("default")
    aliased = (*own[:-2], "ab", "c")
    assert "".join(own) == "".join(aliased)
    for namespace, expect in ((aliased, 0), (own, len(tokens) - 1)):
        lease = colliding.store.acquire(Scope(namespace, "default"), tokens, len(tokens) - 1)
        assert lease.cached_tokens == expect
        colliding.store.release(lease)


def test_options_the_cache_cannot_serve_bypass_it(llama, new_cache):
    cache = new_cache(llama, None, start_sweeper=False)
    prompt = torch.tensor([list(range(10, 40))])
    cache.generate(prompt, max_new_tokens=2, do_sample=False)
    expected = untouched(llama).generate(prompt, max_new_tokens=3, num_beams=2, do_sample=False)
    got = cache.generate(prompt, max_new_tokens=3, num_beams=2, do_sample=False)
    assert torch.equal(expected, got)
    assert "num_beams" in cache.last_call.bypass_reason and cache.last_call.cached_tokens == 0
    assert cache.stats()["bypassed"] == 1


def test_return_dict_and_scores_match(llama, new_cache):
    cache = new_cache(llama, None, start_sweeper=False)
    prompt = torch.tensor([list(range(10, 60))])
    cache.generate(prompt, max_new_tokens=2, do_sample=False)
    kw = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_scores=True)
    ref, got = untouched(llama).generate(prompt, **kw), cache.generate(prompt, **kw)
    assert cache.last_call.cached_tokens == 49
    assert torch.equal(ref.sequences, got.sequences)
    for a, b in zip(ref.scores, got.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_return_dict_holds_a_dynamic_cache_of_its_own_as_generate_does(tiny_model, new_cache):
    """The output's cache is what generate() returns (a ``DynamicCache`` with the same layers and KV), its tensors
    the caller's own (the engine's working buffer is freed, as its reservation is), and it continues generation
    token for token as generate()'s does."""
    cache = new_cache(tiny_model, None, CacheConfig(block_size=8, max_kv_bytes_total=1 << 20), start_sweeper=False)
    prompt = torch.tensor([list(range(10, 50))])
    cache.generate(prompt, max_new_tokens=2, do_sample=False)
    kw = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_scores=True, output_logits=True)
    ref = untouched(tiny_model)
    want, got = ref.generate(prompt, **kw), cache.generate(prompt, **kw)
    assert cache.last_call.cached_tokens == 39 and sorted(got.keys()) == sorted(want.keys())
    assert cache.store.ledger.held()["serial"] == 0
    got_kv, want_kv = got.past_key_values, want.past_key_values
    assert type(got_kv) is type(want_kv) is DynamicCache
    assert [type(layer) for layer in got_kv.layers] == [type(layer) for layer in want_kv.layers]
    assert got_kv.get_seq_length() == want_kv.get_seq_length() == prompt.shape[1] + 4
    for mine, theirs in zip(got_kv.layers, want_kv.layers):
        for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
            assert a.untyped_storage().nbytes() == a.numel() * a.element_size()  # no view into a larger buffer
    more = torch.cat([got.sequences, torch.tensor([[7, 8, 9]])], dim=1)
    assert torch.equal(ref.generate(more, past_key_values=got_kv, max_new_tokens=6, do_sample=False),
                       ref.generate(more, past_key_values=want_kv, max_new_tokens=6, do_sample=False))


def test_padded_batch_rows_equal_single_prompts(llama, new_cache):
    cache = new_cache(llama, None, start_sweeper=False)
    rows = [list(range(10, 40)), list(range(10, 30)) + [99, 98]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    out = cache.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert out.shape[0] == 2 and torch.equal(out[:, :width], ids)
    for i, r in enumerate(rows):
        single = untouched(llama).generate(torch.tensor([r]), max_new_tokens=4, do_sample=False)[0, len(r):]
        assert torch.equal(out[i, width: width + len(single)], single)
    with pytest.raises(InvalidRequestError, match="batch size 1"):
        cache.generate(ids, attention_mask=mask, max_new_tokens=2, return_dict_in_generate=True)


def test_a_padded_batch_is_refused_when_the_model_s_own_config_returns_a_dict(new_cache):
    """``return_dict_in_generate`` set in the model's generation config, not the call's: a padded batch gets
    the same clear error as when the call sets it."""
    model = build_tiny("llama-gqa")
    model.generation_config.return_dict_in_generate = True
    cache = new_cache(model, None, start_sweeper=False)
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    with pytest.raises(InvalidRequestError, match="batch size 1"):
        cache.generate(ids, attention_mask=mask, max_new_tokens=2)


@pytest.mark.parametrize("bad", [[], [[]], [[1, 2], [3]], [[-1, 2]], [[10**9]], "text"])
def test_bad_input_ids_raise_clear_errors(llama, bad, new_cache):
    cache = new_cache(llama, None, start_sweeper=False)
    with pytest.raises(InvalidRequestError):
        cache.generate(bad, max_new_tokens=2)


def test_exception_mid_generation_releases_pins(llama, new_cache):
    cache = new_cache(llama, None, start_sweeper=False)
    prompt = torch.tensor([list(range(10, 60))])
    cache.generate(prompt, max_new_tokens=2, do_sample=False)

    class Boom(RuntimeError):
        pass

    def explode(input_ids, scores):
        raise Boom("mid-decode")

    with pytest.raises(Boom):
        cache.generate(prompt, max_new_tokens=4, do_sample=False, logits_processor=[explode])
    assert all(n.refcount == 0 for n in cache.store.trie.iter_nodes())
    cache.check_integrity()


def test_a_call_never_changes_the_models_generation_config(llama, new_cache, monkeypatch):
    """The effective config of a call is a copy: its options (top-level and list-valued) stay its own."""
    config = llama.generation_config
    monkeypatch.setattr(config, "eos_token_id", [7, 8])  # the fixture's model is shared: restored after
    before = config.to_dict()
    cache = new_cache(llama, None, CacheConfig(block_size=8), start_sweeper=False)
    effective = cache.serial.effective_config(None, {"max_new_tokens": 3, "eos_token_id": [9], "temperature": 0.5})
    assert (effective.max_new_tokens, effective.eos_token_id, effective.temperature) == (3, [9], 0.5)
    cache.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=2, do_sample=False, eos_token_id=[3, 4])
    assert config.to_dict() == before and config.eos_token_id == [7, 8]
