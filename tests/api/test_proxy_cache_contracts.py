"""Today's hosted cache contracts through the official clients, unchanged but for ``base_url`` and ``api_key``.

Anthropic's automatic caching (a top-level ``cache_control``) and cache diagnostics;
OpenAI's ``prompt_cache_options`` and ``prompt_cache_breakpoint``. The tiny model's
minimum cacheable length is set low and blocks are 8 tokens.
"""
from __future__ import annotations

import anthropic
import httpx
import pytest
from proxy_support import ADMIN, ALPHA, BETA, MODEL, anthropic_client

from prefixcache.serving.diagnostics import REASONS

SYSTEM_TEXT = "You are the support assistant of a small bookshop. Be brief and kind. " * 4


# -- Anthropic: automatic caching ----------------------------------------------------------
def test_automatic_caching_writes_the_conversation_then_the_next_turn_reads_it(srv, alpha):
    turn = [{"role": "user", "content": "Do you sell maps of the old town?"}]
    first = alpha.messages.create(model=MODEL, max_tokens=3, system=SYSTEM_TEXT, messages=turn,
                                  cache_control={"type": "ephemeral"})
    u = first.usage
    counted = alpha.messages.count_tokens(model=MODEL, system=SYSTEM_TEXT, messages=turn,
                                          cache_control={"type": "ephemeral"}).input_tokens
    # The marker closes the whole conversation (all but the generation prompt): written, for 5 minutes.
    assert u.cache_read_input_tokens == 0 and u.cache_creation_input_tokens > counted - 8
    assert u.cache_creation.ephemeral_5m_input_tokens == u.cache_creation_input_tokens
    assert u.input_tokens + u.cache_creation_input_tokens == counted

    turn += [{"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "And globes?"}]
    second = alpha.messages.create(model=MODEL, max_tokens=3, system=SYSTEM_TEXT, messages=turn,
                                   cache_control={"type": "ephemeral", "ttl": "1h"})
    v = second.usage
    # The next turn reads what the first wrote, and the marker moves forward: the new turn is written, for 1 hour.
    assert v.cache_read_input_tokens >= u.cache_creation_input_tokens
    assert v.cache_creation_input_tokens > 0 and v.cache_creation.ephemeral_1h_input_tokens == v.cache_creation_input_tokens
    breakpoints = srv.cache.stats("alpha")["breakpoints"]
    assert breakpoints["5m"]["writes"] == 1 and breakpoints["1h"]["writes"] == 1


def test_automatic_caching_counts_within_the_four_breakpoints_and_their_ttl_order(srv, alpha):
    marked = {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}
    with pytest.raises(anthropic.BadRequestError, match="maximum of 4"):
        alpha.messages.create(model=MODEL, max_tokens=2, cache_control={"type": "ephemeral"},
                              messages=[{"role": "user", "content": [marked] * 4 + [{"type": "text", "text": "?"}]}])
    with pytest.raises(anthropic.BadRequestError, match="must not come after"):
        alpha.messages.create(model=MODEL, max_tokens=2, cache_control={"type": "ephemeral", "ttl": "1h"},
                              system=[{**marked, "text": SYSTEM_TEXT}], messages=[{"role": "user", "content": "?"}])
    # Four markers with the automatic one on a block that has its own: still four.
    ok = alpha.messages.create(model=MODEL, max_tokens=2, cache_control={"type": "ephemeral"},
                               messages=[{"role": "user", "content": [marked] * 4}])
    assert ok.usage.output_tokens >= 1


# -- cache diagnostics ---------------------------------------------------------------------------
def prompt_tokens(message) -> int:
    u = message.usage
    return u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens


def reason(message) -> tuple[str, int | None] | None:
    if message.diagnostics is None:
        return None
    miss = message.diagnostics.cache_miss_reason
    return miss.type, getattr(miss, "cache_missed_input_tokens", None)


def test_every_cache_miss_reason_from_the_request_that_causes_it(srv, alpha):
    ask = [{"role": "user", "content": "Do you sell maps of the old town?"}]
    first = alpha.messages.create(model=MODEL, max_tokens=3, system=SYSTEM_TEXT, messages=ask,
                                  diagnostics={"previous_message_id": None})
    assert first.diagnostics is None
    total = prompt_tokens(first)
    since = {"diagnostics": {"previous_message_id": first.id}}

    def diagnosed(**changes):
        body = {"model": MODEL, "max_tokens": 2, "system": SYSTEM_TEXT, "messages": ask, **changes, **since}
        return reason(alpha.messages.create(**body))

    # Messages appended (the next turn), or the same request again: no divergence, and the prefix is read.
    turn = ask + [{"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "Globes?"}]
    nxt = alpha.messages.create(model=MODEL, max_tokens=2, system=SYSTEM_TEXT, messages=turn, **since)
    assert nxt.diagnostics is None and nxt.usage.cache_read_input_tokens > 0
    assert diagnosed() is None
    # A cache marker is no prompt change: moving or adding one leaves the diagnosis alone.
    assert diagnosed(cache_control={"type": "ephemeral"}) is None

    kind, missed = diagnosed(extra_body={"cache_salt": "another namespace"})
    assert (kind, missed) == ("model_changed", total)  # another cache: nothing of the earlier prompt is readable
    kind, missed = diagnosed(system="You are the night shift of the bookshop.")
    assert kind == "system_changed" and 0 < missed <= total
    kind, missed = diagnosed(tools=[{"name": "stock", "input_schema": {"type": "object"}}], tool_choice={"type": "none"})
    assert kind == "tools_changed" and missed is not None
    assert diagnosed(tool_choice={"type": "auto"}) == ("unavailable", None)
    kind, missed = diagnosed(messages=[{"role": "user", "content": "Do you sell maps of the new town?"}])
    assert kind == "messages_changed" and 0 < missed < total  # the system prompt was still shared
    assert diagnosed(extra_body={"diagnostics": {"previous_message_id": "msg_unknown"}}) == (
        "previous_message_not_found", None)
    # Another key's id is not found: fingerprints are kept per tenant.
    other = anthropic_client(srv.url, BETA).messages.create(model=MODEL, max_tokens=2, system=SYSTEM_TEXT, messages=ask,
                                                  **since)
    assert reason(other) == ("previous_message_not_found", None)

    # Streamed: message_start carries it, so the SDK's final message has it.
    with alpha.messages.stream(model=MODEL, max_tokens=2, system="Another system prompt.", messages=ask,
                               **since) as stream:
        final = stream.get_final_message()
    assert reason(final)[0] == "system_changed"

    text = httpx.get(f"{srv.url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    counts = {r: _sample(text, f'prefixcache_cache_miss_reasons_total{{reason="{r}"}}') for r in REASONS}
    assert counts["system_changed"] >= 2 and counts["previous_message_not_found"] >= 2
    assert all(counts[r] >= 1 for r in REASONS)


def _sample(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} not exposed")


def test_openai_callers_get_the_same_reasons_as_an_extension(srv):
    oa = srv.openai(ALPHA)
    srv.cache.flush()
    chat = [{"role": "system", "content": SYSTEM_TEXT}, {"role": "user", "content": "Maps?"}]
    first = oa.chat.completions.create(model=MODEL, messages=chat, max_tokens=2,
                                       extra_body={"diagnostics": {"previous_message_id": None}})
    assert first.model_extra.get("diagnostics") is None
    since = {"diagnostics": {"previous_message_id": first.id}}
    turn = chat + [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "?"}]
    assert oa.chat.completions.create(model=MODEL, messages=turn, max_tokens=2,
                                      extra_body=since).model_extra.get("diagnostics") is None
    changed = [{"role": "developer", "content": "Answer in French."}, *chat[1:]]
    r = oa.chat.completions.create(model=MODEL, messages=changed, max_tokens=2, extra_body=since)
    miss = r.model_extra["diagnostics"]["cache_miss_reason"]
    assert miss["type"] == "system_changed" and miss["cache_missed_input_tokens"] > 0
    chunks = list(oa.chat.completions.create(model=MODEL, messages=chat[1:], max_tokens=2, stream=True,
                                             extra_body=since))
    assert chunks[0].model_extra["diagnostics"]["cache_miss_reason"]["type"] == "system_changed"
    gone = oa.chat.completions.create(model=MODEL, messages=chat, max_tokens=2,
                                      extra_body={"diagnostics": {"previous_message_id": "chatcmpl-gone"}})
    assert gone.model_extra["diagnostics"] == {"cache_miss_reason": {"type": "previous_message_not_found"}}


# -- OpenAI: prompt_cache_options and prompt_cache_breakpoint ----------------------------------------
POLICY = "Returns are accepted within thirty days with the receipt. " * 3


def part(text: str, **ttl: str) -> dict:
    """A text part marked with ``prompt_cache_breakpoint`` (its own ``ttl=...`` if given)."""
    return {"type": "text", "text": text, "prompt_cache_breakpoint": {"mode": "explicit", **ttl}}


def written(srv, ttl: str) -> tuple[int, int]:
    counts = srv.cache.stats("alpha")["breakpoints"][ttl]
    return counts["writes"], counts["write_tokens"]


def reads(srv, ttl: str = "30m") -> int:
    return srv.cache.stats("alpha")["breakpoints"][ttl]["reads"]


def test_implicit_mode_writes_the_conversation_then_reads_it(srv):
    oa = srv.openai(ALPHA)
    srv.cache.flush()
    chat = [{"role": "system", "content": SYSTEM_TEXT}, {"role": "user", "content": "Maps?"}]
    before = written(srv, "30m")
    first = oa.chat.completions.create(model=MODEL, messages=chat, max_tokens=2,
                                       prompt_cache_options={"mode": "implicit", "ttl": "30m"})
    d = first.usage.prompt_tokens_details
    # The implicit breakpoint closes the newest user message: all of it is written (nothing was read).
    whole = len(srv.cache.canonicalizer.encode_chat(chat, add_generation_prompt=False).token_ids)
    (implicit,) = srv.cache.encode_chat_breakpoints(chat, mode="implicit").breakpoints
    assert (implicit.where, implicit.ttl, implicit.position) == ("messages[1]", "30m", whole)
    assert d.cached_tokens == 0 and d.cache_write_tokens == whole
    assert written(srv, "30m") == (before[0] + 1, before[1] + whole)  # equal to the tokens written
    again = oa.chat.completions.create(model=MODEL, messages=chat, max_tokens=2, prompt_cache_options={})
    assert again.usage.prompt_tokens_details.cached_tokens >= whole
    assert again.usage.prompt_tokens_details.cache_write_tokens == 0
    # Streamed, the usage chunk carries the same figures.
    chunks = list(oa.chat.completions.create(model=MODEL, messages=chat, max_tokens=2, stream=True,
                                             stream_options={"include_usage": True},
                                             prompt_cache_options={"mode": "implicit"}))
    assert chunks[-1].usage.prompt_tokens_details.cache_write_tokens == 0


def test_explicit_mode_writes_only_the_marked_prefixes(srv):
    oa = srv.openai(ALPHA)
    srv.cache.flush()
    ask = {"role": "user", "content": "Can I return a map?"}
    before, long_before = written(srv, "30m"), written(srv, "12h")
    none = oa.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": POLICY}, ask],
                                      max_tokens=2, prompt_cache_options={"mode": "explicit"})
    assert none.usage.prompt_tokens_details.cache_write_tokens == 0 and written(srv, "30m") == before

    srv.cache.flush()
    marked = [{"role": "system", "content": [part(POLICY, ttl="12h")]}, ask]
    r = oa.chat.completions.create(model=MODEL, messages=marked, max_tokens=2,
                                   prompt_cache_options={"mode": "explicit"})
    (bp,) = srv.cache.encode_chat_breakpoints(marked, mode="explicit").breakpoints
    assert bp.ttl == "12h" and 16 < bp.position < r.usage.prompt_tokens
    assert r.usage.prompt_tokens_details.cache_write_tokens == bp.position
    assert written(srv, "12h") == (long_before[0] + 1, long_before[1] + bp.position)
    assert written(srv, "30m") == before  # no implicit breakpoint
    # The next question reads the marked prefix.
    other = oa.chat.completions.create(model=MODEL, messages=[marked[0], {"role": "user", "content": "Globes?"}],
                                       max_tokens=2, prompt_cache_options={"mode": "explicit"})
    assert other.usage.prompt_tokens_details.cached_tokens >= bp.position
    assert other.usage.prompt_tokens_details.cache_write_tokens == 0


def test_at_most_four_breakpoints_are_written_the_latest_ones(srv):
    oa = srv.openai(ALPHA)
    texts = [f"Section {i}: " + POLICY for i in range(5)]
    for mode, implicit in (("explicit", 0), ("implicit", 1)):
        srv.cache.flush()
        chat = [{"role": "system", "content": [part(t) for t in texts]}, {"role": "user", "content": "Ok?"}]
        prompt = srv.cache.encode_chat_breakpoints(chat, mode=mode)
        assert [bp.where for bp in prompt.breakpoints] == [
            f"messages[0].content[{k}]" for k in range(1 + implicit, 5)] + ["messages[1]"] * implicit
        before = written(srv, "30m")
        r = oa.chat.completions.create(model=MODEL, messages=chat, max_tokens=2, prompt_cache_options={"mode": mode})
        after = written(srv, "30m")
        assert (after[0] - before[0], after[1] - before[1]) == (4, r.usage.prompt_tokens_details.cache_write_tokens)
        assert r.usage.prompt_tokens_details.cache_write_tokens == prompt.breakpoints[-1].position


def test_without_breakpoints_cache_write_tokens_are_the_tokens_stored(srv):
    oa = srv.openai(ALPHA)
    srv.cache.flush()
    chat = [{"role": "user", "content": "Do you sell maps?"}]
    first = oa.chat.completions.create(model=MODEL, messages=chat, max_tokens=2)
    held = srv.cache.breakpoints.held(srv.cache.scope("alpha"), srv.cache.encode_chat(chat))
    assert first.usage.prompt_tokens_details.cache_write_tokens == held == first.usage.prompt_tokens
    again = oa.chat.completions.create(model=MODEL, messages=chat, max_tokens=2, prompt_cache_retention="24h")
    assert again.usage.prompt_tokens_details.cache_write_tokens == 0
    text = oa.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=2,
                                 extra_body={"prompt_cache_options": {"mode": "explicit"}})
    assert text.usage.prompt_tokens_details.cache_write_tokens == 0


def test_bad_prompt_cache_values_are_refused(srv):
    oa = srv.openai(ALPHA)
    chat = [{"role": "user", "content": [part("x")]}]
    for bad in ({"prompt_cache_options": {"mode": "sometimes"}}, {"prompt_cache_options": {"ttl": "5m"}},
                {"messages": [{"role": "user", "content": [{"type": "text", "text": "x",
                                                           "prompt_cache_breakpoint": {"mode": "implicit"}}]}]}):
        body = {"model": MODEL, "messages": chat, "max_tokens": 2, **bad}
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {ALPHA}"})
        assert r.status_code == 400, (bad, r.text)
    assert oa.chat.completions.create(model=MODEL, messages=chat, max_tokens=2).usage.prompt_tokens > 0


def test_a_repeated_completion_reads_its_implicit_breakpoint_and_writes_nothing(srv):
    """The implicit breakpoint of a completion closes the whole prompt; its last token is always recomputed, so
    an identical repeat reads the breakpoint (counted as a read) and writes nothing."""
    oa = srv.openai(ALPHA)
    srv.cache.flush()
    prompt = "Once upon a time, in a harbour town, " * 6
    options = {"prompt_cache_options": {"mode": "implicit"}}
    first = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body=options)
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cache_write_tokens == n
    before = reads(srv)
    again = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body=options)
    d = again.usage.prompt_tokens_details
    assert (d.cached_tokens, d.cache_write_tokens) == (n - 1, 0)
    assert reads(srv) == before + 1
