"""Structured outputs through a live proxy with the official ``openai`` client: ``response_format`` json_schema
(``create`` and ``parse`` with a Pydantic model) and json_object, streamed and not, on both engines; and with
the official ``anthropic`` client: ``output_config.format`` (``create``, ``parse`` and ``stream``) and
token counting.

The model is a tiny random Llama: unconstrained it writes garbage, so answers that parse and match the schema
show the constraint at work.
"""
from __future__ import annotations

import json
from typing import Annotated, Literal

import anthropic
import jsonschema
import openai
import pytest
import torch
from prefixcache_api import create_app
from prefixcache_api.anthropic.errors import anthropic_error
from prefixcache_api.errors import map_exception
from proxy_support import ALPHA, MODEL, anthropic_client, live, settings
from pydantic import BaseModel, Field
from transformers import LlamaConfig, LlamaForCausalLM

from prefixcache import CacheConfig, OutputFormatError, PrefixCache
from tests.serving.test_structured import ANTHROPIC_SCHEMA, MESSAGES, PET, SCHEMA
from tests.support.slow_tokenizer import ByteTokenizer


class Home(BaseModel):
    city: str = Field(max_length=8)
    zip: int = Field(ge=1000, le=99999)


class Pet(BaseModel):
    name: str = Field(max_length=12)
    kind: Literal["cat", "dog", "owl"]
    age: int = Field(ge=0, le=30)
    home: Home
    tags: list[Annotated[str, Field(max_length=6)]] = Field(min_length=1, max_length=3)


@pytest.fixture(scope="module", params=[True, False], ids=["batched", "serial"])
def proxy(request, tiny_model, tokenizer):
    """A live server on the tiny model, with the batching engine (batched) or without it (serial)."""
    cache = PrefixCache(tiny_model, tokenizer, CacheConfig(max_bytes=256 << 20), batching=request.param)
    with live(create_app(settings(), cache=cache)) as srv:
        yield srv
    cache.close()


def create(client, max_tokens=200, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=max_tokens, **kwargs)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 3}])
def test_create_with_a_json_schema_streamed_and_not(proxy, sampling):
    srv = proxy
    client = srv.openai(ALPHA)
    srv.cache.flush()
    whole = create(client, response_format=PET, **sampling)
    choice = whole.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    again = create(client, response_format=PET, **sampling)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.content == choice.message.content  # cached: the uncached answer
    chunks = list(create(client, response_format=PET, stream=True, **sampling))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_parse_with_a_pydantic_model(proxy):
    srv = proxy
    client = srv.openai(ALPHA)
    parsed = client.chat.completions.parse(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0,
                                           response_format=Pet)
    pet = parsed.choices[0].message.parsed
    assert isinstance(pet, Pet) and isinstance(pet.home, Home) and pet.kind in ("cat", "dog", "owl")
    assert 0 <= pet.age <= 30 and 1 <= len(pet.tags) <= 3


def test_stream_with_a_pydantic_model(proxy):
    with proxy.openai(ALPHA).chat.completions.stream(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0,
                                                      response_format=Pet) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Pet)


def test_json_object_and_a_cut_answer(proxy):
    srv = proxy
    client = srv.openai(ALPHA)
    done = client.chat.completions.create(model=MODEL, messages=MESSAGES[1:], max_tokens=40, temperature=1.0,
                                          seed=7, response_format={"type": "json_object"})
    assert done.choices[0].finish_reason == "stop" and isinstance(json.loads(done.choices[0].message.content), dict)
    cut = create(client, response_format=PET, temperature=0, max_tokens=6)
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content.startswith('{"name":')


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "string"}}}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"ignore_eos": True}}, "ignore_eos"),
    ({"response_format": {"type": "json_object"}, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tool_choice"),
])
def test_a_format_that_cannot_be_honoured_is_a_400_naming_it(proxy, kwargs, param):
    srv = proxy
    with pytest.raises(openai.BadRequestError) as err:
        srv.openai(ALPHA).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, **kwargs)
    assert err.value.body["param"] == param


def test_an_unknown_format_in_a_schema_that_is_not_strict_is_an_annotation(proxy):
    """strict false: a string format the grammar does not know is no 400; the answer matches the rest of the
    schema, on chat and the Responses API."""
    schema = {"type": "object", "properties": {"code": {"type": "string", "format": "my-custom",
                                                        "pattern": "^[a-z]{1,6}$"}},
              "required": ["code"], "additionalProperties": False}
    client = proxy.openai(ALPHA)
    chat = create(client, response_format={"type": "json_schema", "json_schema": {
        "name": "code", "schema": schema, "strict": False}})
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    r = client.responses.create(model=MODEL, input=MESSAGES, max_output_tokens=200, text={"format": {
        "type": "json_schema", "name": "code", "schema": schema, "strict": False}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)


def test_a_format_the_model_cannot_end_is_a_400_before_a_stream_begins(tokenizer):
    """A model without an end-of-sequence id cannot end a structured answer: a 400 naming response_format, streamed
    or not, before the stream's 200 (not an error event after it); on the Responses API too."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).eval()
    model.generation_config.eos_token_id = None
    cache = PrefixCache(model, tokenizer, CacheConfig(max_bytes=64 << 20))
    try:
        with live(create_app(settings(), cache=cache)) as srv:
            client = srv.openai(ALPHA)
            for stream in (False, True):
                with pytest.raises(openai.BadRequestError, match="end-of-sequence") as err:
                    create(client, max_tokens=5, response_format=PET, stream=stream)
                assert err.value.body["param"] == "response_format"
                with pytest.raises(openai.BadRequestError, match="end-of-sequence"):
                    client.responses.create(model=MODEL, input=MESSAGES, max_output_tokens=5, stream=stream,
                                            text={"format": {"type": "json_object"}})
            assert create(client, max_tokens=3).choices[0].finish_reason == "length"  # no format: served
    finally:
        cache.close()


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "serial"])
def test_a_slow_tokenizer_refuses_a_format_before_a_stream_begins(batching):
    """A slow (pure-Python) tokenizer cannot bind a grammar: a schema the server cannot serve is the 400 it is with a
    fast one, and one it could is a 400 naming response_format (text.format), streamed or not, one choice or two,
    before the stream's 200; a request without a format is served, streamed as it is answered."""
    tok = ByteTokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         eos_token_id=tok.eos_token_id)).eval()
    cache = PrefixCache(model, tok, CacheConfig(max_bytes=64 << 20), batching=batching)
    try:
        with live(create_app(settings(), cache=cache)) as srv:
            client = srv.openai(ALPHA)
            unservable = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}}
            with pytest.raises(openai.BadRequestError) as err:
                create(client, max_tokens=5, response_format=unservable, stream=True)
            assert err.value.body["param"] == "response_format.json_schema.schema"
            for stream in (False, True):
                for n in (1, 2):
                    with pytest.raises(openai.BadRequestError, match="fast .Rust-backed. tokenizer") as err:
                        create(client, max_tokens=5, response_format=PET, stream=stream, n=n)
                    assert err.value.body["param"] == "response_format"
                with pytest.raises(openai.BadRequestError, match="fast .Rust-backed. tokenizer") as err:
                    client.responses.create(model=MODEL, input=MESSAGES, max_output_tokens=5, stream=stream,
                                            text={"format": {"type": "json_object"}})
                assert err.value.body["param"] == "text.format"
            whole = create(client, max_tokens=4).choices[0]
            chunks = list(create(client, max_tokens=4, stream=True))
            assert whole.finish_reason == "length"
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.message.content
    finally:
        cache.close()


def test_an_answer_that_breaks_its_schema_is_a_500_never_served():
    mapped = map_exception(OutputFormatError("the model's answer does not match response_format 'pet' at $.age"))
    assert (mapped.status, mapped.detail.type, mapped.detail.code) == (500, "server_error", "response_format_invalid")


# -- the Responses API's text.format: the same constraint, translated to chat's response_format ---------------


def respond(client, **kwargs):
    return client.responses.create(model=MODEL, instructions=MESSAGES[0]["content"], input=MESSAGES[1]["content"],
                                   max_output_tokens=200, temperature=0, **kwargs)


def test_responses_text_format_json_schema_is_the_chat_answer(proxy):
    srv = proxy
    client = srv.openai(ALPHA)
    schema_format = {"type": "json_schema", **PET["json_schema"]}
    got = respond(client, text={"format": schema_format})
    assert got.status == "completed"
    jsonschema.validate(json.loads(got.output_text), SCHEMA)
    assert got.output_text == create(client, response_format=PET, temperature=0).choices[0].message.content
    assert got.text.format.type == "json_schema" and got.text.format.name == "pet"
    events = list(respond(client, text={"format": schema_format}, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == got.output_text
    # Greedy on a random model, json_object's open strings run on: the answer is chat's, JSON from its first token.
    done = respond(client, text={"format": {"type": "json_object"}})
    chat = create(client, response_format={"type": "json_object"}, temperature=0).choices[0]
    assert done.output_text == chat.message.content and done.output_text.startswith("{")
    assert done.status == ("completed" if chat.finish_reason == "stop" else "incomplete")


def test_responses_parse_and_stream_with_a_pydantic_model(proxy):
    client = proxy.openai(ALPHA)
    parsed = client.responses.parse(model=MODEL, input=MESSAGES[1]["content"], instructions=MESSAGES[0]["content"],
                                    max_output_tokens=200, temperature=0, text_format=Pet)
    assert isinstance(parsed.output_parsed, Pet) and 0 <= parsed.output_parsed.age <= 30
    with client.responses.stream(model=MODEL, input=MESSAGES[1]["content"], instructions=MESSAGES[0]["content"],
                                 max_output_tokens=200, temperature=0, text_format=Pet) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed


@pytest.mark.parametrize(("fmt", "param"), [
    ({"type": "json_schema", "name": "x", "schema": {"not": {"type": "string"}}}, "text.format.schema"),
    ({"type": "json_schema", "name": "x", "strict": True,
      "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}, "text.format.schema"),
    ({"type": "json_schema", "name": "x"}, "text.format.schema"),
])
def test_a_responses_text_format_that_cannot_be_honoured_is_a_400_naming_it(proxy, fmt, param):
    with pytest.raises(openai.BadRequestError) as err:
        respond(proxy.openai(ALPHA), text={"format": fmt})
    assert err.value.body["param"] == param


# -- Anthropic's Messages API: output_config.format, the same constraint under Anthropic's schema rules ------------

OUTPUT = {"format": {"type": "json_schema", "schema": ANTHROPIC_SCHEMA}}


class Place(BaseModel):
    city: Literal["Oslo", "Rome"]
    indoor: bool


class Animal(BaseModel):
    """What the ``anthropic`` client's ``output_format`` sends as it is (its ``transform_schema`` moves bounds and
    patterns into descriptions, so they would not be held: literals keep the random model's answer short)."""

    kind: Literal["cat", "dog", "owl"]
    home: Place


def ask(client, max_tokens=200, temperature=0, **kwargs):
    """The installed client has no ``temperature`` argument: it travels in the body."""
    return client.messages.create(model=MODEL, system=MESSAGES[0]["content"], max_tokens=max_tokens,
                                  messages=MESSAGES[1:], extra_body={"temperature": temperature}, **kwargs)


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_messages_output_format_streamed_and_not(proxy, temperature):
    client = anthropic_client(proxy.url, ALPHA)
    whole = ask(client, output_config=OUTPUT, temperature=temperature)
    assert whole.stop_reason == "end_turn" and [block.type for block in whole.content] == ["text"]
    jsonschema.validate(json.loads(whole.content[0].text), ANTHROPIC_SCHEMA)
    with client.messages.stream(model=MODEL, system=MESSAGES[0]["content"], max_tokens=200, messages=MESSAGES[1:],
                                output_config=OUTPUT, extra_body={"temperature": temperature}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn"
    jsonschema.validate(json.loads(text), ANTHROPIC_SCHEMA)
    if temperature == 0:
        assert text == whole.content[0].text


def test_messages_parse_and_stream_with_a_pydantic_model(proxy):
    client = anthropic_client(proxy.url, ALPHA)
    parsed = client.messages.parse(model=MODEL, system=MESSAGES[0]["content"], max_tokens=200,
                                   messages=MESSAGES[1:], output_format=Animal, extra_body={"temperature": 0})
    animal = parsed.parsed_output
    assert isinstance(animal, Animal) and isinstance(animal.home, Place)
    with client.messages.stream(model=MODEL, system=MESSAGES[0]["content"], max_tokens=200,
                                messages=MESSAGES[1:], output_format=Animal, extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert final.parsed_output == animal


def test_messages_cut_by_max_tokens_and_effort_high(proxy):
    client = anthropic_client(proxy.url, ALPHA)
    cut = ask(client, max_tokens=6, output_config=OUTPUT)
    assert cut.stop_reason == "max_tokens" and cut.content[0].text.startswith('{"name":')
    high = ask(client, output_config={**OUTPUT, "effort": "high"})  # the default: changes nothing
    assert high.content[0].text == ask(client, output_config=OUTPUT).content[0].text
    plain = ask(client, max_tokens=8, output_config={"effort": "high"})
    assert plain.content[0].text == ask(client, max_tokens=8).content[0].text


def test_count_tokens_takes_output_config(proxy):
    client = anthropic_client(proxy.url, ALPHA)
    counted = client.messages.count_tokens(model=MODEL, messages=MESSAGES[1:], output_config=OUTPUT)
    assert counted.input_tokens == client.messages.count_tokens(model=MODEL, messages=MESSAGES[1:]).input_tokens
    with pytest.raises(anthropic.BadRequestError, match="additionalProperties"):
        client.messages.count_tokens(model=MODEL, messages=MESSAGES[1:], output_config={"format": {
            "type": "json_schema", "schema": {"type": "object", "properties": {}}}})


def _format(schema):
    return {"output_config": {"format": {"type": "json_schema", "schema": schema}}}


@pytest.mark.parametrize(("kwargs", "named"), [
    (_format({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}), "additionalProperties"),
    (_format({"type": "integer", "minimum": 1}), "'minimum' is not supported"),
    (_format({"type": "array", "items": {"type": "string"}, "minItems": 2}), "minItems"),
    (_format({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                              "additionalProperties": False}}, "$ref": "#/$defs/n"}), "recursive"),
    (_format({"type": 5}), "output_config.format.schema is not a valid JSON schema"),
    (_format({"type": "string", "format": "no-such-format"}), "output_config.format.schema cannot be used"),
    ({"output_config": {"effort": "low"}}, "output_config.effort 'low' is not supported"),
    ({"output_config": {"format": {"type": "json_object", "schema": {}}}}, "output_config.format.type"),
    ({**_format({"type": "string"}), "messages": [MESSAGES[1], {"role": "assistant", "content": "{"}]},
     "prefilled assistant message"),
    ({**_format({"type": "string"}), "tool_choice": {"type": "any"},
      "tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "forced tool call"),
])
def test_an_output_config_that_cannot_be_honoured_is_a_400_naming_it(proxy, kwargs, named):
    body = {"messages": MESSAGES[1:], **kwargs}
    with pytest.raises(anthropic.BadRequestError) as err:
        anthropic_client(proxy.url, ALPHA).messages.create(model=MODEL, max_tokens=5, **body)
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert named in err.value.body["error"]["message"]


def test_an_answer_that_breaks_its_output_format_is_an_api_error_never_served():
    mapped = map_exception(OutputFormatError("the model's answer does not match output_config.format's schema"))
    assert anthropic_error(mapped.status, mapped.detail.message) == (500, {"type": "error", "error": {
        "type": "api_error", "message": "the model's answer does not match output_config.format's schema"}})
