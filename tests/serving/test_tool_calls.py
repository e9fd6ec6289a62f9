"""Tool-call parsing: each family's syntax, the same pieces however the text is split, invalid calls as text."""
from __future__ import annotations

import logging

import pytest

from prefixcache.errors import InvalidRequestError, ToolArgumentsError, ToolCallError
from prefixcache.serving.tool_calls import (
    Text,
    ToolCall,
    ToolCallParser,
    calls_of,
    check_choice,
    family_of,
    merge_texts,
    openai_tool_use,
    parse,
    text_of,
)
from prefixcache.serving.tool_schemas import anthropic_strict, check_arguments, openai_strict

TOOLS = ("get_weather", "get_time")
PARIS = ToolCall("get_weather", '{"city": "Paris"}')
NOON = ToolCall("get_time", '{"zone": "UTC"}')

CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     [Text("Let me check."), PARIS]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n<tool_call>'
     '{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>\n', [PARIS, NOON]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}', [PARIS]),  # never closed
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> Done.',
     [PARIS, Text("Done.")]),
    ("llama3_json", ' {"name": "get_weather", "parameters": {"city": "Paris"}}', [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "arguments": {"zone": "UTC"}}', [PARIS, NOON]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', [PARIS]),
    ("mistral", 'Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_time", "arguments": {"zone": "UTC"}}]', [Text("Checking."), PARIS, NOON]),
    ("mistral", '[{"name": "get_weather", "arguments": {"city": "Paris"}}]', [PARIS]),  # the marker skipped
]


def streamed(family: str, text: str, size: int) -> list:
    parser = ToolCallParser(family, TOOLS)
    pieces = [p for at in range(0, len(text), size) for p in parser.feed(text[at:at + size])]
    pieces += parser.finish()
    return pieces


@pytest.mark.parametrize(("family", "text", "expected"), CASES)
def test_each_family_parses_the_same_whole_or_streamed(family, text, expected):
    assert parse(family, TOOLS, text) == expected
    for size in (1, 2, 3, 7):
        assert merge_texts(streamed(family, text, size)) == expected


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize("text", ["Hello, world. ", "  [1] is a list; {x} is a set <tool", ""])
def test_plain_text_comes_back_unchanged(family, text):
    """Unchanged also where it opens like a bare call (Mistral's "[") and so is read as one, invalid."""
    whole = parse(family, TOOLS, text)
    assert text_of(whole) == text and not calls_of(whole)
    assert text_of(streamed(family, text, 1)) == text


def test_text_before_a_call_streams_before_the_call_ends():
    parser = ToolCallParser("hermes", TOOLS)
    assert parser.feed("Let me check the weather ") == [Text("Let me check the weather")]  # " ": a call may follow
    assert parser.feed("now <tool") == [Text(" now")]  # "<tool" may begin the marker
    assert parser.feed('_call>{"name": "get_weather", "arguments": {"city": "Paris"}}') == []
    assert parser.feed("</tool_call>") == [PARIS]
    assert parser.finish() == []


@pytest.mark.parametrize(("family", "text", "reason"), [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', "not JSON"),
    ("hermes", '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>', "did not declare"),
    ("llama3_json", '{"name": "get_weather", "parameters": [1]}', "not a JSON object"),
    ("mistral", '[TOOL_CALLS][{"arguments": {}}]', "string name"),
    ("mistral", 'Checking. \n[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": }]', "not JSON"),
])
def test_an_invalid_call_is_returned_as_text_and_the_reason_logged(family, text, reason, caplog):
    with caplog.at_level(logging.WARNING, logger="prefixcache.serving.tool_calls"):
        pieces = parse(family, TOOLS, text)
    assert pieces == [Text(text.strip())]
    assert reason in caplog.text
    assert merge_texts(streamed(family, text, 2)) == pieces


def test_family_from_the_template():
    assert family_of("{% for m in messages %}<tool_call>{% endfor %}") == "hermes"
    assert family_of("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}") == "mistral"
    assert family_of('<|start_header_id|>ipython "parameters"') == "llama3_json"
    assert family_of("<|im_start|>{{ message.content }}") is None
    assert family_of(None) is None


def test_tool_choice_is_checked():
    check_choice([], "auto")
    check_choice([PARIS], "required")
    check_choice([PARIS], "get_weather")
    with pytest.raises(ToolCallError, match="a tool call"):
        check_choice([], "required")
    with pytest.raises(ToolCallError, match="'get_time'"):
        check_choice([PARIS], "get_time")
    assert PARIS.input == {"city": "Paris"}


def strict_weather(city: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": city}, "required": ["city"], "additionalProperties": False}}}]


def test_a_strict_call_is_checked_before_it_is_released():
    """The text before the call is released as it streams; the call itself never is when it breaks its schema."""
    parser = ToolCallParser("hermes", TOOLS, strict=openai_strict(strict_weather({"type": "integer"})))
    assert parser.feed('Let me check.\n<tool_call>\n{"name": "get_weather", ') == [Text("Let me check.")]
    with pytest.raises(ToolArgumentsError, match=r"at \$\.city: 'Paris' is not of type 'integer'"):
        parser.feed('"arguments": {"city": "Paris"}}\n</tool_call>')
    good = ToolCallParser("hermes", TOOLS, strict=openai_strict(strict_weather({"type": "string"})))
    assert good.feed('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>') == [PARIS]


@pytest.mark.parametrize("arguments, what", [('"{city"', "a string that is not JSON"), ("[1]", "not a JSON object")])
def test_a_strict_call_whose_arguments_are_no_object_is_an_error_a_loose_one_text(arguments, what):
    text = f'<tool_call>{{"name": "get_weather", "arguments": {arguments}}}</tool_call>'
    assert parse("hermes", TOOLS, text) == [Text(text)]
    parser = ToolCallParser("hermes", TOOLS, strict=openai_strict(strict_weather({"type": "string"})))
    with pytest.raises(ToolArgumentsError, match=what):
        parser.feed(text)


def test_openai_strict_schemas_follow_openais_rules():
    nested = {"type": "object", "properties": {"place": {"$ref": "#/$defs/Place"}}, "required": ["place"],
              "additionalProperties": False,
              "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    tools = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": nested}}]
    with pytest.raises(InvalidRequestError, match="#/\\$defs/Place: 'additionalProperties'") as err:
        openai_tool_use("hermes", tools, None)
    assert err.value.param == "tools[0].function.parameters"
    with pytest.raises(InvalidRequestError, match="not a valid JSON schema"):  # checked even with the tools hidden
        openai_tool_use("hermes", strict_weather({"type": "text"}), "none")
    no_parameters = openai_strict([{"type": "function", "function": {"name": "f", "strict": True}}])
    assert no_parameters["f"].is_valid({}) and not no_parameters["f"].is_valid({"x": 1})
    # Anthropic's strict tools: any valid schema (OpenAI's rules are OpenAI's), refs only inside it.
    assert anthropic_strict([{"name": "g", "strict": True, "input_schema": {"type": "object"}}])["g"].is_valid({})
    with pytest.raises(InvalidRequestError, match="does not resolve"):
        anthropic_strict([{"name": "g", "strict": True, "input_schema": {"$ref": "https://example.com/s.json"}}])
    with pytest.raises(InvalidRequestError, match="must be a string"):
        anthropic_strict([{"name": "g", "strict": True, "input_schema": {"$schema": True}}])
    with pytest.raises(InvalidRequestError, match="patternProperties"):
        anthropic_strict([{"name": "g", "strict": True, "input_schema": {"patternProperties": {"^x": {}}}}])
    looping = anthropic_strict([{"name": "g", "strict": True, "input_schema": {"$ref": "#"}}])
    with pytest.raises(InvalidRequestError, match="loop"):
        check_arguments("g", {}, looping["g"])


def test_a_pattern_that_backtracks_without_end_is_given_up_not_waited_for():
    """The caller's pattern meets the model's text on the event loop: past its time bound the call is not served."""
    validator = anthropic_strict([{"name": "g", "strict": True, "input_schema": {
        "type": "object", "properties": {"word": {"type": "string", "pattern": "^(a|aa)+$"}}}}])["g"]
    check_arguments("g", {"word": "aaaa"}, validator)
    with pytest.raises(ToolArgumentsError, match="does not match"):
        check_arguments("g", {"word": "ab"}, validator)
    with pytest.raises(ToolArgumentsError, match=r"at \$\.word: .* took over .* s to match"):
        check_arguments("g", {"word": "a" * 40 + "!"}, validator)
