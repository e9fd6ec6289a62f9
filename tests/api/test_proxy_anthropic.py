"""The official ``anthropic`` SDK, unchanged but for ``base_url`` and ``api_key``, against a live proxy.

Breakpoints on the tiny model: the minimum cacheable length is set low (its context is
small) and blocks are 8 tokens, so a TTL boundary falls close to its breakpoint.
"""
from __future__ import annotations

import threading

import anthropic
import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from prefixcache_api import create_app
from proxy_support import (
    ADMIN,
    ALPHA,
    BETA,
    MODEL,
    anthropic_client,
    leased_refs,
    live,
    settings,
    wait_until,
)

from prefixcache import CacheConfig, PrefixCache
from tests.step_hooks import hold_until_cancelled

SYSTEM_TEXT = "You are the support assistant of a small bookshop. Be brief and kind. " * 4
LONG = 400


def system(ttl: str | None = None) -> list[dict]:
    control = {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}
    return [{"type": "text", "text": SYSTEM_TEXT, "cache_control": control}]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def parts(u) -> int:
    return u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens


def test_create_then_a_second_call_reads_the_system_breakpoint(srv, alpha):
    first = alpha.messages.create(model=MODEL, max_tokens=4, system=system(), messages=user("Do you sell maps?"))
    assert first.type == "message" and first.role == "assistant" and first.content[0].type == "text"
    assert first.stop_reason in ("end_turn", "max_tokens") and first.usage.output_tokens <= 4
    u = first.usage
    assert u.cache_read_input_tokens == 0 and u.cache_creation_input_tokens > 16
    assert u.cache_creation.ephemeral_5m_input_tokens == u.cache_creation_input_tokens
    assert u.cache_creation.ephemeral_1h_input_tokens == 0
    counted = alpha.messages.count_tokens(model=MODEL, system=system(), messages=user("Do you sell maps?"))
    assert parts(u) == counted.input_tokens

    second = alpha.messages.create(model=MODEL, max_tokens=4, system=system(), messages=user("When do you open?"))
    assert second.usage.cache_read_input_tokens >= u.cache_creation_input_tokens
    assert second.usage.cache_creation_input_tokens == 0
    assert second.usage.cache_creation.ephemeral_5m_input_tokens == 0
    stats = httpx.get(f"{srv.url}/v1/cache/stats", headers={"x-api-key": ALPHA}).json()["breakpoints"]
    assert stats["5m"]["writes"] == 1 and stats["5m"]["reads"] == 1
    assert stats["5m"]["write_tokens"] == u.cache_creation_input_tokens


def test_another_keys_identical_request_reads_nothing(srv, alpha):
    body = dict(model=MODEL, max_tokens=3, system=system(), messages=user("Any poetry?"))
    alpha.messages.create(**body)
    assert alpha.messages.create(**body).usage.cache_read_input_tokens > 0
    beta = anthropic_client(srv.url, BETA).messages.create(**body)
    assert beta.usage.cache_read_input_tokens == 0 and beta.usage.cache_creation_input_tokens > 0
    # Bearer works as well as x-api-key, and names the same tenant.
    bearer = anthropic.Anthropic(base_url=srv.url, auth_token=BETA, max_retries=0).messages.create(**body)
    assert bearer.usage.cache_read_input_tokens > 0


def test_stream_sends_text_and_a_final_message_equal_to_create(srv, alpha):
    body = dict(model=MODEL, max_tokens=6, system=system(), messages=user("Gift cards?"))
    plain = alpha.messages.create(**body)
    with alpha.messages.stream(**body) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == plain.content[0].text  # greedy: the same answer
    assert final.stop_reason == plain.stop_reason and final.usage.output_tokens == plain.usage.output_tokens
    assert final.usage.cache_read_input_tokens > 0 and final.usage.cache_creation_input_tokens == 0
    assert parts(final.usage) == parts(plain.usage)


def _streamed(client, body: dict) -> tuple:
    """A stream's ``message_start`` usage, ``message_delta`` usage and the SDK's final message usage."""
    with client.messages.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_message().usage
    start = next(e for e in events if e.type == "message_start").message.usage
    return start, next(e for e in events if e.type == "message_delta").usage, final


def _figures(u) -> tuple:
    return u.input_tokens, u.cache_read_input_tokens, u.cache_creation_input_tokens


def test_a_stream_claims_no_cache_write_before_it_is_stored(srv, alpha, tiny_model, tokenizer, new_proxy_cache):
    """message_start is sent before the answer is stored: it claims no write (a breakpoint is kept only then,
    and memory pressure may drop it); message_delta carries the settled figures, equal to an unstreamed call's."""
    body = dict(model=MODEL, max_tokens=3, system=[{**system()[0], "text": "Second-hand atlases and maps. " * 6}],
                messages=user("Maps?"))
    start, delta, final = _streamed(alpha, body)
    assert start.cache_creation_input_tokens == 0 and start.cache_creation.ephemeral_5m_input_tokens == 0
    assert final.cache_creation_input_tokens > 16 and parts(start) == parts(final)
    assert delta.model_extra["cache_creation"]["ephemeral_5m_input_tokens"] == final.cache_creation_input_tokens
    srv.cache.flush()
    assert _figures(alpha.messages.create(**body).usage) == _figures(final)

    # A store of 16 tokens: the breakpoint's prefix (more than 50) is dropped when the call settles.
    small = new_proxy_cache(tiny_model, tokenizer, breakpoint_min_tokens=16, block_size=8, max_bytes=8 << 10)
    with live(create_app(settings(), cache=small)) as tight:
        client = anthropic_client(tight.url, ALPHA)
        start, delta, final = _streamed(client, body)
        assert start.cache_creation_input_tokens == 0 and start.cache_creation.ephemeral_5m_input_tokens == 0
        assert final.cache_creation_input_tokens == 0 and final.cache_creation.ephemeral_5m_input_tokens == 0
        assert delta.model_extra["cache_creation"] == {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}
        small.flush()
        plain = client.messages.create(**body).usage
        assert _figures(plain) == _figures(final) and plain.cache_creation == final.cache_creation
        assert small.breakpoints.stats()["5m"]["dropped"] == 2


def test_stream_events_come_in_anthropics_order(srv, alpha):
    body = {"model": MODEL, "max_tokens": 4, "system": system(), "messages": user("Hello"), "stream": True}
    with httpx.Client(base_url=srv.url, headers={"x-api-key": ALPHA, "anthropic-version": "2023-06-01"}) as http:
        text = http.post("/v1/messages", json=body).text
    kinds = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
    assert kinds[:3] == ["message_start", "content_block_start", "ping"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) <= {"content_block_delta"} and kinds[3:-3]


def test_stop_sequence_is_reported(srv, alpha):
    free = alpha.messages.create(model=MODEL, max_tokens=8, messages=user("Tell me a story"))
    words = free.content[0].text.split()
    assert len(words) > 1, words  # the tiny model's greedy answer (seed 0) has several words
    word = words[1]
    cut = alpha.messages.create(model=MODEL, max_tokens=8, messages=user("Tell me a story"), stop_sequences=[word])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert word not in cut.content[0].text and free.content[0].text.startswith(cut.content[0].text)


def test_tool_use_and_tool_result_blocks_are_served(srv, alpha):
    tools = [{"name": "stock", "description": "Copies in stock", "input_schema": {
        "type": "object", "properties": {"title": {"type": "string"}}}}]
    messages = [{"role": "user", "content": "Is Dune in stock?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "stock",
                                                   "input": {"title": "Dune"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "3 copies"}]}]
    try:
        r = alpha.messages.create(model=MODEL, max_tokens=3, tools=tools, messages=messages)
        assert r.usage.output_tokens >= 1
    except anthropic.BadRequestError as exc:  # a chat template without tools refuses them, clearly
        assert "does not support tools" in str(exc)
    try:
        r = alpha.messages.create(model=MODEL, max_tokens=3, tools=tools, tool_choice={"type": "none"},
                                  messages=messages)
        assert r.content[0].type == "text"
    except anthropic.BadRequestError as exc:  # nor is the earlier call dropped from the prompt silently
        assert "does not render tool calls" in str(exc)


def test_a_final_assistant_message_is_a_prefill_the_answer_continues(srv, alpha):
    """Anthropic's prefill: the prompt ends inside the assistant turn, and the answer is what follows it."""
    messages = [*user("Name a colour."), {"role": "assistant", "content": "My answer is"}]
    ids = srv.cache.encode_messages(messages).token_ids
    assert srv.cache.tokenizer.decode(ids).endswith("<|im_start|>assistant\nMy answer is")
    counted = alpha.messages.count_tokens(model=MODEL, messages=messages)
    r = alpha.messages.create(model=MODEL, max_tokens=4, messages=messages, extra_body={"temperature": 0})
    assert counted.input_tokens == parts(r.usage) == len(ids)
    want = srv.cache.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0, len(ids):]
    assert r.content[0].text == srv.cache.tokenizer.decode(want, skip_special_tokens=True)
    with pytest.raises(anthropic.BadRequestError, match="whitespace"):
        alpha.messages.create(model=MODEL, max_tokens=4, messages=[*messages[:1], {"role": "assistant",
                                                                                   "content": "My answer is "}])


def test_errors_reach_the_sdk_as_its_typed_exceptions(srv, alpha):
    marked = {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}
    bad = {
        "five breakpoints": dict(messages=[{"role": "user", "content": [marked] * 5}]),
        "1h after 5m": dict(system=system("5m"), messages=[{"role": "user", "content": [
            {**marked, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]),
        "image": dict(messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]),
        "forced tool": dict(messages=user("x"), tool_choice={"type": "any"},
                            tools=[{"name": "t", "input_schema": {"type": "object"}}]),
        "over the context": dict(messages=user("word " * 80), max_tokens=2_000),
    }
    for name, body in bad.items():
        body = {"model": MODEL, "max_tokens": 2, **body}
        with pytest.raises(anthropic.BadRequestError) as err:
            alpha.messages.create(**body)
            pytest.fail(f"{name}: accepted")
        assert err.value.body["type"] == "error", name
        assert err.value.body["error"]["type"] == "invalid_request_error", name
    with pytest.raises(anthropic.BadRequestError, match="temperature"):
        alpha.messages.create(model=MODEL, max_tokens=2, messages=user("x"), extra_body={"temperature": 1.5})
    with pytest.raises(anthropic.AuthenticationError) as err:
        anthropic_client(srv.url, "sk-wrong").messages.create(model=MODEL, max_tokens=2, messages=user("x"))
    assert err.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError):
        alpha.messages.create(model="claude-elsewhere", max_tokens=2, messages=user("x"))
    with pytest.raises(anthropic.NotFoundError):
        alpha.messages.count_tokens(model="claude-elsewhere", messages=user("x"))
    # Before the body is read: a stranger's oversized or broken body is still a 401.
    r = httpx.post(f"{srv.url}/v1/messages", content=b"{", headers={"x-api-key": "sk-wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert srv.cache.stats()["queries"] >= 0 and leased_refs(srv.cache) == 0


def test_a_full_queue_is_a_rate_limit_error_and_a_mid_stream_failure_an_error_event(tiny_model, tokenizer,
                                                                                     new_proxy_cache):
    cache = new_proxy_cache(tiny_model, tokenizer)
    with live(create_app(settings(workers=1, max_queue=0, request_timeout_seconds=1.0), cache=cache)) as tight, \
            hold_until_cancelled(cache):
        started, kinds = threading.Event(), []
        body = {"model": MODEL, "max_tokens": LONG, "messages": user("hold"), "stream": True}

        def hold_the_worker():
            # Its first token streamed, the answer is held (not ended) until the 1 s timeout cuts it.
            with httpx.Client(base_url=tight.url, headers={"x-api-key": ALPHA}, timeout=30) as http, \
                    http.stream("POST", "/v1/messages", json=body) as r:
                for line in r.iter_lines():
                    started.set()
                    if line.startswith("event: "):
                        kinds.append(line[7:])

        thread = threading.Thread(target=hold_the_worker)
        thread.start()
        assert started.wait(10)
        with pytest.raises(anthropic.RateLimitError) as err:
            anthropic_client(tight.url, ALPHA).messages.create(model=MODEL, max_tokens=2, messages=user("x"))
        assert err.value.body["error"]["type"] == "rate_limit_error"
        thread.join(15)
        assert kinds[0] == "message_start" and "content_block_delta" in kinds and kinds[-1] == "error", kinds
        wait_until(lambda: tight.serving.queue() == (0, 0) and leased_refs(tight.cache) == 0, timeout=10)
        with pytest.raises(anthropic.APIStatusError) as err:  # shutting down: Anthropic's 529 overloaded_error
            tight.serving.closing = True
            anthropic_client(tight.url, ALPHA).messages.create(model=MODEL, max_tokens=2, messages=user("x"))
        assert err.value.status_code == 529 and err.value.body["error"]["type"] == "overloaded_error"
        tight.serving.closing = False


def test_a_1h_breakpoint_outlives_a_5m_one(tiny_model, tokenizer, clock):
    """In process, on an injected clock: after 10 minutes only the 1h prefix is read; after 2 hours nothing."""
    cache = PrefixCache(tiny_model, tokenizer, CacheConfig(max_bytes=64 << 20, ttl_seconds=60, block_size=8,
                                                           breakpoint_min_tokens=16), clock=clock, start_sweeper=False)
    context = {"type": "text", "text": "Opening hours: nine to five, closed on Sundays. " * 3,
               "cache_control": {"type": "ephemeral", "ttl": "5m"}}
    body = dict(model=MODEL, max_tokens=2, system=system("1h"),
                messages=[{"role": "user", "content": [context, {"type": "text", "text": "Open today?"}]}])
    with TestClient(create_app(settings(), cache=cache)) as http:
        sdk = anthropic.Anthropic(base_url="http://testserver", api_key=ALPHA, max_retries=0, http_client=http)
        first = sdk.messages.create(**body).usage
        one_hour, five_min = first.cache_creation.ephemeral_1h_input_tokens, first.cache_creation.ephemeral_5m_input_tokens
        assert one_hour > 16 and five_min > 16 and first.cache_read_input_tokens == 0

        clock.advance(600)  # the default TTL (60 s) and the 5m breakpoint are over; the 1h one is not
        later = sdk.messages.create(**body).usage
        assert one_hour <= later.cache_read_input_tokens < one_hour + five_min
        assert later.cache_creation.ephemeral_5m_input_tokens > 0
        assert later.cache_creation.ephemeral_1h_input_tokens == 0

        clock.advance(2 * 3600)
        gone = sdk.messages.create(**body).usage
        assert gone.cache_read_input_tokens == 0 and gone.cache_creation.ephemeral_1h_input_tokens == one_hour
    cache.check_integrity()
    cache.close()


def test_openai_prompt_cache_parameters(srv):
    """prompt_cache_key is counted and stays in the tenant; retention 24h keeps a prefix for a day."""
    oa, ob = srv.openai(ALPHA), srv.openai(BETA)
    messages = [{"role": "system", "content": SYSTEM_TEXT}, {"role": "user", "content": "Maps?"}]
    srv.cache.flush()
    oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                               extra_body={"prompt_cache_key": "shop", "prompt_cache_retention": "24h"})
    other = ob.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                       extra_body={"prompt_cache_key": "shop"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # the same key never reaches another tenant
    again = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                       extra_body={"prompt_cache_key": "shop"})
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    with srv.cache.store._lock:  # the 24h request's blocks got a day; the other tenant's the default
        deadlines = {n.tenant: n.expires_at for n in srv.cache.store.trie.iter_nodes()}
    assert deadlines["alpha"] - deadlines["beta"] > 20 * 3600
    with pytest.raises(Exception, match="prompt_cache_retention"):
        oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                   extra_body={"prompt_cache_retention": "forever"})
    text = httpx.get(f"{srv.url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    assert 'prefixcache_prompt_cache_key_requests_total{outcome="miss",tenant="beta"} 1.0' in text
    assert 'prefixcache_prompt_cache_key_requests_total{outcome="hit",tenant="alpha"} 1.0' in text
    assert 'prefixcache_prompt_cache_retention_requests_total{retention="24h"} 1.0' in text
    assert 'prefixcache_breakpoints_total{event="write",ttl="5m"}' in text
