"""Tool-call parsing: each family's syntax, the same pieces however the text is split, invalid calls as text."""
from __future__ import annotations

import logging

import pytest

from prefixcache.errors import ToolCallError
from prefixcache.serving.tool_calls import (
    Text,
    ToolCall,
    ToolCallParser,
    calls_of,
    check_choice,
    family_of,
    merge_texts,
    parse,
    text_of,
)

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
