"""The SDK's documents: chat(documents=...), marked parts and text blocks, the switches, tenants, bad input."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache import CacheConfig, InvalidRequestError, PrefixCache
from prefixcache.serving.blend import BLEND_FAILED, BLEND_LOST, FIRST_SIGHT, blended_scope, with_documents
from tests.conftest import untouched

SYSTEM = {"role": "system", "content": "Answer from the documents."}
DOCS = ["The heron stands in the shallow water of the river at dawn, waiting. " * 4,
        "Granite forms when magma cools slowly deep below the surface of the earth. " * 4,
        "A sourdough starter is flour and water kept alive by wild yeast and bacteria. " * 4]
QUESTION = {"role": "user", "content": "Which document is about rocks?"}


@pytest.fixture
def cache(chat_llama, tokenizer, new_cache):
    return new_cache(chat_llama, tokenizer, CacheConfig(block_size=16), start_sweeper=False)


def doc_tokens(tokenizer, *docs: str) -> int:
    return sum(len(tokenizer(d, add_special_tokens=False)["input_ids"]) for d in docs)


def test_documents_are_reused_in_another_order(cache, tokenizer):
    first = cache.chat([SYSTEM, QUESTION], documents=DOCS[:2], max_new_tokens=4)
    assert first.stats.chunk_stored_tokens == doc_tokens(tokenizer, *DOCS[:2])  # a first sight: prefilled, stored
    assert first.stats.blend_reason == FIRST_SIGHT and first.stats.chunk_reused_tokens == 0
    second = cache.chat([SYSTEM, QUESTION], documents=[DOCS[2], DOCS[0]], max_new_tokens=4)
    assert second.stats.chunk_stored_tokens == doc_tokens(tokenizer, DOCS[2])  # DOCS[0] found, at a new place
    assert second.stats.chunk_reused_tokens + second.stats.chunk_recomputed_tokens == doc_tokens(tokenizer, DOCS[2], DOCS[0])
    assert second.stats.chunk_recomputed_tokens > 0 and second.stats.blend_reason is None
    stats = cache.stats()
    assert stats["chunk_reused_tokens"] >= second.stats.chunk_reused_tokens and stats["blended"] == 1


def test_full_recompute_answers_as_a_full_prefill(cache):
    """The same call with the documents prefilled (blend off) is the reference: tests/serving/test_blend.py
    compares the engine's blended answers with model.generate() itself."""
    messages = [SYSTEM, QUESTION]
    cache.chat(messages, documents=DOCS[:2], max_new_tokens=2)
    got = cache.chat(messages, documents=DOCS[1:], blend=1.0, max_new_tokens=10, ignore_eos=True)
    want = cache.chat(messages, documents=DOCS[1:], blend=False, max_new_tokens=10, ignore_eos=True)
    assert list(got.token_ids) == list(want.token_ids)
    assert got.stats.chunk_reused_tokens == 0 and got.stats.chunk_recomputed_tokens > 0
    assert want.stats.chunk_reused_tokens == want.stats.chunk_recomputed_tokens == 0


def test_blended_calls_on_the_batching_engine_answer_as_on_the_serial_one(chat_llama, tokenizer, new_cache):
    """The batching engine answers a blending call from the KV the serial engine blends: the same tokens and
    counts as the serial engine's own blended call; the exact namespace still holds exact KV only."""
    batched = new_cache(chat_llama, tokenizer, CacheConfig(block_size=16), start_sweeper=False)
    serial = new_cache(chat_llama, tokenizer, CacheConfig(block_size=16), start_sweeper=False, batching=False)
    assert batched.batcher is not None
    calls = [DOCS[:2], [DOCS[2], DOCS[0]], [DOCS[2], DOCS[0]], [DOCS[1], DOCS[2]]]  # first sight, blend, repeat, blend
    for documents in calls:
        got, want = (c.chat([SYSTEM, QUESTION], documents=documents, max_new_tokens=8, ignore_eos=True)
                     for c in (batched, serial))
        assert got.stats.executor == "batched" and want.stats.executor == "serial"
        assert list(got.token_ids) == list(want.token_ids)
        for field in ("cached_tokens", "chunk_reused_tokens", "chunk_recomputed_tokens", "chunk_stored_tokens",
                      "blend_reason"):
            assert getattr(got.stats, field) == getattr(want.stats, field), field
        assert got.stats.ttft_seconds >= got.stats.lookup_seconds > 0
    assert batched.stats()["blended"] == 3 and batched.stats()["chunk_reused_tokens"] > 0
    # Prefilled without blending, from the exact namespace only: a full prefill's answer.
    parts = [{"type": "text", "text": d, "prefixcache_chunk": True} for d in (DOCS[2], DOCS[0])]
    messages = [SYSTEM, {"role": "user", "content": [*parts, {"type": "text", "text": QUESTION["content"]}]}]
    ids = batched.canonicalizer.encode_chat(messages).token_ids
    plain = batched.chat(messages, blend=False, max_new_tokens=8, ignore_eos=True)
    reference = untouched(chat_llama).generate(torch.tensor([list(ids)]), max_new_tokens=8, min_new_tokens=8,
                                               do_sample=False)
    assert list(plain.token_ids) == reference[0, len(ids):].tolist()
    assert plain.stats.cached_tokens < len(ids) - 1  # the blended prompt was not read as exact KV


def test_the_next_turn_reuses_the_blended_prompt_and_answer_on_both_engines(chat_llama, tokenizer, new_cache):
    """A conversation's second turn (documents marked in its first) finds the first turn's blended prompt and
    answer in the blended scope: the same tokens and counts on either engine, and the answer's tokens reused."""
    parts = [{"type": "text", "text": d, "prefixcache_chunk": True} for d in (DOCS[2], DOCS[0])]
    turn = {"role": "user", "content": [*parts, {"type": "text", "text": QUESTION["content"]}]}
    seen = {}
    for batching in (True, False):
        cache = new_cache(chat_llama, tokenizer, CacheConfig(block_size=16), start_sweeper=False, batching=batching)
        cache.chat([SYSTEM, QUESTION], documents=DOCS[:2], max_new_tokens=2)  # a first sight stores the documents
        first = cache.chat([SYSTEM, turn], max_new_tokens=8, ignore_eos=True)
        follow = [SYSTEM, turn, {"role": "assistant", "content": first.text}, {"role": "user", "content": "And birds?"}]
        second = cache.chat(follow, max_new_tokens=8, ignore_eos=True)
        prompt = len(cache.canonicalizer.encode_chat([SYSTEM, turn]).token_ids)
        # the first turn's prompt and answer tokens, all from the blend: beyond its exact part and its documents
        assert second.stats.cached_tokens + second.stats.chunk_reused_tokens > prompt
        assert second.stats.chunk_recomputed_tokens == 0 and second.stats.blend_reason is None
        seen[batching] = [list(first.token_ids), list(second.token_ids), second.stats.cached_tokens,
                          second.stats.chunk_reused_tokens]
    assert seen[True] == seen[False]


def test_a_blend_evicted_before_the_batching_engine_reads_it_is_prefilled_and_said(chat_llama, tokenizer, new_cache,
                                                                                  monkeypatch):
    cache = new_cache(chat_llama, tokenizer, CacheConfig(block_size=16), start_sweeper=False)
    cache.chat([SYSTEM, QUESTION], documents=DOCS[:2], max_new_tokens=2)  # a first sight stores the documents
    ahead = cache.serial.blend_ahead

    def then_flushed(*args, **kwargs):
        out = ahead(*args, **kwargs)
        cache.flush()  # everything stored, the blend included, gone before the engine looks
        return out

    monkeypatch.setattr(cache.serial, "blend_ahead", then_flushed)
    got = cache.chat([SYSTEM, QUESTION], documents=DOCS[::-1][1:], max_new_tokens=8, ignore_eos=True)
    want = cache.chat([SYSTEM, QUESTION], documents=DOCS[::-1][1:], blend=False, max_new_tokens=8, ignore_eos=True)
    assert got.stats.blend_reason == BLEND_LOST and got.stats.chunk_reused_tokens == 0
    assert list(got.token_ids) == list(want.token_ids)  # computed from nothing: a full prefill's answer


def test_a_blend_evicted_but_its_head_counts_what_the_engine_read(chat_llama, tokenizer, new_cache, monkeypatch):
    """Between the blend and the batching engine's lookup, the blended KV loses its tail (an eviction, forced
    here by holding its head while the store frees everything else): the engine reads the head and prefills
    the rest, and the counts (per call and in the metrics) are those of the head it read."""
    cache, serial = (new_cache(chat_llama, tokenizer, CacheConfig(block_size=16), start_sweeper=False, batching=b)
                     for b in (True, False))
    documents = DOCS[::-1][1:]  # both stored by the first sight, now in another order
    messages = with_documents([SYSTEM, QUESTION], documents)
    ids = list(cache.canonicalizer.encode_chat(messages).token_ids)
    (_, end_first), (start_last, end_last) = cache.canonicalizer.encode_chat(messages).chunks
    head = (start_last + end_last) // 2 // 16 * 16  # whole blocks, into the last document
    assert end_first < head < end_last < len(ids) - 1
    for c in (cache, serial):
        c.chat([SYSTEM, QUESTION], documents=DOCS[:2], max_new_tokens=2)
    want = serial.chat([SYSTEM, QUESTION], documents=documents, max_new_tokens=8, ignore_eos=True).stats
    ahead = cache.serial.blend_ahead

    def then_evicted_but_the_head(prompt, blend, scope, stats):
        out = ahead(prompt, blend, scope, stats)
        held = cache.store.acquire(blended_scope(scope, blend.share), prompt, head)
        assert held.cached_tokens == head
        cache.store.reclaim(0)  # every block nobody reads
        cache.store.release(held)
        return out

    monkeypatch.setattr(cache.serial, "blend_ahead", then_evicted_but_the_head)
    before = cache.stats()
    got = cache.chat([SYSTEM, QUESTION], documents=documents, max_new_tokens=8, ignore_eos=True).stats
    assert got.executor == "batched" and got.blend_reason == BLEND_LOST
    assert 0 < want.cached_tokens == got.cached_tokens < end_first  # the exact part, all of it read
    # Of the chunk tokens the blend handled, those of the last document past the head were prefilled instead.
    assert got.chunk_reused_tokens + got.chunk_recomputed_tokens == (
        want.chunk_reused_tokens + want.chunk_recomputed_tokens - (end_last - head))
    assert 0 < got.chunk_reused_tokens < want.chunk_reused_tokens
    assert 0 < got.chunk_recomputed_tokens <= want.chunk_recomputed_tokens
    after = cache.stats()
    for field in ("chunk_reused_tokens", "chunk_recomputed_tokens", "cached_tokens"):
        assert after[field] - before[field] == getattr(got, field), field
    cache.check_integrity()


@pytest.mark.parametrize("batching", [True, False], ids=["batching", "serial"])
def test_a_blend_that_fails_is_prefilled_and_said(chat_llama, tokenizer, new_cache, monkeypatch, batching):
    """A blend that raises (a fault injected into the model-level build) costs the call its speed, not its
    answer: prefilled, a full prefill's tokens, the reason given; the next call blends again."""
    cache = new_cache(chat_llama, tokenizer, CacheConfig(block_size=16), start_sweeper=False, batching=batching)
    cache.chat([SYSTEM, QUESTION], documents=DOCS[:2], max_new_tokens=2)  # a first sight stores the documents
    build = cache.serial.blender.build

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(cache.serial.blender, "build", broken)
    got = cache.chat([SYSTEM, QUESTION], documents=DOCS[::-1][1:], max_new_tokens=8, ignore_eos=True)
    assert got.stats.blend_reason == f"{BLEND_FAILED}: injected fault"
    assert got.stats.chunk_reused_tokens == got.stats.chunk_recomputed_tokens == 0
    want = cache.chat([SYSTEM, QUESTION], documents=DOCS[::-1][1:], blend=False, max_new_tokens=8, ignore_eos=True)
    assert list(got.token_ids) == list(want.token_ids)  # a full prefill's answer
    assert cache.stats()["blend_fallbacks"] >= 1
    monkeypatch.setattr(cache.serial.blender, "build", build)
    again = cache.chat([SYSTEM, QUESTION], documents=[DOCS[2], DOCS[1]], max_new_tokens=2)
    assert again.stats.blend_reason is None and again.stats.chunk_reused_tokens > 0


def test_marked_parts_and_anthropic_text_blocks_are_chunks(cache, tokenizer):
    parts = [{"type": "text", "text": DOCS[0], "prefixcache_chunk": True}, {"type": "text", "text": "Rocks?"}]
    cache.chat([SYSTEM, {"role": "user", "content": parts}], max_new_tokens=2)
    blocks = [{"type": "text", "text": "Other question first."},
              {"type": "text", "text": DOCS[0], "prefixcache_chunk": True}]
    result = cache.messages([{"role": "user", "content": blocks}], system="Be brief.", max_tokens=2)
    assert result.stats.chunk_stored_tokens == 0  # found: stored by the chat call
    assert result.stats.chunk_reused_tokens + result.stats.chunk_recomputed_tokens == doc_tokens(tokenizer, DOCS[0])


def test_off_per_request_and_per_server(cache, chat_llama, tokenizer, new_cache):
    off = cache.chat([SYSTEM, QUESTION], documents=DOCS[:1], blend=False, max_new_tokens=2)
    assert off.stats.blend_reason == "blending turned off for this request" and off.stats.chunk_reused_tokens == 0
    server_off = new_cache(chat_llama, tokenizer, CacheConfig(blend=False), start_sweeper=False)
    again = server_off.chat([SYSTEM, QUESTION], documents=DOCS[:1], max_new_tokens=2)
    assert again.stats.blend_reason == "blending turned off on this server"
    assert again.stats.executor == "batched"  # prefilled like any prompt


def test_a_chunk_of_another_tenant_is_never_used(cache, tokenizer):
    cache.chat([SYSTEM, QUESTION], documents=DOCS[:2], max_new_tokens=2, tenant="a")
    mine = cache.chat([SYSTEM, QUESTION], documents=DOCS[:2], max_new_tokens=2, tenant="a")
    theirs = cache.chat([SYSTEM, QUESTION], documents=DOCS[:2], max_new_tokens=2, tenant="b")
    salted = cache.chat([SYSTEM, QUESTION], documents=DOCS[:2], max_new_tokens=2, tenant="a", cache_salt="s")
    assert mine.stats.chunk_stored_tokens == 0
    assert theirs.stats.chunk_stored_tokens == salted.stats.chunk_stored_tokens == doc_tokens(tokenizer, *DOCS[:2])


@pytest.mark.parametrize("call, param", [
    (lambda c: c.chat([SYSTEM, QUESTION], documents="one text", max_new_tokens=1), "documents"),
    (lambda c: c.chat([SYSTEM, QUESTION], documents=[""], max_new_tokens=1), "documents"),
    (lambda c: c.chat([SYSTEM], documents=["x"], max_new_tokens=1), "documents"),
    (lambda c: c.chat([SYSTEM, QUESTION], documents=["x"], blend=1.5, max_new_tokens=1), "blend"),
    (lambda c: c.answer([5, 6, 7], chunks=[(2, 9)], max_new_tokens=1), "chunks"),
    (lambda c: c.answer([5, 6, 7, 8], chunks=[(0, 2), (1, 3)], max_new_tokens=1), "chunks"),
    (lambda c: c.chat([{"role": "user", "content": [{"type": "text", "text": "x", "prefixcache_chunk": "yes"}]}],
                      max_new_tokens=1), "messages[0].content[0].prefixcache_chunk"),
])
def test_bad_input_is_refused_with_its_parameter(cache, call, param):
    with pytest.raises(InvalidRequestError) as info:
        call(cache)
    assert info.value.param == param


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=st.lists(st.tuples(st.permutations(range(len(DOCS))), st.integers(1, len(DOCS)),
                                st.sampled_from([None, 0.0, 0.5, 1.0])), min_size=2, max_size=4))
def test_any_sequence_of_blended_calls_answers_alike_on_both_engines(chat_llama, tokenizer, calls):
    """Random sequences of calls (documents in any order and combination, shares default/0/0.5/1): the batching
    engine gives the serial engine's tokens and counts call by call; share 1 answers as a full prefill."""
    caches = [PrefixCache(chat_llama, tokenizer, CacheConfig(block_size=16), start_sweeper=False, batching=batching)
              for batching in (True, False)]
    try:
        for order, count, share in calls:
            documents = [DOCS[i] for i in order[:count]]
            options = {"max_new_tokens": 4, "ignore_eos": True, **({} if share is None else {"blend": share})}
            got, want = (c.chat([SYSTEM, QUESTION], documents=documents, **options) for c in caches)
            assert list(got.token_ids) == list(want.token_ids)
            for field in ("cached_tokens", "chunk_reused_tokens", "chunk_recomputed_tokens", "chunk_stored_tokens",
                          "blend_reason"):
                assert getattr(got.stats, field) == getattr(want.stats, field), field
            if share == 1.0:
                plain = caches[1].chat([SYSTEM, QUESTION], documents=documents, blend=False, max_new_tokens=4,
                                       ignore_eos=True)
                assert list(want.token_ids) == list(plain.token_ids)
    finally:
        for cache in caches:
            cache.close()


def test_a_blend_the_cache_cannot_hold_whole_is_served_exactly_and_said_so(chat_llama, tokenizer, new_cache):
    """A tenant quota that keeps only part of a prompt's blended KV: the batching engine would read a blended
    head and prefill the rest; the call is served from exact KV instead, with the reason, reusing nothing."""
    from prefixcache.serving.blend import BLEND_UNSTORED

    config = CacheConfig(block_size=16, tenant_quota_bytes=30000, max_bytes=200000)
    cache = new_cache(chat_llama, tokenizer, config, start_sweeper=False)
    docs = ["The heron stands in the shallow water at dawn. " * 3, "Granite forms when magma cools. " * 3,
            "Sourdough is flour and water. " * 3]
    ask = {"role": "system", "content": "Answer."}
    cache.chat([ask, {"role": "user", "content": "Q"}], documents=docs, max_new_tokens=1)  # stores the documents
    moved = [ask, {"role": "user", "content": [*({"type": "text", "text": d, "prefixcache_chunk": True}
                                                 for d in docs[::-1]), {"type": "text", "text": "Which?"}]}]
    got = cache.chat(moved, blend=0.0, max_new_tokens=8, ignore_eos=True)
    assert got.stats.blend_reason == BLEND_UNSTORED and got.stats.chunk_reused_tokens == 0
    exact = cache.chat(moved, blend=False, max_new_tokens=8, ignore_eos=True)  # the documents prefilled
    assert list(got.token_ids) == list(exact.token_ids)  # exact KV: no blended head was read


def test_marked_parts_are_bounded_and_hold_text(cache):
    from prefixcache.serving.blend import MAX_CHUNKS

    many = [{"type": "text", "text": f"note {i}.", "prefixcache_chunk": True} for i in range(MAX_CHUNKS + 1)]
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_CHUNKS}"):
        cache.chat([SYSTEM, {"role": "user", "content": [*many, {"type": "text", "text": "?"}]}], max_new_tokens=1)
    empty = [{"type": "text", "text": "  ", "prefixcache_chunk": True}, {"type": "text", "text": "?"}]
    with pytest.raises(InvalidRequestError, match="holds no text") as caught:
        cache.chat([SYSTEM, {"role": "user", "content": empty}], max_new_tokens=1)
    assert caught.value.param == "messages[1].content[0].text"
