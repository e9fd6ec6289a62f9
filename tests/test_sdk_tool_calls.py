"""``PrefixCache.chat(tools=...)`` and ``messages(tools=...)`` return the model's calls parsed, as the proxy does."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from prefixcache import PrefixCache, ToolArgumentsError, ToolCall, ToolCallError
from prefixcache.errors import InvalidRequestError
from prefixcache.serving.structured import tool_call_grammar
from prefixcache.serving.tool_calls import anthropic_tool_use, openai_tool_use
from tests.support.tool_templates import CALL_START, family_tokenizer, scripted_model

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PARIS = ToolCall("get_weather", '{"city": "Paris"}')


@pytest.fixture(scope="module")
def hermes(tokenizer):
    tok = family_tokenizer(tokenizer, "hermes")
    cache = PrefixCache(scripted_model(tok, "hermes"), tok)
    yield cache
    cache.close()


def test_chat_returns_the_parsed_calls(hermes):
    r = hermes.chat(ASK, tools=[WEATHER], max_new_tokens=16)
    assert (r.tool_calls, r.text, r.finish_reason) == ((PARIS,), "Let me check.", "tool_calls")
    assert PARIS.input == {"city": "Paris"}
    named = hermes.chat(ASK, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                        max_new_tokens=16)
    assert named.tool_calls == (PARIS,)
    plain = hermes.chat(ASK, tools=[WEATHER], tool_choice="none", max_new_tokens=16)
    assert plain.tool_calls == () and "get_weather" in plain.text and plain.finish_reason == "stop"


def test_messages_returns_the_parsed_calls(hermes):
    tools = [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]
    r = hermes.messages(ASK, max_tokens=16, tools=tools, tool_choice={"type": "any"})
    assert r.tool_calls == (PARIS,) and r.text == "Let me check."


def test_a_forced_call_the_answer_lacks_raises(hermes):
    with pytest.raises(ToolCallError, match="tool_choice"):
        hermes.chat(ASK, tools=[WEATHER], tool_choice="required", stop=[CALL_START["hermes"]], max_new_tokens=16)
    with pytest.raises(InvalidRequestError, match="not one of the tools"):
        hermes.chat(ASK, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})


def test_a_strict_tools_call_is_held_to_its_schema(hermes):
    schema = {**WEATHER["function"]["parameters"], "required": ["city"], "additionalProperties": False}
    served = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": schema}}
    assert hermes.chat(ASK, tools=[served], max_new_tokens=16).tool_calls == (PARIS,)
    london = {**schema, "properties": {"city": {"const": "London"}}}
    with pytest.raises(ToolArgumentsError, match=r"\$\.city"):
        hermes.chat(ASK, tools=[{**served, "function": {**served["function"], "parameters": london}}],
                    max_new_tokens=16)
    with pytest.raises(ToolArgumentsError, match=r"\$\.city"):
        hermes.messages(ASK, max_tokens=16, tools=[{"name": "get_weather", "strict": True, "input_schema": london}])


# -- a forced call to strict tools is constrained (``structured.tool_call_grammar``) -------------------------
ZONE = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
CLOCK = {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": ZONE}}
LOOSE = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["function"]["parameters"]}}


def test_only_a_forced_call_to_strict_tools_only_has_a_grammar():
    strict = openai_tool_use("hermes", [CLOCK, LOOSE], "required")
    assert tool_call_grammar(strict) is None  # get_weather may be called, and is not strict
    assert tool_call_grammar(openai_tool_use("hermes", [CLOCK, LOOSE], "auto")) is None
    assert tool_call_grammar(openai_tool_use("hermes", [CLOCK, LOOSE], {"function": {"name": "get_weather"}})) is None
    named = tool_call_grammar(openai_tool_use("mistral", [CLOCK, LOOSE], {"function": {"name": "get_time"}}))
    assert named is not None and named.names == ("get_time",) and named.family == "mistral"
    forced = tool_call_grammar(anthropic_tool_use("llama3_json", [{"name": "get_time", "strict": True,
                                                                   "input_schema": ZONE}], {"type": "any"}))
    assert forced is not None and forced.parallel


@pytest.fixture(scope="module")
def random_hermes(tokenizer):
    """A tiny random Llama over the hermes tokenizer (``<tool_call>`` an added token): garbage unconstrained."""
    tok = family_tokenizer(tokenizer, "hermes")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    caches = [PrefixCache(model, tok, batching=batching) for batching in (True, False)]
    yield caches
    for cache in caches:
        cache.close()


def test_a_forced_strict_call_is_the_schemas_on_both_engines(random_hermes):
    tools = [CLOCK, {**LOOSE, "function": {**LOOSE["function"], "strict": True, "parameters": {
        **LOOSE["function"]["parameters"], "required": ["city"], "additionalProperties": False}}}]
    for cache in random_hermes:
        named = cache.chat(ASK, tools=tools, tool_choice={"type": "function", "function": {"name": "get_time"}},
                           parallel_tool_calls=False, max_new_tokens=60)
        assert named.finish_reason == "tool_calls" and named.text == ""
        assert [c.name for c in named.tool_calls] == ["get_time"] and named.tool_calls[0].input["zone"] in ZONE[
            "properties"]["zone"]["enum"]
        # the tokens name the marker by its added token: the grammar lets the model write it as the template does
        assert cache.tokenizer.convert_tokens_to_ids("<tool_call>") in named.token_ids
        anthropic = cache.messages(ASK, max_tokens=60, tools=[{"name": "get_time", "strict": True, "input_schema": ZONE}],
                                   tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True})
        assert anthropic.tool_calls == named.tool_calls


def test_a_forced_strict_call_that_cannot_be_constrained_is_checked_as_before(random_hermes):
    """ignore_eos leaves no end for the grammar: the call is unconstrained, and what the model wrote is served,
    never a new refusal; cut by max_new_tokens (as ignore_eos always is), it may lack its call: finish_reason
    "length", no ToolCallError."""
    r = random_hermes[1].chat(ASK, tools=[CLOCK], tool_choice="required", ignore_eos=True, max_new_tokens=8)
    assert r.finish_reason == "length" and not r.tool_calls


def test_a_forced_strict_call_quoting_the_end_marker_is_read_back(random_hermes):
    """The grammar lets a string argument hold ``</tool_call>`` (an added token, which llguidance holds special and
    so spells in ordinary tokens there): that marker is the string's, not the call's end. A response format's
    string is spelled alike."""
    quoted = {"type": "object", "properties": {"tag": {"type": "string", "enum": ['</tool_call> "x"\\']}},
              "required": ["tag"], "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "tag", "strict": True, "parameters": quoted}}
    for cache in random_hermes:
        r = cache.chat(ASK, tools=[tool], tool_choice="required", parallel_tool_calls=False, max_new_tokens=60)
        assert r.finish_reason == "tool_calls" and r.tool_calls[0].input == {"tag": '</tool_call> "x"\\'}
        fmt = cache.chat(ASK, response_format={"type": "json_schema", "json_schema": {"name": "tag", "schema": quoted}},
                         max_new_tokens=60)
        assert fmt.finish_reason == "stop" and fmt.text == '{"tag":"</tool_call> \\"x\\"\\\\"}'


def test_a_constrained_forced_call_is_not_cut_by_a_stop_string(random_hermes):
    """The answer is the call alone: a stop string its JSON holds ends no text, so the call is served whole."""
    for cache in random_hermes:
        r = cache.chat(ASK, tools=[CLOCK], tool_choice="required", parallel_tool_calls=False, max_new_tokens=60,
                       stop=["}", '"zone"'])
        assert r.finish_reason == "tool_calls" and r.tool_calls[0].input["zone"] in ("UTC", "CET")
