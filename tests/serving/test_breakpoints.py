"""Cache breakpoints: the rules, usage accounting (property-based), locating them in a prompt, keeping them."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixcache import CacheConfig, InvalidRequestError, PrefixCache
from prefixcache.serving.breakpoints import Breakpoint, account, check_breakpoints
from prefixcache.serving.canonicalize import Canonicalizer
from prefixcache.serving.messages import encode_messages, to_chat

SYSTEM = "You answer questions about the opening hours of a library. " * 3
CTX = "The library opens at nine and closes at five, except on Sundays. " * 2


def marked(text: str, ttl: str | None = None) -> dict:
    return {"type": "text", "text": text, "cache_control": {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}}


# -- rules -------------------------------------------------------------------------------
def test_at_most_four_breakpoints_and_longer_ttls_first():
    check_breakpoints([Breakpoint("a", "1h"), Breakpoint("b", "1h"), Breakpoint("c", "5m"), Breakpoint("d", "5m")])
    with pytest.raises(InvalidRequestError, match="maximum of 4") as err:
        check_breakpoints([Breakpoint(f"b{i}", "5m") for i in range(5)])
    assert err.value.param == "b4"
    with pytest.raises(InvalidRequestError, match="must not come after") as err:
        check_breakpoints([Breakpoint("system[0]", "1h"), Breakpoint("m0", "5m"), Breakpoint("m1", "1h")])
    assert err.value.param == "m1.cache_control.ttl"
    with pytest.raises(InvalidRequestError, match="ttl"):
        check_breakpoints([Breakpoint("x", "2h")])


# -- accounting ----------------------------------------------------------------------------
@st.composite
def requests(draw):
    n = draw(st.integers(1, 300))
    positions = sorted(draw(st.lists(st.integers(0, n), max_size=4)))
    ttls = sorted((draw(st.sampled_from(["5m", "1h"])) for _ in positions), key=lambda t: t != "1h")
    bps = [Breakpoint(f"b{i}", t, p) for i, (t, p) in enumerate(zip(ttls, positions))]
    kept = [draw(st.booleans()) for _ in bps]
    return n, draw(st.integers(0, n - 1)), bps, kept


@given(requests())
def test_usage_parts_sum_to_the_prompt_and_creation_ends_at_the_last_kept_breakpoint(req):
    n, read, bps, kept = req
    usage, events = account(n, read, bps, kept)
    assert usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == n
    assert min(usage.input_tokens, usage.cache_creation_input_tokens) >= 0 and usage.cache_read_input_tokens == read
    assert usage.ephemeral_5m_input_tokens + usage.ephemeral_1h_input_tokens == usage.cache_creation_input_tokens
    last = max([bp.position for bp, k in zip(bps, kept) if k], default=0)
    assert usage.cache_creation_input_tokens == max(0, last - read)
    written = sum(a for _, e, a in events if e == "write_tokens")
    assert written == usage.cache_creation_input_tokens
    # Tokens read inside breakpoint prefixes are counted once each.
    assert sum(a for _, e, a in events if e == "read_tokens") == min(read, max([b.position for b in bps], default=0))


def test_creation_is_split_by_the_ttl_of_the_segment_holding_it():
    bps = [Breakpoint("system[0]", "1h", 100), Breakpoint("messages[0].content[0]", "5m", 160)]
    usage, _ = account(200, 0, bps, [True, True])
    assert (usage.ephemeral_1h_input_tokens, usage.ephemeral_5m_input_tokens, usage.input_tokens) == (100, 60, 40)
    usage, events = account(200, 120, bps, [True, True])  # the 1h prefix and part of the next were read
    assert (usage.ephemeral_1h_input_tokens, usage.ephemeral_5m_input_tokens) == (0, 40)
    assert ("1h", "reads", 1) in events and ("5m", "writes", 1) in events
    usage, _ = account(200, 0, bps, [False, True])  # a short first breakpoint: the next one covers its tokens
    assert (usage.ephemeral_1h_input_tokens, usage.ephemeral_5m_input_tokens) == (0, 160)


# -- locating breakpoints --------------------------------------------------------------------
def test_positions_are_the_tokens_shared_with_the_request_cut_after_the_marked_block(tokenizer):
    canon = Canonicalizer(tokenizer)
    messages = [{"role": "user", "content": [marked(CTX, "5m"), {"type": "text", "text": "Open on Sunday?"}]}]
    prompt = encode_messages(canon, messages, [marked(SYSTEM, "1h")])
    ids = prompt.token_ids
    system_bp, context_bp = prompt.breakpoints
    assert (system_bp.where, system_bp.ttl, context_bp.where, context_bp.ttl) == (
        "system[0]", "1h", "messages[0].content[0]", "5m")
    assert 0 < system_bp.position < context_bp.position < len(ids)
    # The system breakpoint ends where the system message does; every request with that system shares it.
    other = encode_messages(canon, [{"role": "user", "content": "Something else entirely"}], [marked(SYSTEM, "1h")])
    system_end = canon.encode_chat([{"role": "system", "content": SYSTEM}], add_generation_prompt=False).token_ids
    assert system_bp.position == len(system_end)
    assert other.token_ids[: system_bp.position] == ids[: system_bp.position]
    # The context breakpoint covers the context's text: the same context with another question shares it.
    asked = [{"role": "user", "content": [marked(CTX, "5m"), {"type": "text", "text": "And on Monday?"}]}]
    again = encode_messages(canon, asked, [marked(SYSTEM, "1h")])
    assert again.token_ids[: context_bp.position] == ids[: context_bp.position]
    assert tokenizer.decode(ids[system_bp.position: context_bp.position]).strip().endswith("Sundays.")


def test_the_top_level_marker_closes_the_last_block_and_counts_as_a_breakpoint(tokenizer):
    canon = Canonicalizer(tokenizer)
    history = [{"role": "user", "content": "Open on Sunday?"}, {"role": "assistant", "content": "No."},
               {"role": "user", "content": "And on Monday?"}]
    auto = encode_messages(canon, history, SYSTEM, cache_control={"type": "ephemeral", "ttl": "1h"})
    (bp,) = auto.breakpoints
    whole = canon.encode_chat([{"role": "system", "content": SYSTEM}, *history], add_generation_prompt=False)
    assert (bp.where, bp.ttl, bp.position) == ("cache_control", "1h", len(whole.token_ids))
    # On blocks, it marks the last one; one that carries its own marker keeps it (no second breakpoint).
    blocks = [{"role": "user", "content": [{"type": "text", "text": CTX}, {"type": "text", "text": "Sunday?"}]}]
    (on_block,) = encode_messages(canon, blocks, cache_control={"type": "ephemeral"}).breakpoints
    assert (on_block.where, on_block.ttl) == ("cache_control", "5m")
    own = [{"role": "user", "content": [{"type": "text", "text": CTX}, marked("Sunday?", "1h")]}]
    (kept,) = encode_messages(canon, own, cache_control={"type": "ephemeral"}).breakpoints
    assert (kept.where, kept.ttl, kept.position) == ("messages[0].content[1]", "1h", on_block.position)
    # Within the four, and after longer TTLs only.
    four = [{"role": "user", "content": [marked(f"part {i}") for i in range(4)] + [{"type": "text", "text": "?"}]}]
    with pytest.raises(InvalidRequestError, match="maximum of 4") as err:
        encode_messages(canon, four, cache_control={"type": "ephemeral"})
    assert err.value.param == "cache_control"
    with pytest.raises(InvalidRequestError, match="must not come after") as err:
        encode_messages(canon, history, [marked(SYSTEM, "5m")], cache_control={"type": "ephemeral", "ttl": "1h"})
    assert err.value.param == "cache_control.ttl"
    with pytest.raises(InvalidRequestError) as err:
        encode_messages(canon, history, cache_control={"type": "persistent"})
    assert err.value.param == "cache_control.type"


def test_anthropic_blocks_become_chat_messages():
    messages = [{"role": "user", "content": "Stock of Dune?"},
                {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                                  {"type": "tool_use", "id": "t1", "name": "stock",
                                                   "input": {"title": "Dune"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                              "content": [{"type": "text", "text": "3"}]},
                                             {"type": "text", "text": "Thanks"}]}]
    chat, tools = to_chat(messages, [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                          [{"name": "stock", "input_schema": {"type": "object"}}])
    assert chat == [
        {"role": "system", "content": "a\nb"}, {"role": "user", "content": "Stock of Dune?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "stock", "arguments": '{"title": "Dune"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "3"}, {"role": "user", "content": "Thanks"}]
    assert tools == [{"type": "function", "function": {"name": "stock", "parameters": {"type": "object"}}}]
    for bad, param in (({"role": "user", "content": [{"type": "image", "source": {}}]}, "messages[0].content[0].type"),
                       ({"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]},
                        "messages[0].content[0].type"),
                       ({"role": "system", "content": "x"}, "messages[0].role")):
        with pytest.raises(InvalidRequestError) as err:
            to_chat([bad], None, [])
        assert err.value.param == param


# -- keeping them ----------------------------------------------------------------------------
def test_sdk_messages_keeps_each_breakpoint_for_its_ttl(chat_llama, tokenizer, clock):
    cache = PrefixCache(chat_llama, tokenizer, CacheConfig(ttl_seconds=60, block_size=8, breakpoint_min_tokens=16),
                        clock=clock, start_sweeper=False)
    messages = [{"role": "user", "content": [marked(CTX), {"type": "text", "text": "Open on Sunday?"}]}]
    system = [marked(SYSTEM, "1h")]
    first = cache.messages(messages, system=system, max_tokens=3)
    assert first.cache.cache_read_input_tokens == 0 and first.cache.ephemeral_1h_input_tokens > 0
    prompt = cache.encode_messages(messages, system=system)
    one_hour = prompt.breakpoints[0].position
    clock.advance(30 * 60)
    assert cache.store.peek(cache.scope("default"), prompt.token_ids, len(prompt.token_ids)) \
        in range(one_hour, prompt.breakpoints[1].position)  # the 5m prefix is gone, the 1h one is kept
    cache.check_integrity()
    # Reading refreshes: another 50 minutes after a read at minute 30, the 1h prefix is still there.
    assert cache.messages(messages, system=system, max_tokens=3).cache.cache_read_input_tokens >= one_hour
    clock.advance(50 * 60)
    assert cache.messages(messages, system=system, max_tokens=3).cache.cache_read_input_tokens >= one_hour
    stats = cache.stats("default")["breakpoints"]
    assert stats["1h"]["reads"] == 2 and stats["1h"]["writes"] == 1 and stats["5m"]["writes"] == 3
    cache.check_integrity()
    cache.close()


def test_a_breakpoint_below_the_minimum_writes_nothing_and_fails_nothing(chat_llama, tokenizer, clock):
    cache = PrefixCache(chat_llama, tokenizer, CacheConfig(ttl_seconds=60, block_size=8), clock=clock,
                        start_sweeper=False)  # the default minimum: 1,024 tokens
    messages, system = [{"role": "user", "content": "Hi"}], [marked("Short.", "1h")]
    r = cache.messages(messages, system=system, max_tokens=2)
    assert r.cache.cache_creation_input_tokens == 0 and r.cache.input_tokens == r.usage.prompt_tokens
    assert cache.stats()["breakpoints"]["1h"]["short"] == 1
    clock.advance(120)  # only the default TTL applied: nothing left
    ids = cache.encode_messages(messages, system=system).token_ids
    assert cache.store.peek(cache.scope("default"), ids, len(ids)) == 0
    assert cache.stats()["entries"] > 0 and cache.sweep() > 0 and cache.stats()["entries"] == 0
    cache.close()


def test_a_breakpoint_closing_the_whole_prompt_is_read_when_the_store_held_it():
    """The last prompt token is always recomputed: an identical repeat reads the breakpoint, writes nothing."""
    bp = [Breakpoint("prompt", "5m", 100)]
    usage, events = account(100, 99, bp, [True], held=100)
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (1, 99, 0)
    assert ("5m", "reads", 1) in events and not [e for e in events if e[1] == "writes"]
    usage, events = account(100, 99, bp, [True], held=99)  # its last token was never stored: written now
    assert usage.cache_creation_input_tokens == 1 and ("5m", "writes", 1) in events


@given(requests(), st.integers(0, 300))
def test_with_what_the_store_held_the_parts_still_sum_and_nothing_held_is_written(req, extra):
    n, read, bps, kept = req
    held = min(n, read + extra)
    usage, events = account(n, read, bps, kept, held)
    assert usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == n
    assert min(usage.input_tokens, usage.cache_creation_input_tokens) >= 0 and usage.cache_read_input_tokens == read
    last = max([bp.position for bp, k in zip(bps, kept) if k], default=0)
    assert usage.cache_creation_input_tokens == max(0, last - max(read, held))


def test_a_mark_inside_a_tool_result_keeps_the_prefix_to_the_result_s_end_and_counts(tokenizer):
    from tests.support.tool_templates import family_tokenizer

    canon = Canonicalizer(family_tokenizer(tokenizer, "hermes"))  # a template that renders the tool call

    def result(inner_mark: bool) -> list[dict]:
        inner = [marked(CTX, "5m") if inner_mark else {"type": "text", "text": CTX}]
        return [{"role": "user", "content": "Look it up."},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "lookup", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": inner},
                                             {"type": "text", "text": "Open on Sunday?"}]}]

    (bp,) = encode_messages(canon, result(True)).breakpoints
    outer = result(False)
    outer[2]["content"][0]["cache_control"] = {"type": "ephemeral"}
    (same,) = encode_messages(canon, outer).breakpoints
    assert (bp.where, bp.ttl) == ("messages[2].content[0].content[0]", "5m") and bp.position == same.position > 0
    with pytest.raises(InvalidRequestError, match="maximum of 4"):  # it counts among the four
        encode_messages(canon, result(True), [marked(f"system {i}") for i in range(4)])
    for ttl in ("", 0, False):  # only an absent ttl is the default
        bad = result(False)
        bad[2]["content"][1]["cache_control"] = {"type": "ephemeral", "ttl": ttl}
        with pytest.raises(InvalidRequestError, match="ttl"):
            encode_messages(canon, bad)
