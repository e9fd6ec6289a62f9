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
from prefixcache.serving.tool_schemas import Patterns, anthropic_strict, check_arguments, compile_schema, openai_strict

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
    with pytest.raises(ToolArgumentsError, match=r"could not be checked .* took over .* s to match"):
        check_arguments("g", {"word": "a" * 40 + "!"}, validator)


@pytest.mark.parametrize("value", ["NaN", "-Infinity", "1e400", "[" * 5000 + "]" * 5000])
def test_what_json_cannot_write_back_is_no_json(value):
    """NaN, Infinity and a number past a float's range would be written back as no JSON, and nesting past the
    stack is no request's fault: a loose call of them is text, a strict one an error."""
    text = f'<tool_call>{{"name": "get_weather", "arguments": {{"city": {value}}}}}</tool_call>'
    assert parse("hermes", TOOLS, text) == [Text(text)]
    parser = ToolCallParser("hermes", TOOLS, strict=openai_strict(strict_weather({})))
    with pytest.raises(ToolArgumentsError, match="is not JSON"):
        parser.feed(text)


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral"])
def test_a_call_naming_a_strict_tool_that_does_not_parse_is_an_error_a_loose_one_text(family):
    """Cut short or broken, the call to a strict tool is never served as text; to a loose one it is."""
    body = '{"name": "get_weather", "arguments": {"city": "Par'
    text = {"hermes": f"<tool_call>{body}", "llama3_json": body, "mistral": f"[TOOL_CALLS][{body}"}[family]
    assert parse(family, TOOLS, text) == [Text(text)]
    for size in (len(text), 3):
        parser = ToolCallParser(family, TOOLS, strict=openai_strict(strict_weather({"type": "string"})))
        with pytest.raises(ToolArgumentsError, match="strict tool 'get_weather' is not JSON"):
            for at in range(0, len(text), size):
                parser.feed(text[at:at + size])
            parser.finish()
    other = [{"type": "function", "function": {"name": "get_time", "strict": True}}]
    parser = ToolCallParser(family, TOOLS, strict=openai_strict(other))  # get_weather is loose here
    assert merge_texts(parser.feed(text) + parser.finish()) == [Text(text)]


def test_a_call_dropped_past_the_limit_is_not_checked():
    """parallel_tool_calls false: the second call is dropped, so its arguments cannot fail the answer."""
    bad = '{"name": "get_weather", "arguments": {"city": 1}}'
    tools = strict_weather({"type": "string"})
    cut = '{"name": "get_weather", "arguments": {"city'
    hermes = f"<tool_call>{PARIS_CALL}</tool_call><tool_call>{bad}</tool_call><tool_call>{cut}"
    assert calls_of(openai_tool_use("hermes", tools, None, parallel=False).read(hermes)) == [PARIS]
    mistral = f"[TOOL_CALLS][{PARIS_CALL}, {bad}]"
    assert openai_tool_use("mistral", tools, None, parallel=False).read(mistral) == [PARIS]
    with pytest.raises(ToolArgumentsError, match=r"\$\.city"):
        openai_tool_use("mistral", tools, None).read(mistral)


PARIS_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def test_multiple_of_is_exact_on_the_numbers_as_written():
    """Dividing floats, 19.99 is no multiple of 0.01 and 10**400 overflows: neither may fail a call."""
    validator = anthropic_strict([{"name": "g", "strict": True, "input_schema": {
        "type": "object", "properties": {"x": {"multipleOf": 0.01}, "n": {"multipleOf": 0.1}}}}])["g"]
    for good in ({"x": 19.99}, {"x": 0.07}, {"x": 3}, {"n": 10 ** 400}, {"n": 1e300}):
        check_arguments("g", good, validator)
    with pytest.raises(ToolArgumentsError, match="19.991 is not a multiple of 0.01"):
        check_arguments("g", {"x": 19.991}, validator)


def test_unique_items_treats_equal_json_values_alike():
    validator = anthropic_strict([{"name": "g", "strict": True, "input_schema": {
        "type": "array", "uniqueItems": True}}])["g"]
    for unique in ([1, True], [0, False, None], [[1], [True]], [{"a": 1}, {"a": "1"}], list(range(1000))):
        check_arguments("g", unique, validator)
    for repeated in ([1, 1.0], [{"a": 1, "b": [2]}, {"b": [2.0], "a": 1}], [[], []], ["x", "y", "x"]):
        with pytest.raises(ToolArgumentsError, match="non-unique"):
            check_arguments("g", repeated, validator)


def test_the_patterns_of_one_call_share_one_time_bound():
    """Each match within its own bound would let a long array hold the event loop for its length times that
    bound: the patterns of one call's check share it, and the next call gets it afresh."""
    now = [0.0]

    def clock() -> float:  # each look at the clock finds 20 ms more spent
        now[0] += 0.02
        return now[0]

    validator = compile_schema({"type": "array", "items": {"type": "string", "pattern": "^a+$"}}, "at",
                               patterns=Patterns(0.05, clock))
    check_arguments("g", ["a"], validator)
    with pytest.raises(ToolArgumentsError, match=r"could not be checked .* took over 0.05 s"):
        check_arguments("g", ["a"] * 5, validator)
    check_arguments("g", ["a"], validator)  # a new call, a new bound


def test_strict_tools_need_a_template_whose_calls_are_read():
    """Calls in a syntax this server does not read come back as text, unchecked: strict tools are refused there
    (a 400), unless the tools are hidden; loose ones are served as text."""
    with pytest.raises(InvalidRequestError, match="strict tool 'get_weather' cannot be honoured") as err:
        openai_tool_use(None, strict_weather({"type": "string"}), None)
    assert err.value.param == "tools"
    assert openai_tool_use(None, strict_weather({"type": "string"}), "none") is None
    assert openai_tool_use(None, [{"type": "function", "function": {"name": "get_weather"}}], None) is None
