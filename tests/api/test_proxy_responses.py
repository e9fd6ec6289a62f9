"""OpenAI's Responses API through the official ``openai`` client: answers equal chat's for the same conversation,
streamed events in order, tool calls and their outputs, cached tokens, stored responses continued with
previous_response_id, and every field that would change the answer refused with a 400 naming it."""
from __future__ import annotations

import asyncio
import json

import openai
import pytest
from prefixcache_api import create_app
from prefixcache_api.responses.store import ResponseStore
from proxy_support import ALPHA, BETA, MODEL, held_stream, live, make_cache, metric_samples
from proxy_support import settings as proxy_settings

from tests.support.tool_templates import TEXT_BEFORE, family_tokenizer, scripted_model


@pytest.fixture
def rsrv(server):
    """The shared server, its cache flushed."""
    server.cache.flush()
    return server


@pytest.fixture
def client(rsrv):
    return rsrv.openai(ALPHA)


def chat_of(client, messages, **body):
    return client.chat.completions.create(model=MODEL, messages=messages, **body)


def test_a_string_input_is_answered_as_the_same_chat(client):
    r = client.responses.create(model=MODEL, input="Tell me a story", max_output_tokens=6)
    chat = chat_of(client, [{"role": "user", "content": "Tell me a story"}], max_tokens=6)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # 6 tokens reached
    assert r.output_text == chat.choices[0].message.content
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert item.id.startswith("msg_") and item.status == "incomplete"
    u = r.usage
    assert (u.input_tokens, u.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens) == \
        (u.input_tokens, 6)
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens_details.reasoning_tokens == 0
    assert r.max_output_tokens == 6 and r.store is True and r.parallel_tool_calls is True and r.tool_choice == "auto"
    assert r.tools == [] and r.previous_response_id is None and r.error is None


def test_items_and_instructions_are_the_chat_messages(client):
    items = [{"role": "developer", "content": "Answer in French."},
             {"role": "user", "content": [{"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": "there"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Bonjour",
                                                                    "annotations": []}]},
             {"role": "user", "content": "How are you?"}]
    r = client.responses.create(model=MODEL, input=items, instructions="You are brief.", max_output_tokens=5,
                                temperature=0, metadata={"run": "1"}, prompt_cache_key="fr", user="u1",
                                safety_identifier="s1")
    chat = chat_of(client, [{"role": "system", "content": "You are brief."},
                            {"role": "developer", "content": "Answer in French."},
                            {"role": "user", "content": "Hello\nthere"}, {"role": "assistant", "content": "Bonjour"},
                            {"role": "user", "content": "How are you?"}], max_tokens=5, temperature=0)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert (r.instructions, r.metadata, r.prompt_cache_key, r.user, r.safety_identifier) == \
        ("You are brief.", {"run": "1"}, "fr", "u1", "s1")


def test_a_repeated_prefix_reports_cached_tokens(client):
    body = dict(model=MODEL, instructions="You are a helpful assistant. " * 8, input="Hi", max_output_tokens=2)
    first = client.responses.create(**body)
    second = client.responses.create(**body)
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1  # the last token recomputed
    assert second.usage.input_tokens_details.cached_tokens > 0


def test_previous_response_id_continues_as_the_whole_conversation(client):
    first = client.responses.create(model=MODEL, instructions="Be brief.", input="Name a color.", max_output_tokens=4)
    follow = client.responses.create(model=MODEL, instructions="Be brief.", input="And another?", max_output_tokens=4,
                                     previous_response_id=first.id)
    whole = client.responses.create(model=MODEL, instructions="Be brief.", max_output_tokens=4, store=False, input=[
        {"role": "user", "content": "Name a color."}, *[item.model_dump(exclude_none=True) for item in first.output],
        {"role": "user", "content": "And another?"}])
    assert follow.previous_response_id == first.id
    assert follow.output_text == whole.output_text and follow.usage.input_tokens == whole.usage.input_tokens
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens  # the stored turn, from the cache
    # A third turn goes on from the second (the first's turn included); instructions are not carried over.
    third = client.responses.create(model=MODEL, input="Last one.", max_output_tokens=3, previous_response_id=follow.id)
    flat = client.responses.create(model=MODEL, max_output_tokens=3, store=False, input=[
        {"role": "user", "content": "Name a color."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And another?"}, {"role": "assistant", "content": follow.output_text},
        {"role": "user", "content": "Last one."}])
    assert third.output_text == flat.output_text and third.usage.input_tokens == flat.usage.input_tokens


def test_a_stored_response_expires_and_the_store_is_bounded(tiny_model, tokenizer, clock):
    """The server's clock times stored responses: one older than its retention is not found; a tenant keeps at
    most its count, oldest dropped first."""
    cache = make_cache(tiny_model, tokenizer)
    app = create_app(proxy_settings(), cache=cache, clock=clock)
    app.state.responses = ResponseStore(clock, per_tenant=2, retain_seconds=60)
    try:
        with live(app) as server:
            client = server.openai(ALPHA)
            ids = [client.responses.create(model=MODEL, input=f"Hi {i}", max_output_tokens=1).id for i in range(3)]
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(ids[0])  # pushed out by the third
            assert client.responses.retrieve(ids[1]).id == ids[1]
            clock.advance(61)
            with pytest.raises(openai.BadRequestError, match="not found"):
                client.responses.create(model=MODEL, input="Hi", previous_response_id=ids[2])
    finally:
        cache.close()


def test_the_store_bounds_bytes_and_tenants(clock):
    store = ResponseStore(clock, tenants=2, max_bytes=2000)
    body = {"id": "resp_a", "output": "x" * 500}
    store.put("t1", body, [])
    store.put("t2", {**body, "id": "resp_b"}, [])
    assert store.get("t1", "resp_a") is not None and store.get("t2", "resp_a") is None  # ids are per tenant
    store.put("t3", {**body, "id": "resp_c"}, [])  # a third tenant: the least recently storing one's go
    assert store.get("t1", "resp_a") is None and store.get("t2", "resp_b") is not None
    for i in range(3):
        store.put("t3", {**body, "id": f"resp_{i}"}, [])
    # Over the bytes: the tenant holding the most loses its oldest, so t3's traffic never pushes out t2's one.
    assert store.nbytes <= 2000 and store.get("t2", "resp_b") is not None and store.get("t3", "resp_c") is None
    assert [store.get("t3", f"resp_{i}") is not None for i in range(3)] == [False, True, True]
    store.put("t3", {"id": "resp_big", "output": "x" * 5000}, [])  # larger than the whole budget: not kept
    assert store.get("t3", "resp_big") is None and store.get("t3", "resp_2") is not None
    # The response being stored is kept: t2's large one pushes out t3's oldest (t3 held twice what t2 held), then,
    # the two holding as much, t2's own oldest.
    store.put("t2", {"id": "resp_large", "output": "x" * 1200}, [])
    assert store.get("t2", "resp_large") is not None and store.get("t2", "resp_b") is None
    assert store.get("t3", "resp_1") is None and store.get("t3", "resp_2") is not None and store.nbytes <= 2000
    assert store.delete("t2", "resp_large") and not store.delete("t2", "resp_large")
    store.check_integrity()


def chain(store: ResponseStore, tenant: str, turns: int, text: str = "x", start: int = 0) -> list[str]:
    """Store ``turns`` responses for ``tenant``, each continuing the one before: one user message of ``text`` and
    an answer each."""
    ids, previous = [], None
    for i in range(start, start + turns):
        response = {"id": f"resp_{tenant}{i}", "output": [{"type": "message", "content": [{"text": f"ok {i}"}]}]}
        store.put(tenant, response, [{"role": "user", "content": text}, {"role": "assistant", "content": f"ok {i}"}],
                  previous=previous)
        ids.append(response["id"])
        previous = store.get(tenant, response["id"])
    return ids


def test_a_chain_counts_each_turn_once(clock):
    """100 turns of 10 KB: a stored response holds its own turn and a link to the one it continued, so the chain
    counts each turn's bytes once (linear), where storing each turn's whole conversation counted ~50 MB."""
    text = "x" * 10_000
    linked = ResponseStore(clock)
    ids = chain(linked, "t", 100, text)
    one = ResponseStore(clock)
    chain(one, "t", 1, text, start=99)
    copied, conversation = ResponseStore(clock), []  # as if each response held its whole conversation
    for i in range(100):
        conversation = conversation + [{"role": "user", "content": text}, {"role": "assistant", "content": f"ok {i}"}]
        copied.put("t", {"id": f"resp_t{i}", "output": []}, conversation)
    print(f"100-turn chain of 10 KB turns: {linked.nbytes:,} bytes counted linked, {copied.nbytes:,} copied")
    assert 100 * 10_000 < linked.nbytes <= 100 * one.nbytes < 1.1e6 and copied.nbytes > 50e6
    whole = linked.get("t", ids[-1]).conversation()
    assert len(whole) == 200 and [m["content"] for m in whole[1::2]] == [f"ok {i}" for i in range(100)]
    linked.check_integrity()


def test_a_dropped_response_stays_in_the_conversations_that_continue_it(clock):
    """A response continued by others is pinned by them: deleted, expired or pushed out it can no longer be read or
    continued, but every response after it keeps its whole conversation (never a shorter one), and its bytes count
    until the last of them goes."""
    store = ResponseStore(clock, per_tenant=2, retain_seconds=60)
    first, second, third = chain(store, "t", 3)  # the third pushes the first out
    full = store.get("t", third).conversation()
    assert store.get("t", first) is None and [m["content"] for m in full[1::2]] == ["ok 0", "ok 1", "ok 2"]
    assert store.delete("t", second) and store.get("t", second) is None
    assert store.get("t", third).conversation() == full
    store.check_integrity()  # the first two are counted, held by the third
    fork = chain(store, "t", 2, start=10)  # another chain: the third, oldest, is pushed out, and its turns with it
    assert store.get("t", third) is None and store.nbytes == sum(store.get("t", i).nbytes for i in fork)
    store.check_integrity()
    store.delete("t", fork[1])
    # A branch continued from a response that is dropped while the request runs: its turn is counted again.
    kept = store.get("t", fork[0])
    store.delete("t", fork[0])
    assert store.nbytes == 0
    store.put("t", {"id": "resp_branch", "output": []}, [{"role": "user", "content": "more"}], previous=kept)
    assert store.get("t", "resp_branch").conversation()[:2] == kept.conversation()
    assert store.nbytes == kept.nbytes + store.get("t", "resp_branch").nbytes
    store.check_integrity()
    clock.advance(61)  # the whole chain expires with its last response
    assert store.get("t", "resp_branch") is None and store.nbytes == 0
    store.check_integrity()


def test_the_byte_budget_never_drops_the_conversation_being_stored(clock):
    """Over the bytes, the storing tenant loses its oldest response outside the conversation being stored (whose
    turns it could not free), and a conversation larger than the whole budget is not kept."""
    store = ResponseStore(clock, max_bytes=2000)
    ids = chain(store, "t", 3, "y" * 300)  # about 460 bytes a turn
    other = chain(store, "t", 1, "z" * 100, start=10)
    own = chain(store, "t", 1, "z" * 100, start=11)  # about 1,900 bytes held
    previous = store.get("t", ids[2])
    store.put("t", {"id": "resp_next", "output": []}, [{"role": "user", "content": "y" * 200}], previous=previous)
    assert store.get("t", "resp_next").conversation()[:6] == previous.conversation()
    assert store.get("t", other[0]) is None and store.nbytes <= 2000  # the oldest outside the conversation
    assert all(store.get("t", i) is not None for i in ids + own)
    store.check_integrity()
    store.put("t", {"id": "resp_huge", "output": []}, [{"role": "user", "content": "y" * 800}],
              previous=store.get("t", "resp_next"))
    assert store.get("t", "resp_huge") is None and store.get("t", "resp_next") is not None
    store.check_integrity()


def test_each_turn_of_a_chain_adds_only_its_own_bytes(tiny_model, tokenizer, clock):
    """Continued by previous_response_id, each stored turn counts its own input and output, not the conversation
    before it again: the store grows by about the same bytes a turn however long the chain, and a chain whose
    first turn is deleted still continues as its whole conversation."""
    cache = make_cache(tiny_model, tokenizer)
    app = create_app(proxy_settings(), cache=cache, clock=clock)
    store = app.state.responses = ResponseStore(clock)
    text = "Tell me more about the weather in Paris today. " * 6
    try:
        with live(app) as server:
            client = server.openai(ALPHA)
            counted, turns, previous = [], [], None
            for _ in range(5):
                turns.append(client.responses.create(model=MODEL, input=text, max_output_tokens=1, temperature=0,
                                                     previous_response_id=previous))
                counted.append(store.nbytes)
                previous = turns[-1].id
            added = [b - a for a, b in zip(counted, counted[1:])]
            assert max(added) - min(added) < len(text), counted  # storing whole conversations adds a turn each
            store.check_integrity()
            client.responses.delete(turns[0].id)
            last = client.responses.create(model=MODEL, input="And tomorrow?", max_output_tokens=2, temperature=0,
                                           previous_response_id=previous)
            whole = client.responses.create(model=MODEL, max_output_tokens=2, temperature=0, store=False, input=[
                *[m for r in turns for m in ({"role": "user", "content": text},
                                             {"role": "assistant", "content": r.output_text})],
                {"role": "user", "content": "And tomorrow?"}])
            assert (last.output_text, last.usage.input_tokens) == (whole.output_text, whole.usage.input_tokens)
            with pytest.raises(openai.BadRequestError, match="not found"):
                client.responses.create(model=MODEL, input="Hi", previous_response_id=turns[0].id)
    finally:
        cache.close()


def test_stored_responses_are_per_tenant_and_store_false_keeps_nothing(rsrv, client):
    kept = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    other = rsrv.openai(BETA)
    with pytest.raises(openai.BadRequestError) as err:
        other.responses.create(model=MODEL, input="Hi", previous_response_id=kept.id)
    assert err.value.body["code"] == "previous_response_not_found"
    assert err.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(kept.id)  # nor forget it
    assert client.responses.retrieve(kept.id).id == kept.id
    unkept = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert unkept.store is False
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(model=MODEL, input="Hi", previous_response_id=unkept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    client.responses.delete(kept.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(model=MODEL, input="Hi", previous_response_id=kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(kept.id)


def test_reading_a_stored_response_refuses_what_it_cannot_give(client):
    """A stored response is read whole: streaming it back (which the client would read as no events at all) is a
    400 naming the parameter; include values change nothing (logprobs are there if creating it asked)."""
    kept = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.retrieve(kept.id, stream=True)
    assert err.value.body["param"] == "stream", err.value.body
    for include in (["reasoning.encrypted_content"], ["message.output_text.logprobs"]):
        again = client.responses.retrieve(kept.id, include=include)
        assert again.output_text == kept.output_text and again.output[0].content[0].logprobs == []


REFUSED = [
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]),
     "input[0].content[0].type"),
    (dict(input=[{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]),
     "input[0].content[0].type"),
    (dict(input=[{"type": "reasoning", "id": "rs_1", "summary": []}]), "input[0].type"),
    (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input[0].type"),
    (dict(tools=[{"type": "web_search"}]), "tools[0].type"),
    (dict(text={"verbosity": "low"}), "text.verbosity"),
    (dict(reasoning={"effort": "high"}), "reasoning.effort"),
    (dict(background=True), "background"),
    (dict(truncation="auto"), "truncation"),
    (dict(top_logprobs=2), "top_logprobs"),  # without include message.output_text.logprobs
    (dict(extra_body={"conversation": "conv_1"}), "conversation"),
    (dict(extra_body={"prompt": {"id": "pmpt_1"}}), "prompt"),
    (dict(max_output_tokens=5000), "max_output_tokens"),  # over the server's max_tokens_limit
    (dict(tool_choice={"type": "allowed_tools", "mode": "auto", "tools": []}), "tool_choice"),
]


@pytest.mark.parametrize("fields, param", REFUSED, ids=[p for _, p in REFUSED])
def test_fields_that_would_change_the_answer_are_refused(client, fields, param):
    body = {"model": MODEL, "input": "Hi", **fields}
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**body)
    assert err.value.status_code == 400 and err.value.body["param"] == param, err.value.body
    assert err.value.body["type"] == "invalid_request_error"


def test_fields_that_change_nothing_are_accepted(client):
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, text={"format": {"type": "text"},
                                "verbosity": "medium"}, reasoning={"effort": "none"}, truncation="disabled",
                                background=False, include=["reasoning.encrypted_content"], top_logprobs=0,
                                service_tier="auto", prompt_cache_retention="in_memory", parallel_tool_calls=False)
    assert r.status in ("completed", "incomplete") and r.parallel_tool_calls is False


# -- tool calls ----------------------------------------------------------------------
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def hermes(tokenizer):
    tok = family_tokenizer(tokenizer, "hermes")
    cache = make_cache(scripted_model(tok, "hermes"), tok)
    with live(create_app(proxy_settings(default_max_tokens=16), cache=cache)) as server:
        yield server
    cache.close()


def test_a_function_call_and_its_output_round_trip_as_chat_tool_calls(hermes):
    client = hermes.openai(ALPHA)
    r = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER], prompt_cache_key="weather")
    chat = chat_of(client, [{"role": "user", "content": ASK}], tools=[CHAT_WEATHER])
    calls = [item for item in r.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert r.output_text == (chat.choices[0].message.content or "") == TEXT_BEFORE["hermes"]
    assert calls[0].id.startswith("fc_") and calls[0].call_id.startswith("call_") and r.status == "completed"
    assert r.tools[0].name == "get_weather" and r.tools[0].strict is False
    # Its output back, with the call items as the client holds them: the previous prompt comes from the cache.
    back = [{"role": "user", "content": ASK}, *[item.model_dump(exclude_none=True) for item in r.output],
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C, sunny"}]
    second = client.responses.create(model=MODEL, input=back, tools=[WEATHER], max_output_tokens=4)
    assert second.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens
    chat_back = [{"role": "user", "content": ASK}, chat.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": chat.choices[0].message.tool_calls[0].id, "content": "18 C, sunny"}]
    chat_second = chat_of(client, chat_back, tools=[CHAT_WEATHER], max_tokens=4)
    assert second.usage.input_tokens == chat_second.usage.prompt_tokens  # Hermes' template renders no call ids
    # The same turn by previous_response_id: the stored call and the output item alone.
    follow = client.responses.create(model=MODEL, previous_response_id=r.id, tools=[WEATHER], max_output_tokens=4,
                                     input=[back[-1]])
    assert (follow.output_text, follow.usage.input_tokens) == (second.output_text, second.usage.input_tokens)


def test_tool_choice_none_and_a_named_function(hermes):
    client = hermes.openai(ALPHA)
    r = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER], tool_choice="none")
    assert all(item.type == "message" for item in r.output) and "get_weather" in r.output_text
    named = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"})
    assert named.tool_choice.name == "get_weather" and named.output[-1].type == "function_call"


def strict(tool: dict, **parameters) -> dict:
    schema = {**tool["parameters"], "additionalProperties": False, **parameters}
    return {**tool, "strict": True, "parameters": schema}


def test_strict_tools_are_validated_as_chat_s(hermes):
    client = hermes.openai(ALPHA)
    ok = client.responses.create(model=MODEL, input=ASK, tools=[strict(WEATHER)])
    assert ok.output[-1].type == "function_call" and ok.tools[0].strict is True
    london = strict(WEATHER, properties={"city": {"type": "string", "enum": ["London"]}})
    with pytest.raises(openai.InternalServerError) as err:
        client.responses.create(model=MODEL, input=ASK, tools=[london])
    assert err.value.body["code"] == "tool_arguments_invalid"
    loose = {**WEATHER, "strict": True}  # no additionalProperties false: against OpenAI's strict rules
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=ASK, tools=[loose])
    assert err.value.body["param"].startswith("tools[0].parameters"), err.value.body


# -- streaming -----------------------------------------------------------------------
def event_types(events) -> list[str]:
    return [e.type for e in events]


def test_a_stream_sends_the_events_in_order_and_ends_as_the_answer(client):
    body = dict(model=MODEL, instructions="Be brief.", input="Tell me a story", max_output_tokens=5)
    whole = client.responses.create(**body)
    events = list(client.responses.create(**body, stream=True))
    kinds = event_types(events)
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"] and deltas >= 1  # 5 tokens: max_output_tokens reached
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    last = events[-1].response
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert last.output_text == whole.output_text and last.usage.input_tokens == whole.usage.input_tokens
    assert last.status == "incomplete" and last.incomplete_details.reason == "max_output_tokens"
    # Stored as streamed: retrievable and continued.
    assert client.responses.retrieve(last.id).output_text == whole.output_text


def test_the_client_stream_helper_assembles_the_final_response(hermes):
    """``responses.stream``: its text events and its final response, the unstreamed answer (a text answer that
    ends by itself: the scripted model's, with its tools hidden)."""
    client = hermes.openai(ALPHA)
    body = dict(model=MODEL, input=ASK, tools=[WEATHER], tool_choice="none")
    whole = client.responses.create(**body)
    with client.responses.stream(**body) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert whole.status == final.status == "completed"
    assert "".join(texts) == final.output_text == whole.output_text
    assert plain(final.output) == plain(whole.output)
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens, whole.usage.output_tokens)


def plain(items) -> list[dict]:
    """Output items without each response's own ids and what the stream helper adds (parsed values)."""
    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in ("id", "call_id", "parsed", "parsed_arguments")}
        return [strip(v) for v in value] if isinstance(value, list) else value
    return [strip(item.model_dump()) for item in items]


def test_a_streamed_function_call_is_the_unstreamed_one(hermes):
    client = hermes.openai(ALPHA)
    body = dict(model=MODEL, input=ASK, tools=[WEATHER])
    whole = client.responses.create(**body)
    with client.responses.stream(**body) as stream:
        kinds = event_types(stream)
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed" and "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    assert plain(final.output) == plain(whole.output)
    call = [i for i in final.output if i.type == "function_call"][0]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert final.output_text == whole.output_text == TEXT_BEFORE["hermes"]


def test_a_failure_once_streaming_is_an_error_event_then_a_failed_response(hermes):
    """A strict tool's call that breaks its schema is found only as the call completes: after the headers."""
    client = hermes.openai(ALPHA)
    london = strict(WEATHER, properties={"city": {"type": "string", "enum": ["London"]}})
    errors = ("prefixcache_request_errors_total", (("route", "/v1/responses"), ("status", "500")))
    before = metric_samples(hermes).get(errors, 0)
    events = list(client.responses.create(model=MODEL, input=ASK, tools=[london], stream=True))
    kinds = event_types(events)
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-2:] == ["error", "response.failed"]
    assert events[-2].code == "tool_arguments_invalid" and events[-1].response.status == "failed"
    assert events[-1].response.error.message == events[-2].message
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert metric_samples(hermes)[errors] == before + 1  # counted once, as chat's stream errors are


def test_responses_are_counted_under_their_own_endpoint(rsrv, client):
    def served() -> float:
        return sum(v for (name, labels), v in metric_samples(rsrv).items()
                   if name == "prefixcache_requests_total" and ("endpoint", "responses") in labels)
    before = served()
    client.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
    list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, stream=True))
    assert served() == before + 2


MALFORMED = [
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"text": "no type"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "robot", "content": "Hi"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]},
     "input[0].output[0].type"),
    ({"metadata": {"k": 5}}, "metadata.k"),
    ({"tools": [{"type": "function", "name": "f", "function": {"name": "f"}}]}, "tools[0].function"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
]


@pytest.mark.parametrize("fields, param", MALFORMED, ids=[p for _, p in MALFORMED])
def test_malformed_requests_are_400s_naming_the_field(rsrv, fields, param):
    with rsrv.client(ALPHA) as http:
        r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_response_takes_one_of_the_key_s_places_as_a_chat_does(tiny_model, tokenizer):
    """With a key's one place held (a long chat stream), its response is refused before its body is read (a 429,
    not the 413 of a body over max_body_bytes); another key's is served."""
    cache = make_cache(tiny_model, tokenizer)
    long_chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1500, "stream": True,
                 "logit_bias": {str(tokenizer.eos_token_id): -100}}
    try:
        with live(create_app(proxy_settings(tenant_max_in_flight=1), cache=cache)) as server, \
                held_stream(server, ALPHA, "/v1/chat/completions", long_chat):
            huge = b'{"model": "m", "input": "' + b"x" * (6 << 20) + b'"}'
            with server.client(ALPHA) as http:
                r = http.post("/v1/responses", content=huge, headers={"content-type": "application/json"})
            assert r.status_code == 429 and r.json()["error"]["code"] == "tenant_busy", r.text[:300]
            assert server.openai(BETA).responses.create(model=MODEL, input="Hi", max_output_tokens=1).usage
    finally:
        cache.close()


def test_prompt_cache_options_write_breakpoints_as_chat_s(srv):
    """On the breakpoint server (breakpoints of 16 tokens and more): a response writes what chat's request of the
    same conversation writes, and a later request reads it."""
    client = srv.openai(ALPHA)
    options = {"mode": "implicit", "ttl": "30m"}
    body = dict(model=MODEL, instructions="You are a helpful assistant. " * 8, input="Hi", max_output_tokens=2)
    srv.cache.flush()
    chat = chat_of(client, [{"role": "system", "content": body["instructions"]}, {"role": "user", "content": "Hi"}],
                   max_tokens=2, prompt_cache_options=options)
    srv.cache.flush()
    first = client.responses.create(**body, prompt_cache_options=options)
    written = first.usage.input_tokens_details.cache_write_tokens
    assert written > 0 and written == chat.usage.prompt_tokens_details.cache_write_tokens
    again = client.responses.create(**body, prompt_cache_options=options)
    assert again.usage.input_tokens_details.cached_tokens >= written


# -- the Agents SDK ------------------------------------------------------------------
def run_agent(server, stream: bool, **run) -> tuple[object, list[str], list[str]]:
    """An Agents SDK agent (its default OpenAIResponsesModel) with a function tool, run to its end: the result,
    the cities its tool was called with, and the raw events streamed. The tool is offered until it has been
    called, so the scripted model answers the second turn as text."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    calls: list[str] = []

    @agents.function_tool(is_enabled=lambda ctx, agent: not calls)
    def get_weather(city: str) -> str:
        """Weather of a city."""
        calls.append(city)
        return "18 C, sunny"

    async def go():
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=ALPHA, max_retries=0, timeout=60)
        agent = agents.Agent(name="weather", instructions="You are brief.", tools=[get_weather],
                             model=agents.OpenAIResponsesModel(MODEL, client))
        if not stream:
            return await agents.Runner.run(agent, ASK, max_turns=3, **run), []
        result = agents.Runner.run_streamed(agent, ASK, max_turns=3, **run)
        kinds = [e.data.type async for e in result.stream_events() if e.type == "raw_response_event"]
        return result, kinds

    agents.set_tracing_disabled(True)
    result, kinds = asyncio.run(go())
    return result, calls, kinds


def test_an_agents_sdk_agent_calls_its_tool_and_answers(hermes):
    """Runner.run sends each turn's whole conversation (the call and its output as items), Runner.run_streamed
    reads the events, and with auto_previous_response_id the second turn continues the stored first."""
    ran, calls, _ = run_agent(hermes, stream=False)
    assert calls == ["Paris"] and len(ran.raw_responses) == 2
    first, second = ran.raw_responses
    assert [item.type for item in first.output] == ["message", "function_call"]
    assert ran.final_output == second.output[0].content[0].text and "get_weather" in ran.final_output
    streamed, calls, kinds = run_agent(hermes, stream=True)
    assert calls == ["Paris"] and streamed.final_output == ran.final_output
    assert kinds.count("response.completed") == 2 and "response.function_call_arguments.done" in kinds
    chained, calls, _ = run_agent(hermes, stream=False, auto_previous_response_id=True)
    assert calls == ["Paris"] and chained.final_output == ran.final_output
    assert chained.raw_responses[1].usage.input_tokens == second.usage.input_tokens


def test_a_stored_answer_continues_as_its_items_sent_back():
    """Text after a call is its own assistant message when the items are sent back; a stored answer continues as
    the same messages, not as its texts joined before its calls."""
    from prefixcache_api.responses.protocol import OutputFunctionCall, OutputMessage, OutputText, ResponsesRequest
    from prefixcache_api.responses.translate import input_messages, output_messages

    output = [OutputMessage(id="msg_1", status="completed", content=[OutputText(text="Checking.")]),
              OutputFunctionCall(id="fc_1", status="completed", call_id="call_1", name="get_weather",
                                 arguments='{"city": "Paris"}'),
              OutputMessage(id="msg_2", status="completed", content=[OutputText(text="Asked.")])]
    sent_back = ResponsesRequest.model_validate({"model": MODEL, "input": [item.model_dump() for item in output]})
    assert output_messages(output) == input_messages(sent_back)
    assert [m["role"] for m in output_messages(output)] == ["assistant", "assistant"]


def test_a_function_call_output_must_answer_a_call_of_the_conversation(hermes):
    """A function_call_output whose call_id matches no function_call of the input or of the previous responses'
    conversation is OpenAI's 400 naming it; one answering a call sent or stored earlier is served."""
    client = hermes.openai(ALPHA)
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    answered = [{"role": "user", "content": ASK}, call, {"type": "function_call_output", "call_id": "call_1",
                                                        "output": "18 C"}]
    client.responses.create(model=MODEL, input=answered, max_output_tokens=1)
    first = client.responses.create(model=MODEL, input=answered[:2], max_output_tokens=1)
    again = client.responses.create(model=MODEL, input=[answered[2]], max_output_tokens=1,
                                    previous_response_id=first.id)  # the call is in the stored conversation
    for body in (dict(input=[answered[0], {**answered[2], "call_id": "call_nowhere"}]),
                 dict(input=[{"role": "user", "content": "Hi"}, {**answered[2], "call_id": "call_nowhere"}],
                      previous_response_id=again.id)):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=MODEL, max_output_tokens=1, **body)
        assert err.value.body["message"] == "No tool call found for function call output with call_id call_nowhere."
        assert (err.value.body["type"], err.value.body["param"]) == ("invalid_request_error", "input[1].call_id")


def test_a_call_id_is_one_call_and_one_output(hermes):
    """Two function_calls with one call_id, or two function_call_outputs answering one, in the input or repeating
    the previous responses' conversation, are a 400 naming the repeat: the output would be paired with the wrong
    call, or the call answered twice."""
    client = hermes.openai(ALPHA)
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}
    ask = {"role": "user", "content": ASK}
    stored = client.responses.create(model=MODEL, input=[ask, call, output], max_output_tokens=1)
    for body, at, kind in ((dict(input=[ask, call, {**call, "arguments": '{"city": "Rome"}'}, output]), 2, "function_call"),
                           (dict(input=[ask, call, output, {**output, "output": "20 C"}]), 3, "function_call_output"),
                           (dict(input=[ask, call], previous_response_id=stored.id), 1, "function_call"),
                           (dict(input=[output], previous_response_id=stored.id), 0, "function_call_output")):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=MODEL, max_output_tokens=1, **body)
        assert err.value.body["message"] == f"Duplicate {kind} for call_id call_1: each function_call has its own " \
            "call_id and one function_call_output."
        assert (err.value.body["type"], err.value.body["param"]) == ("invalid_request_error", f"input[{at}].call_id")
    parallel = [ask, call, {**call, "call_id": "call_2"}, output, {**output, "call_id": "call_2"}]
    assert client.responses.create(model=MODEL, input=parallel, max_output_tokens=1).status == "incomplete"
