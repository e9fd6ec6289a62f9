"""``PrefixCache.chat(tools=...)`` and ``messages(tools=...)`` return the model's calls parsed, as the proxy does."""
from __future__ import annotations

import pytest

from prefixcache import PrefixCache, ToolArgumentsError, ToolCall, ToolCallError
from prefixcache.errors import InvalidRequestError
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
