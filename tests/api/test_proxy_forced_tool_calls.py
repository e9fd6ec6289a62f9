"""A forced call to strict tools is constrained to their schemas: through a live proxy, with the official ``openai``
client (``tool_choice`` "required" and a named function) and ``anthropic`` client (``any`` and ``tool``), for each
template family, on both engines, greedy and sampled.

The model is a tiny random Llama: unconstrained it writes garbage, so a call that parses in the family's syntax and
matches its schema shows the constraint at work.
"""
from __future__ import annotations

import json
import logging

import jsonschema
import pytest
import torch
from prefixcache_api import create_app
from proxy_support import ALPHA, MODEL, anthropic_client, live, settings
from transformers import LlamaConfig, LlamaForCausalLM

from prefixcache import CacheConfig, PrefixCache
from tests.support.tool_templates import family_tokenizer

FAMILIES = ("hermes", "llama3_json", "mistral")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]},
                                            "detailed": {"type": "boolean"}},
           "required": ["city", "detailed"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
         "required": ["zone"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
TOOLS = [{"type": "function", "function": {"name": name, "strict": True, "parameters": schema}}
         for name, schema in SCHEMAS.items()]
ANTHROPIC_TOOLS = [{"name": name, "strict": True, "input_schema": schema} for name, schema in SCHEMAS.items()]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}
SAMPLINGS = [{"temperature": 0}, {"temperature": 1.0, "seed": 5}]


def random_model(tok) -> torch.nn.Module:
    """A tiny random Llama over ``tok``'s vocabulary (its added tokens included)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048)).eval()
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


@pytest.fixture(scope="module", params=[(f, b) for f in FAMILIES for b in (True, False)],
                ids=[f"{f}-{'batched' if b else 'serial'}" for f in FAMILIES for b in (True, False)])
def proxy(request, tokenizer):
    family, batching = request.param
    tok = family_tokenizer(tokenizer, family)
    cache = PrefixCache(random_model(tok), tok, CacheConfig(max_bytes=256 << 20), batching=batching)
    with live(create_app(settings(), cache=cache)) as srv:
        yield srv
    cache.close()


def checked(calls: list[tuple[str, dict]], names: set[str]) -> list[tuple[str, dict]]:
    """``calls``, each to one of ``names`` with arguments that match its schema."""
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(arguments, SCHEMAS[name])
    return calls


def openai_calls(response) -> list[tuple[str, dict]]:
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    return [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled"])
@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_openai_forced_strict_call_matches_its_schema_and_the_cached_answer_is_the_same(proxy, choice, sampling):
    client = proxy.openai(ALPHA)
    proxy.cache.flush()
    body = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                max_tokens=200, **sampling)
    first = client.chat.completions.create(**body)
    names = set(SCHEMAS) if choice == "required" else {"get_time"}
    calls = checked(openai_calls(first), names)
    assert len(calls) == 1
    again = client.chat.completions.create(**body)  # its prompt read from the cache
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert openai_calls(again) == calls
    streamed = {}
    for chunk in client.chat.completions.create(**body, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            entry = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == calls


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0}], ids=["greedy", "sampled"])
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_time"}], ids=["any", "tool"])
def test_anthropic_forced_strict_call_matches_its_schema_and_the_cached_answer_is_the_same(proxy, choice, sampling):
    claude = anthropic_client(proxy.url, ALPHA)
    proxy.cache.flush()
    body = dict(model=MODEL, max_tokens=200, messages=ASK, tools=ANTHROPIC_TOOLS,
                tool_choice={**choice, "disable_parallel_tool_use": True},
                extra_body={**sampling, "cache_control": {"type": "ephemeral"}})
    first = claude.messages.create(**body)
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["tool_use"]
    names = set(SCHEMAS) if choice["type"] == "any" else {"get_time"}
    calls = checked([(b.name, b.input) for b in first.content], names)
    again = claude.messages.create(**body)
    assert again.usage.cache_read_input_tokens > 0  # its prompt read from the cache
    assert again.stop_reason == "tool_use"
    again_calls = checked([(b.name, b.input) for b in again.content], names)
    if not sampling["temperature"]:  # Anthropic's API takes no seed: only a greedy answer is the same
        assert again_calls == calls


def test_parallel_calls_each_match_their_schema(proxy):
    """With parallel calls allowed the answer is one call or more, each held to its tool's schema."""
    client = proxy.openai(ALPHA)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=600, temperature=1.0, seed=5)
    checked(openai_calls(r), set(SCHEMAS))


def cut_at(create, whole_tokens: int, cut):
    """``create(limit)`` for the largest limit under ``whole_tokens`` (the whole answer's) whose answer ``cut``
    says ends inside its call, the call's name written: the answer, greedy, is the whole one cut short."""
    for limit in range(whole_tokens - 1, 0, -1):
        answer = create(limit)
        if cut(answer):
            return limit, answer
    raise AssertionError("no limit cut the call after its name")


def test_openai_forced_call_cut_by_max_tokens_is_served_with_its_partial_arguments(proxy):
    """As OpenAI serves a call max_tokens cut: a 200, finish_reason "length", the call with the arguments written
    so far (no JSON yet), streamed or not; not a server error, though every tool is strict."""
    client = proxy.openai(ALPHA)
    body = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                temperature=0)
    whole = client.chat.completions.create(**body, max_tokens=200)
    [(name, _)] = openai_calls(whole)
    limit, cut = cut_at(lambda limit: client.chat.completions.create(**body, max_tokens=limit),
                        whole.usage.completion_tokens,
                        lambda r: r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls)
    [call] = cut.choices[0].message.tool_calls
    assert call.function.name == name and not cut.choices[0].message.content
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)
    streamed, finish = {}, None
    for chunk in client.chat.completions.create(**body, max_tokens=limit, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            entry = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason if chunk.choices else finish
    assert finish == "length"
    assert list(streamed.values()) == [{"name": name, "arguments": call.function.arguments}]


def test_anthropic_forced_call_cut_by_max_tokens_is_an_incomplete_tool_use_block(proxy):
    """As Anthropic serves it: stop_reason "max_tokens", the tool_use block cut short (its input the members
    written whole), streamed or not."""
    claude = anthropic_client(proxy.url, ALPHA)
    body = dict(model=MODEL, messages=ASK, tools=ANTHROPIC_TOOLS, extra_body={"temperature": 0},
                tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    whole = claude.messages.create(**body, max_tokens=200)
    assert whole.stop_reason == "tool_use"
    limit, cut = cut_at(lambda limit: claude.messages.create(**body, max_tokens=limit), whole.usage.output_tokens,
                        lambda m: m.stop_reason == "max_tokens" and m.content and m.content[-1].type == "tool_use")
    [block] = cut.content
    assert block.name == "get_weather" and set(block.input) <= set(WEATHER["properties"])
    with claude.messages.stream(**body, max_tokens=limit) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "max_tokens"
    assert [(b.type, b.name, b.input) for b in streamed.content] == [("tool_use", block.name, block.input)]


def test_responses_forced_call_cut_by_max_output_tokens_is_an_incomplete_response(proxy):
    """The Responses API's: status "incomplete" (max_output_tokens), the function_call item incomplete with the
    arguments written so far, streamed or not."""
    client = proxy.openai(ALPHA)
    tools = [{"type": "function", "name": t["function"]["name"], "strict": True,
              "parameters": t["function"]["parameters"]} for t in TOOLS]
    body = dict(model=MODEL, input=ASK, tools=tools, tool_choice="required", parallel_tool_calls=False,
                temperature=0)
    whole = client.responses.create(**body, max_output_tokens=200)
    assert whole.status == "completed" and [item.type for item in whole.output] == ["function_call"]
    limit, cut = cut_at(lambda limit: client.responses.create(**body, max_output_tokens=limit),
                        whole.usage.output_tokens,
                        lambda r: r.output[-1].type == "function_call" and r.output[-1].status == "incomplete")
    assert (cut.status, cut.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    [item] = cut.output
    assert item.name == whole.output[0].name
    with pytest.raises(ValueError):
        json.loads(item.arguments)
    events = list(client.responses.create(**body, max_output_tokens=limit, stream=True))
    assert events[-1].type == "response.incomplete"
    [streamed] = events[-1].response.output
    assert (streamed.name, streamed.status, streamed.arguments) == (item.name, "incomplete", item.arguments)


def test_a_forced_call_that_cannot_be_constrained_is_bound_and_logged_once(proxy, caplog):
    """ignore_eos leaves the grammar no end: the request's options are checked before its stream would begin and
    again as it runs, and the binding that fails is tried, and logged, once."""
    client = proxy.openai(ALPHA)
    with caplog.at_level(logging.WARNING, logger="prefixcache.sdk"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=4,
                                       extra_body={"ignore_eos": True})
    assert sum("forced tool call not constrained" in r.getMessage() for r in caplog.records) == 1
