"""Blended requests on the serial engine: share 1 is a full prefill token for token, chunks are per tenant,
reused anywhere and in any order, and only exact KV becomes a prefix."""
from __future__ import annotations

import pytest
import torch

from prefixcache.cache.hashing import BlockHasher
from prefixcache.cache.scope import Scope
from prefixcache.cache.store import KVStore
from prefixcache.config import CacheConfig
from prefixcache.serving.blend import FIRST_SIGHT, BlendRequest
from prefixcache.serving.serial import SerialEngine
from prefixcache.serving.stats import HitCounters
from tests.conftest import build_tiny, untouched

NEW = 12


@pytest.fixture
def engine(llama, clock):
    return SerialEngine(llama, KVStore(CacheConfig(block_size=8), BlockHasher(0), clock), clock)


def docs() -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    gen = torch.Generator().manual_seed(5)
    return tuple(torch.randint(2, 300, (n,), generator=gen).tolist() for n in (10, 40, 33, 29, 6))


def layout_of(*parts: list[int]) -> tuple[list[int], tuple[tuple[int, int], ...]]:
    """The prompt of ``parts`` (system, documents..., question) and the documents' spans."""
    prompt, spans = list(parts[0]), []
    for doc in parts[1:-1]:
        spans.append((len(prompt), len(prompt) + len(doc)))
        prompt += doc
    return prompt + list(parts[-1]), tuple(spans)


def run(engine, prompt, spans, share, tenant="a"):
    out, stats = engine.generate(torch.tensor([prompt]), Scope((tenant, "model"), tenant), None,
                                 {"max_new_tokens": NEW, "do_sample": False}, True,
                                 BlendRequest(spans, share) if spans else None)
    return out[0, len(prompt):].tolist(), stats


def reference(model, prompt) -> list[int]:
    out = untouched(model).generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_a_first_sight_is_prefilled_exactly_and_its_documents_stored_for_later(llama, engine):
    system, a, b, _, question = docs()
    prompt, spans = layout_of(system, a, b, question)
    tokens, stats = run(engine, prompt, spans, 0.15)
    assert tokens == reference(llama, prompt)  # nothing was stored to blend: a full prefill's answer
    assert stats.blend_reason == FIRST_SIGHT and stats.chunk_reused_tokens == stats.chunk_recomputed_tokens == 0
    assert stats.chunk_stored_tokens == len(a) + len(b)  # computed alone after the answer
    assert stats.stored_tokens == len(prompt) + NEW - 1  # exact KV: the whole prompt and answer are a prefix
    _, later = run(engine, *layout_of(question, b, a, system), 0.15)
    assert later.blend_reason is None and later.chunk_stored_tokens == 0
    assert later.chunk_reused_tokens + later.chunk_recomputed_tokens == len(a) + len(b)


def test_share_one_equals_full_prefill_token_for_token(llama, engine):
    system, a, b, c, question = docs()
    run(engine, *layout_of([1, 2, 3], a, b, c, question), 1.0)  # a first sight stores the documents
    for parts in ((system, a, b, question), (system, c, a, question), (system, b, c, a, question)):
        prompt, spans = layout_of(*parts)
        tokens, stats = run(engine, prompt, spans, 1.0)
        assert tokens == reference(llama, prompt)
        assert stats.chunk_reused_tokens == 0 and stats.blend_reason is None
        assert stats.chunk_recomputed_tokens == sum(e - s for s, e in spans) - (
            len(system) if stats.cached_tokens >= spans[0][1] else 0)


def test_documents_are_reused_in_any_order_and_only_exact_kv_is_a_prefix(llama, engine):
    system, a, b, c, question = docs()
    run(engine, *layout_of([1, 2, 3], a, b, question), 0.15)  # a first sight stores a and b
    first, spans = layout_of(system, a, b, question)
    _, stats = run(engine, first, spans, 0.15)
    counters = HitCounters()  # what the dispatcher keeps of every call it serves
    counters.record("a", stats)
    assert (stats.chunk_stored_tokens, stats.chunk_reused_tokens + stats.chunk_recomputed_tokens) == (0, 73)
    # the system prompt and any recomputed run at the start of the first document: never reused KV, nor the answer
    assert spans[0][0] <= stats.stored_tokens < spans[0][1]
    second, spans = layout_of(system, b, c, a, question)
    tokens, stats = run(engine, second, spans, 0.15)
    counters.record("a", stats)
    assert stats.cached_tokens == len(system)  # prefix reuse first
    assert stats.chunk_stored_tokens == len(c)  # b and a found: computed alone once, reused at new positions
    assert stats.chunk_recomputed_tokens == sum(-(-(e - s) * 15 // 100) for s, e in [(0, 102)])
    assert stats.chunk_reused_tokens == 102 - stats.chunk_recomputed_tokens
    assert len(tokens) == NEW
    totals = counters.totals("a")
    assert totals["blended"] == 2 and totals["chunk_reused_tokens"] > 0


def test_a_chunk_of_another_tenant_is_never_used(engine):
    system, a, b, _, question = docs()
    prompt, spans = layout_of(system, a, b, question)
    other, other_spans = layout_of(system, b, a, question)
    run(engine, prompt, spans, 0.0, tenant="a")
    _, mine = run(engine, other, other_spans, 0.0, tenant="a")
    _, theirs = run(engine, other, other_spans, 0.0, tenant="b")
    assert mine.chunk_stored_tokens == 0 and mine.chunk_reused_tokens == len(a) + len(b)
    assert theirs.chunk_stored_tokens == len(a) + len(b)  # computed its own: tenant a's were not found


def test_a_repeated_prompt_reuses_its_blend_at_the_same_share_only(engine):
    system, a, b, _, question = docs()
    run(engine, *layout_of(question, b, a, system), 0.15)  # a first sight stores a and b
    prompt, spans = layout_of(system, a, b, question)
    first, stats = run(engine, prompt, spans, 0.15)
    assert stats.chunk_recomputed_tokens > 0
    again, repeat = run(engine, prompt, spans, 0.15)
    assert again == first  # the same KV: the blend kept from the first call
    assert (repeat.chunk_recomputed_tokens, repeat.chunk_stored_tokens) == (0, 0)
    assert repeat.cached_tokens + repeat.chunk_reused_tokens == len(prompt) - 1
    _, other_share = run(engine, prompt, spans, 0.3)
    assert other_share.chunk_recomputed_tokens > 0  # blended anew: another share's blend is not read


def test_a_model_that_cannot_move_keys_prefills_and_says_why(clock):
    gpt2 = build_tiny("gpt2")
    engine = SerialEngine(gpt2, KVStore(CacheConfig(block_size=8), BlockHasher(0), clock), clock)
    system, a, b, _, question = docs()
    prompt, spans = layout_of(system, a, b, question)
    tokens, stats = run(engine, prompt, spans, 0.15)
    assert "rotary" in stats.blend_reason and stats.chunk_reused_tokens == 0
    assert tokens == reference(gpt2, prompt)


def test_a_first_sight_whose_documents_cannot_be_stored_still_answers(llama, engine, monkeypatch, caplog):
    system, a, b, _, question = docs()
    prompt, spans = layout_of(system, a, b, question)

    def fail(*args, **kwargs):
        raise RuntimeError("no memory for the document")

    monkeypatch.setattr("prefixcache.serving.blend.compute_alone", fail)
    tokens, stats = run(engine, prompt, spans, 0.15)
    assert tokens == reference(llama, prompt) and stats.chunk_stored_tokens == 0
    assert "could not store a prompt's documents" in caplog.text
    monkeypatch.undo()
    _, again = run(engine, *layout_of(question, a, b, system), 0.15)  # nothing was stored: a first sight again
    assert again.blend_reason == FIRST_SIGHT and again.chunk_stored_tokens == len(a) + len(b)
