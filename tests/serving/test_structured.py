"""Structured outputs (``response_format``): constrained decoding on both engines, and its checks.

The model is a tiny random Llama over the real SmolLM2 vocabulary: unconstrained, it writes garbage, so an
answer that parses and matches a schema with required keys, an enum, a nested object, an array and integer
bounds shows the constraint at work.
"""
from __future__ import annotations

import dataclasses
import json
import time

import jsonschema
import pytest

from prefixcache.cache.hashing import BlockHasher
from prefixcache.cache.scope import Scope
from prefixcache.cache.store import KVStore
from prefixcache.config import CacheConfig
from prefixcache.errors import InvalidRequestError, OutputFormatError
from prefixcache.serving.engine import BatchConfig, BatchEngine
from prefixcache.serving.request import SamplingParams
from prefixcache.serving.structured import Vocabulary, parse_output_format, parse_response_format
from tests.conftest import FakeClock

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"type": "string", "enum": ["cat", "dog", "owl"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                  "zip": {"type": "integer", "minimum": 1000, "maximum": 99999}},
                 "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "kind", "age", "home", "tags"],
    "additionalProperties": False,
}
#: Held under Anthropic's rules: no numeric or length bounds, no maxItems (a pattern and enums keep the random
#: model's strings and numbers short; without maxItems its arrays would run on).
ANTHROPIC_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"},
        "kind": {"type": "string", "enum": ["cat", "dog", "owl"]},
        "age": {"type": "integer", "enum": [1, 2, 3, 5, 8]},
        "home": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]},
                                                  "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                 "required": ["city", "zip"], "additionalProperties": False},
        "friends": {"type": "boolean"},
    },
    "required": ["name", "kind", "age", "home", "friends"],
    "additionalProperties": False,
}
ANY = {"type": "json_object"}
PET = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "system", "content": "You describe pets as JSON. " * 8},
            {"role": "user", "content": "Describe a pet."}]
SAMPLINGS = [{}, {"temperature": 0.8, "seed": 3}, {"temperature": 1.0, "top_p": 0.9}]


def matches(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return value


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "serial"])
def test_answers_match_the_schema_greedy_and_sampled(new_cache, chat_llama, tokenizer, batching):
    cache = new_cache(chat_llama, tokenizer, batching=batching)
    free = cache.chat(MESSAGES, max_new_tokens=40)
    with pytest.raises(ValueError):  # unconstrained, the model writes no JSON
        json.loads(free.text)
    for sampling in SAMPLINGS:
        result = cache.chat(MESSAGES, response_format=PET, max_new_tokens=200, **sampling)
        assert result.stats.executor == ("batched" if batching else "serial")
        assert result.finish_reason == "stop", result.text
        assert result.token_ids[-1] == tokenizer.eos_token_id  # it ended where the grammar did
        matches(result.text)


def test_both_engines_give_the_same_constrained_tokens_cached_or_not(new_cache, chat_llama, tokenizer):
    """Greedy and seeded answers are the same on both engines, and a cached prompt's answer is the uncached one."""
    answers = {}
    for batching in (True, False):
        cache = new_cache(chat_llama, tokenizer, batching=batching)
        for sampling in SAMPLINGS[:2]:
            cache.flush()
            first = cache.chat(MESSAGES, response_format=PET, max_new_tokens=200, **sampling)
            again = cache.chat(MESSAGES, response_format=PET, max_new_tokens=200, **sampling)
            assert first.usage.cached_tokens == 0 and again.usage.cached_tokens > 0
            assert again.token_ids == first.token_ids
            answers.setdefault(str(sampling), []).append(first.token_ids)
    for batched, serial in answers.values():
        assert batched == serial


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "serial"])
def test_json_object_answers_are_objects(new_cache, chat_llama, tokenizer, batching):
    cache = new_cache(chat_llama, tokenizer, batching=batching)
    done = cache.chat(MESSAGES[1:], response_format=ANY, max_new_tokens=40, temperature=1.0,
                      seed=7)
    assert done.finish_reason == "stop" and isinstance(json.loads(done.text), dict)
    cut = cache.chat(MESSAGES[1:], response_format=ANY, max_new_tokens=40, temperature=1.0,
                     seed=0)
    assert cut.finish_reason == "length" and cut.text.startswith('{"')


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "serial"])
def test_an_answer_cut_by_max_tokens_is_the_partial_json(new_cache, chat_llama, tokenizer, batching):
    cache = new_cache(chat_llama, tokenizer, batching=batching)
    whole = cache.chat(MESSAGES, response_format=PET, max_new_tokens=200)
    cut = cache.chat(MESSAGES, response_format=PET, max_new_tokens=6)
    assert cut.finish_reason == "length" and cut.token_ids == whole.token_ids[:6]
    assert whole.text.startswith(cut.text) and cut.text.startswith('{"name":')


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "serial"])
def test_the_json_ends_the_answer_even_before_min_new_tokens(new_cache, chat_llama, tokenizer, batching):
    """``min_new_tokens`` masks the end-of-sequence tokens, the only tokens a complete JSON allows: the answer
    still ends with its JSON, greedy or sampled (no token left to draw would fail the batched step)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "k", "schema": {
        "type": "object", "properties": {"k": {"enum": ["a"]}}, "required": ["k"], "additionalProperties": False}}}
    cache = new_cache(chat_llama, tokenizer, batching=batching)
    for sampling in SAMPLINGS[:2]:
        result = cache.chat(MESSAGES, response_format=fmt, min_new_tokens=30, max_new_tokens=40, **sampling)
        assert (result.finish_reason, result.text) == ("stop", '{"k":"a"}')
        assert result.stats.executor == ("batched" if batching else "serial")


@pytest.mark.parametrize(("fmt", "param", "message"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}},
     "response_format.json_schema.schema", "Unimplemented keys"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(a)\\1"}}},
     "response_format.json_schema.schema", "backreferences"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nothing"}}},
     "response_format.json_schema.schema", "not a valid JSON schema"),
    ({"type": "json_schema", "json_schema": {"name": "pet", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": []}}},
     "response_format.json_schema.schema", "Invalid schema for response_format 'pet'"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema", "required"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, "response_format.json_schema.name",
     "letters"),
    ({"type": "json_schema"}, "response_format.json_schema", "name and schema"),
    ({"type": "yaml"}, "response_format.type", "'yaml'"),
    ("json", "response_format", "an object"),
])
def test_a_bad_format_is_refused_naming_where(fmt, param, message):
    with pytest.raises(InvalidRequestError, match=message) as err:
        parse_response_format(fmt)
    assert err.value.param == param


def test_an_unknown_format_is_an_annotation_unless_strict():
    """Not strict, a string ``format`` llguidance does not know is left out of the grammar (the validator asserts
    none), a known one kept, a property named ``format`` kept; strict (OpenAI's or Anthropic's rules), a 400."""
    schema = {"type": "object", "properties": {"id": {"type": "string", "format": "my-custom"},
                                               "format": {"type": "string", "format": "date"}},
              "required": ["id", "format"], "additionalProperties": False}
    loose = parse_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert json.loads(loose.grammar)["grammars"][0]["json_schema"]["properties"] == {
        "id": {"type": "string"}, "format": {"type": "string", "format": "date"}}
    assert loose.schema == schema  # the schema itself is the caller's
    loose.check('{"id": "anything", "format": "2026-01-31"}')
    with pytest.raises(InvalidRequestError, match="Unknown format: my-custom"):
        parse_response_format({"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": schema}})
    with pytest.raises(InvalidRequestError, match="Unknown format: my-custom"):
        parse_output_format({"type": "json_schema", "schema": schema})


def test_text_is_no_format_and_ignore_eos_cannot_end_one(new_cache, chat_llama, tokenizer):
    assert parse_response_format({"type": "text"}) is None
    cache = new_cache(chat_llama, tokenizer)
    with pytest.raises(InvalidRequestError, match="end-of-sequence") as err:
        cache.chat(MESSAGES, response_format=PET, ignore_eos=True, max_new_tokens=5)
    assert err.value.param == "response_format"


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "serial"])
def test_an_answer_that_breaks_the_schema_is_not_served(new_cache, chat_llama, tokenizer, batching):
    """The check after generation, the safety net under the grammar: a format whose grammar is looser than its
    schema (any object, schema ``pet``) lets through an answer the schema refuses, which is never served."""
    loose = dataclasses.replace(parse_response_format(PET), grammar=parse_response_format(ANY).grammar)
    cache = new_cache(chat_llama, tokenizer, batching=batching)
    with pytest.raises(OutputFormatError, match=r"does not match response_format 'pet' at \$: 'name' is a required"):
        cache.chat(MESSAGES[1:], response_format=loose, max_new_tokens=40, temperature=1.0, seed=7)
    assert cache.chat(MESSAGES[1:], response_format=ANY, max_new_tokens=40, temperature=1.0, seed=7).text == "{}"
    checked = parse_response_format(PET)
    with pytest.raises(OutputFormatError, match="not JSON"):
        checked.check('{"name":')


def test_a_batched_step_mixes_constrained_and_free_rows(chat_llama, tokenizer):
    """A constrained row shares the engine's steps with free rows, greedy and sampled, seeded and not (unseeded
    rows drawn together on the logits, as on an accelerator: ``draw_together``): each free row's tokens are its
    tokens alone, and the constrained row's answer, sampled unseeded, matches the schema."""
    clock = FakeClock()
    engine = BatchEngine(chat_llama, KVStore(CacheConfig(block_size=8), BlockHasher(1), clock), clock,
                         BatchConfig(max_batch=4, draw_together=True), entropy=lambda: 42)
    eos = frozenset({tokenizer.eos_token_id})
    scope = Scope(("t", "model"), "t")
    constraint = Vocabulary(tokenizer, len(tokenizer)).constraint(parse_response_format(PET), eos)
    prompts = [tokenizer.encode(text) for text in ("Write a pet:", "Tell me a story about", "The weather is",
                                                    "Once upon a time")]
    free = [SamplingParams(max_new_tokens=30, eos_token_ids=eos),
            SamplingParams(max_new_tokens=30, eos_token_ids=eos, temperature=0.9, top_p=0.95, seed=5),
            SamplingParams(max_new_tokens=30, eos_token_ids=eos, temperature=0.9, top_p=0.95)]
    try:
        alone = [engine.generate(p, scope, q, timeout=60).tokens for p, q in zip(prompts[1:], free)]
        shared: list[int] = []  # free rows decoding beside the constrained one, at each of its tokens

        def on_token(_token: int) -> None:
            shared.append(sum(1 for r in engine.scheduler.running if r is not constrained and not r.prefilling))

        constrained = engine.submit(prompts[0], scope, SamplingParams(max_new_tokens=200, eos_token_ids=eos,
                                                                      temperature=0.9, constraint=constraint),
                                    on_token)
        others = [engine.submit(p, scope, q) for p, q in zip(prompts[1:], free)]
        deadline = time.monotonic() + 120
        got = [engine.wait(r, timeout=max(1.0, deadline - time.monotonic())).tokens for r in others]
        answer = engine.wait(constrained, timeout=max(1.0, deadline - time.monotonic()))
        assert got == alone
        assert max(shared) == 3  # steps where every free row decoded beside it
        assert answer.finish_reason == "stop"
        matches(tokenizer.decode(answer.tokens, skip_special_tokens=True))
    finally:
        engine.close()


# -- Anthropic's output_config (``PrefixCache.messages``): the same constraint under Anthropic's schema rules ----
OUTPUT = {"format": {"type": "json_schema", "schema": ANTHROPIC_SCHEMA}}


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "serial"])
def test_messages_output_config_holds_the_answer_to_its_schema(new_cache, chat_llama, tokenizer, batching):
    cache = new_cache(chat_llama, tokenizer, batching=batching)
    asked = {"system": MESSAGES[0]["content"], "messages": MESSAGES[1:]}
    free = cache.messages(**asked, max_tokens=40)
    with pytest.raises(ValueError):  # unconstrained, the model writes no JSON
        json.loads(free.text)
    for sampling in SAMPLINGS:
        result = cache.messages(**asked, max_tokens=200, output_config=OUTPUT, **sampling)
        assert result.stats.executor == ("batched" if batching else "serial")
        assert result.finish_reason == "stop", result.text
        jsonschema.validate(json.loads(result.text), ANTHROPIC_SCHEMA)
    high = cache.messages(**asked, max_tokens=200, output_config={**OUTPUT, "effort": "high"})
    assert high.text == cache.messages(**asked, max_tokens=200, output_config=OUTPUT).text
    cut = cache.messages(**asked, max_tokens=4, output_config=OUTPUT)
    assert cut.finish_reason == "length" and cut.text.startswith('{"')
    loose = dataclasses.replace(parse_output_format(OUTPUT["format"]), grammar=parse_response_format(ANY).grammar)
    with pytest.raises(OutputFormatError, match=r"does not match output_config.format's schema at \$: 'name'"):
        cache.messages(messages=MESSAGES[1:], max_tokens=40, output_config={"format": loose}, temperature=1.0, seed=7)


@pytest.mark.parametrize(("config", "extra", "param", "message"), [
    ({"format": {"type": "json_schema", "schema": {"type": "object", "properties": {}}}}, {},
     "output_config.format.schema", "Invalid schema for output_config.format at #: For 'object' type, "
     "'additionalProperties' must be explicitly set to false"),
    ({"format": {"type": "json_schema", "schema": {"type": "string", "maxLength": 3}}}, {},
     "output_config.format.schema", "'maxLength' is not supported"),
    ({"format": {"type": "json_schema"}}, {}, "output_config.format.schema", "required"),
    ({"format": {"type": "json_schema", "schema": {}, "strict": True}}, {}, "output_config.format.strict",
     "unknown field"),
    ({"format": "json"}, {}, "output_config.format", "an object"),
    ({"effort": "max"}, {}, "output_config.effort", "does not reason"),
    ({"effort": "huge"}, {}, "output_config.effort", "not one of low"),
    ({"verbosity": 1}, {}, "output_config.verbosity", "unknown field"),
    (OUTPUT, {"messages": [MESSAGES[1], {"role": "assistant", "content": "{"}]}, "output_config.format",
     "prefilled assistant message"),
    (OUTPUT, {"tool_choice": {"type": "tool", "name": "f"}, "tools": [{"name": "f", "input_schema": {
        "type": "object"}}]}, "tool_choice", "forced tool call"),
])
def test_a_bad_output_config_is_refused_naming_where(new_cache, chat_llama, tokenizer, config, extra, param,
                                                     message):
    cache = new_cache(chat_llama, tokenizer)
    with pytest.raises(InvalidRequestError, match=message) as err:
        cache.messages(**{"messages": MESSAGES[1:], **extra}, max_tokens=5, output_config=config)
    assert err.value.param == param


def test_format_text_on_a_string_is_a_plain_string():
    """The ``anthropic`` client's ``transform_schema`` writes ``"format": "text"`` on every plain string."""
    fmt = parse_output_format({"type": "json_schema", "schema": {"type": "object", "properties": {"a": {
        "type": "string", "format": "text"}}, "required": ["a"], "additionalProperties": False}})
    fmt.check('{"a":"anything"}')
    with pytest.raises(InvalidRequestError, match="cannot be used"):  # elsewhere an unknown format is no format
        parse_output_format({"type": "json_schema", "schema": {"type": "string", "format": "nonsense"}})
