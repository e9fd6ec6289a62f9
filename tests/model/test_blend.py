"""Chunk blending at the model level: re-rotation is exact, the selection pass, and share 1 is a full prefill."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from prefixcache.cache.hashing import BlockHasher
from prefixcache.cache.scope import Scope
from prefixcache.cache.store import KVStore
from prefixcache.config import CacheConfig
from prefixcache.errors import UnsupportedModelError
from prefixcache.model.blend import kv_deviation, recompute_count, rerotate, select_recompute
from prefixcache.model.hf_cache import (
    WorkingCache,
    check_rerotation,
    compute_alone,
    probe_layout,
    rerotation_error,
    rotary_shift,
)
from prefixcache.serving.blend import CHUNK_PART, Blender, BlendRequest
from tests.conftest import FakeClock, build_tiny

NS = ("tenant-a", "model")
SCOPE = Scope(NS, "a")


@pytest.fixture(scope="module")
def model():
    return build_tiny("llama-gqa", seed=3)


@pytest.fixture
def blender(model, clock):
    store = KVStore(CacheConfig(block_size=8), BlockHasher(0), clock)
    blender = Blender(model, probe_layout(model), store)
    assert blender.prepare() is None
    return blender


@pytest.mark.parametrize("arch", ["llama-gqa", "qwen2", "mistral"])
@pytest.mark.parametrize("delta", [1, 37, 700])
def test_a_chunk_computed_at_zero_and_moved_equals_it_computed_in_place(arch, delta):
    """float32, before any recompute: every layer's keys and values, to float rounding."""
    model = build_tiny(arch)
    layout = probe_layout(model)
    ids = [int(t) for t in torch.randint(2, 300, (24,), generator=torch.Generator().manual_seed(delta))]
    at_zero = compute_alone(model, layout, ids).slice(0, len(ids))
    in_place = compute_alone(model, layout, ids, start=delta).slice(0, len(ids))
    moved = rerotate(at_zero, delta, rotary_shift(model))
    assert at_zero.dtype == torch.float32
    assert not torch.allclose(at_zero[:, 0], in_place[:, 0], atol=1e-3)  # the keys did move
    torch.testing.assert_close(moved, in_place, rtol=0, atol=2e-5 * float(in_place.abs().max()))
    assert rerotation_error(model, layout, rotary_shift(model), ids, delta) < 1e-5


def test_absolute_positions_cannot_be_rerotated(blender):
    gpt2 = build_tiny("gpt2")
    with pytest.raises(UnsupportedModelError, match="rotary"):
        rotary_shift(gpt2)
    other = Blender(gpt2, probe_layout(gpt2), blender.store)
    assert "rotary" in other.prepare() and other.shift is None
    assert gpt2.config._attn_implementation != "prefixcache_cascade"  # left alone


def test_selection_takes_the_share_that_deviates_most():
    old = torch.zeros(2, 2, 5, 4)
    new = old.clone()
    new[0, :, 3] = 3.0
    new[1, :, 1] = 2.0
    new[0, 0, 4] = 1.0
    dev = kv_deviation(old, new)
    assert dev.argmax() == 3
    positions = torch.tensor([10, 11, 12, 13, 14])
    assert select_recompute(dev, positions, 0.4).tolist() == [11, 13]
    assert select_recompute(dev, positions, 0.0).tolist() == []
    assert select_recompute(dev, positions, 1.0).tolist() == [10, 11, 12, 13, 14]
    assert [recompute_count(100, s) for s in (0, 0.05, 0.15, 0.151, 1)] == [0, 5, 15, 16, 100]


def _prompt() -> tuple[list[int], tuple[tuple[int, int], ...]]:
    gen = torch.Generator().manual_seed(1)
    head, doc_a, doc_b, tail = (torch.randint(2, 300, (n,), generator=gen).tolist() for n in (6, 20, 17, 5))
    prompt = head + doc_a + doc_b + tail
    return prompt, ((6, 26), (26, 43))


def _full_kv(model, prompt):
    layout = probe_layout(model)
    return compute_alone(model, layout, prompt[:-1]).slice(0, len(prompt) - 1)


def test_share_one_recomputes_everything_and_equals_a_full_prefill(model, blender):
    prompt, chunks = _prompt()
    lease = blender.store.acquire(SCOPE, prompt, len(prompt) - 1)
    out = blender.build(prompt, BlendRequest(chunks, 1.0), lease, SCOPE)
    blender.store.release(lease)
    assert (out.reused, out.recomputed, out.stored, out.exact) == (0, 37, 37, len(prompt) - 1)
    full = _full_kv(model, prompt)
    torch.testing.assert_close(out.buffer, full, rtol=0, atol=1e-5 * float(full.abs().max()))


def test_a_blend_built_with_room_is_adopted_as_the_working_cache_without_a_copy(model, blender):
    """The buffer a blend writes is the working cache the answer grows in: decoding after it equals
    decoding after a full prefill, and needs no new buffer while the room lasts."""
    prompt, chunks = _prompt()
    layout = probe_layout(model)
    lease = blender.store.acquire(SCOPE, prompt, len(prompt) - 1)
    out = blender.build(prompt, BlendRequest(chunks, 1.0), lease, SCOPE, room=len(prompt) + 4)
    blender.store.release(lease)
    n = len(prompt) - 1
    assert out.buffer.shape[3] == n + 5
    cache = WorkingCache.adopt(layout, out.buffer, n)
    assert cache.length == n and cache.buffer_bytes == out.buffer.untyped_storage().nbytes()
    full = compute_alone(model, layout, prompt[:-1])
    with torch.no_grad():
        got = model(input_ids=torch.tensor([prompt[-1:] + [7, 8]]), past_key_values=cache).logits
        want = model(input_ids=torch.tensor([prompt[-1:] + [7, 8]]), past_key_values=full).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert cache.length == n + 3 and cache.reserve(n + 3).data_ptr() == out.buffer.data_ptr()  # written in place
    with pytest.raises(ValueError, match="cannot adopt"):
        WorkingCache.adopt(layout, out.buffer, n + 6)
    with pytest.raises(ValueError, match="cannot adopt"):
        WorkingCache.adopt(layout, out.buffer[:1], n)


def test_share_zero_keeps_the_chunks_kv_and_a_share_recomputes_some(model, blender):
    prompt, chunks = _prompt()
    shift = rotary_shift(model)
    layout = probe_layout(model)
    lease = blender.store.acquire(SCOPE, prompt, len(prompt) - 1)
    out = blender.build(prompt, BlendRequest(chunks, 0.0), lease, SCOPE)
    assert (out.reused, out.recomputed, out.stored, out.exact) == (37, 0, 37, 6)
    for s, e in chunks:  # as stored (computed alone), moved: no layer recomputed
        alone = compute_alone(model, layout, prompt[s:e]).slice(0, e - s)
        torch.testing.assert_close(out.buffer[:, :, :, s:e], rerotate(alone, s, shift), rtol=0, atol=1e-6)
    full = _full_kv(model, prompt)
    again = blender.build(prompt, BlendRequest(chunks, 0.3), lease, SCOPE)
    blender.store.release(lease)
    assert (again.reused, again.recomputed, again.stored) == (25, 12, 0)  # found in the store this time
    err0 = (out.buffer[:, :, :, 6:] - full[:, :, :, 6:]).abs().max()
    err3 = (again.buffer[:, :, :, 6:] - full[:, :, :, 6:]).abs().max()
    assert err3 < err0
    # the prefix before the first chunk, and the tokens after the chunks, are computed in context
    torch.testing.assert_close(again.buffer[:, :, :, :6], full[:, :, :, :6], rtol=0, atol=1e-5)


def test_a_chunk_is_stored_per_namespace(blender):
    prompt, chunks = _prompt()
    lease = blender.store.acquire(SCOPE, prompt, len(prompt) - 1)
    blender.build(prompt, BlendRequest(chunks, 0.15), lease, SCOPE)
    blender.store.release(lease)
    s, e = chunks[0]
    mine = blender.store.acquire(SCOPE.within(CHUNK_PART), prompt[s:e], e - s)
    theirs = blender.store.acquire(Scope(("tenant-b", "model", CHUNK_PART), "b"), prompt[s:e], e - s)
    assert (mine.cached_tokens, theirs.cached_tokens) == (e - s, 0)
    blender.store.release(mine)
    blender.store.release(theirs)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_layout_of_documents_blends_consistently(model, data):
    """Random prompts, document spans (touching, at either end, cut by a cached prefix) and shares: the counts
    add up to the document tokens after the prefix, the part reported exact equals a full prefill, share 1 is
    a full prefill everywhere, and share 0 leaves each document's placed tokens as computed alone."""
    layout, shift = probe_layout(model), rotary_shift(model)
    store = KVStore(CacheConfig(block_size=8), BlockHasher(0), FakeClock())
    blender = Blender(model, layout, store)
    assert blender.prepare() is None
    n = data.draw(st.integers(10, 40), label="n")
    prompt = data.draw(st.lists(st.integers(2, 299), min_size=n, max_size=n), label="prompt")
    cuts = sorted(data.draw(st.sets(st.integers(0, n), min_size=2, max_size=8), label="cuts"))
    spans = tuple(zip(cuts[::2], cuts[1::2]))
    share = data.draw(st.sampled_from([0.0, 0.3, 1.0]), label="share")
    full = _full_kv(model, prompt)
    cached = data.draw(st.sampled_from([0, 8, 16]), label="cached")
    if 0 < cached < n - 1:
        store.insert(SCOPE, prompt[:cached], lambda a, b: full[:, :, :, a:b].clone())
    lease = store.acquire(SCOPE, prompt, n - 1)
    cached = lease.cached_tokens
    try:
        out = blender.build(prompt, BlendRequest(spans, share), lease, SCOPE)
    finally:
        store.release(lease)
    end = n - 1
    placed = [(max(s, cached), min(e, end), s, e) for s, e in spans if min(e, end) > max(s, cached)]
    event(f"cached {cached}, {'blended' if placed else 'no document after it'}")
    if not placed:
        assert out is None
        return
    total = sum(hi - lo for lo, hi, _, _ in placed)
    assert out.reused + out.recomputed == total and out.recomputed == recompute_count(total, share)
    assert cached <= out.exact <= end and out.buffer.shape[3] == end
    tol = 2e-5 * float(full.abs().max())
    torch.testing.assert_close(out.buffer[:, :, :, : out.exact], full[:, :, :, : out.exact], rtol=0, atol=tol)
    if share == 1.0:
        assert out.exact == end
    if share == 0.0:
        for lo, hi, s, e in placed:
            alone = rerotate(compute_alone(model, layout, prompt[s:e]).slice(0, e - s), s, shift)
            torch.testing.assert_close(out.buffer[:, :, :, lo:hi], alone[:, :, :, lo - s : hi - s], rtol=0, atol=tol)


def _yarn(dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024})
    return LlamaForCausalLM(config).eval().to(dtype)


def test_a_scaled_rotary_embedding_is_moved_by_the_rotation_alone():
    """YaRN scales cos and sin (attention_scaling): stored keys carry it once, so the shift must not again."""
    model = _yarn(torch.float32)
    assert rotary_shift(model) is not None and getattr(model.model.rotary_emb, "attention_scaling", 1.0) > 1.05
    layout = probe_layout(model)
    ids = [int(t) for t in torch.randint(2, 300, (16,), generator=torch.Generator().manual_seed(2))]
    assert rerotation_error(model, layout, rotary_shift(model), ids, 509) < 1e-5
    assert check_rerotation(model, layout) is not None


def test_the_rerotation_check_refuses_a_scale_applied_twice_in_bfloat16(monkeypatch):
    """The tolerance is a few eps of the dtype: a 14 % error (a scale applied twice) is refused in bfloat16."""
    import prefixcache.model.hf_cache as hf_cache

    model = _yarn(torch.bfloat16)
    layout = probe_layout(model)
    assert check_rerotation(model, layout) is not None  # the true shift passes in bfloat16
    honest = hf_cache.rotary_shift

    def twice(m):
        shift = honest(m)
        return lambda delta: tuple(x * 1.14 for x in shift(delta))

    monkeypatch.setattr(hf_cache, "rotary_shift", twice)
    with pytest.raises(UnsupportedModelError, match="differ"):
        check_rerotation(model, layout)


def test_a_check_that_fails_for_another_reason_prefills_now_and_checks_again_later(model, clock, monkeypatch):
    import prefixcache.serving.blend as serving_blend

    store = KVStore(CacheConfig(block_size=8), BlockHasher(0), clock)
    blender = Blender(model, probe_layout(model), store)

    def out_of_memory(*args):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(serving_blend, "check_rerotation", out_of_memory)
    reason = blender.prepare()
    assert reason.startswith(serving_blend.CHECK_FAILED) and "out of memory" in reason
    assert "model not supported" not in reason  # said as it is: the model may well be supported
    monkeypatch.undo()
    assert blender.prepare() is None and blender.shift is not None  # checked again, and it passes
