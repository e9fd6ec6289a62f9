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
from prefixcache.serving.tool_schemas import (
    ANTHROPIC_FORMATS,
    OPENAI_FORMATS,
    Patterns,
    anthropic_strict,
    check_arguments,
    compile_schema,
    openai_strict,
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
    # The end marker inside a JSON string is the string's: the call ends at the marker after it.
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "a\\"</tool_call>"}}</tool_call> Done.',
     [ToolCall("get_weather", '{"city": "a\\"</tool_call>"}'), Text("Done.")]),
    # A call that never closes its string ends at its first marker all the same; the call after it is read.
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa}</tool_call>\n<tool_call>'
     '{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>',
     [Text('<tool_call>{"name": "get_weather", "arguments": {"city": "Pa}</tool_call>'), NOON]),
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
    looping = openai_strict([{"type": "function", "function": {"name": "g", "strict": True,
                                                                 "parameters": {"$ref": "#"}}}])
    with pytest.raises(InvalidRequestError, match="loop"):
        check_arguments("g", {}, looping["g"])


@pytest.mark.parametrize("key", ["contains", "if", "then", "else", "not", "additionalItems", "dependentSchemas"])
def test_openai_strict_rules_hold_for_objects_under_every_keyword_that_holds_schemas(key):
    """An open object schema anywhere validation applies one (here under ``key``) is refused, named by its path;
    closed, it passes."""
    def under(inner: dict) -> dict:
        holder = {"dependentSchemas": {"a": inner}}.get(key, inner)
        return {"type": "object", "properties": {"a": {"type": "array", key: holder}}, "required": ["a"],
                "additionalProperties": False}
    open_object = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}
    tools = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": under(open_object)}}]
    path = f"#/properties/a/{key}/a" if key == "dependentSchemas" else f"#/properties/a/{key}"
    with pytest.raises(InvalidRequestError, match=f"{path}: 'additionalProperties'"):
        openai_tool_use("hermes", tools, None)
    closed = {**open_object, "additionalProperties": False}
    tools[0]["function"]["parameters"] = under(closed)
    openai_tool_use("hermes", tools, None)


def anthropic_tool(schema: dict) -> list[dict]:
    return [{"name": "g", "strict": True, "input_schema": schema}]


CLOSED = {"type": "object", "additionalProperties": False}


@pytest.mark.parametrize(("schema", "rule"), [
    ({"type": "object"}, "#: For 'object' type, 'additionalProperties' must be explicitly set to false"),
    ({**CLOSED, "properties": {"p": {"properties": {}, "additionalProperties": True}}},
     "#/properties/p: For 'object' type, 'additionalProperties'"),
    ({**CLOSED, "$defs": {"P": {"type": ["object", "null"], "additionalProperties": {"type": "string"}}}},
     "#/\\$defs/P: For 'object' type"),
    ({**CLOSED, "properties": {"n": {"type": "integer", "minimum": 1}}}, "#/properties/n: For 'integer' type, property 'minimum'"),
    ({**CLOSED, "properties": {"n": {"anyOf": [{"type": "number", "exclusiveMaximum": 1}]}}},
     "#/properties/n/anyOf/0: For 'number' type, property 'exclusiveMaximum'"),
    ({**CLOSED, "properties": {"n": {"multipleOf": 2}}}, "#/properties/n: For 'number' type, property 'multipleOf'"),
    ({**CLOSED, "properties": {"s": {"type": "string", "maxLength": 9}}}, "#/properties/s: For 'string' type, property 'maxLength'"),
    ({**CLOSED, "properties": {"a": {"type": "array", "items": {"minLength": 1}}}},
     "#/properties/a/items: For 'string' type, property 'minLength'"),
    ({**CLOSED, "properties": {"a": {"type": "array", "maxItems": 3}}}, "#/properties/a: For 'array' type, property 'maxItems'"),
    ({**CLOSED, "properties": {"a": {"type": "array", "uniqueItems": True}}}, "#/properties/a: For 'array' type, property 'uniqueItems'"),
    ({**CLOSED, "properties": {"a": {"type": "array", "minItems": 2}}}, "#/properties/a: For 'array' type, 'minItems' values other than 0 and 1"),
    ({**CLOSED, "properties": {"e": {"enum": ["a", ["b"]]}}}, "#/properties/e: 'enum' values must be strings"),
    ({**CLOSED, "properties": {"e": {"enum": [{"b": 1}]}}}, "#/properties/e: 'enum' values must be strings"),
    ({"$ref": "#"}, "#: recursive schemas are not supported \\(\\$ref '#'"),
    ({**CLOSED, "properties": {"next": {"$ref": "#/$defs/Node"}},
      "$defs": {"Node": {**CLOSED, "properties": {"child": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]}}}}},
     "#: recursive schemas are not supported \\(\\$ref '#/\\$defs/Node'"),
    ({**CLOSED, "properties": {"p": {"$ref": "#/$defs/A"}},
      "$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"items": {"$ref": "#/$defs/A"}}}}, "#: recursive"),
])
def test_anthropic_strict_schemas_follow_anthropics_rules(schema, rule):
    """As Anthropic's strict tools (structured outputs' JSON schema limitations): objects closed, no numeric or
    string bounds, arrays bounded only by minItems 0 or 1, no object or array in an enum, no recursion; a
    breach is a 400 naming where."""
    with pytest.raises(InvalidRequestError, match=f"strict tool 'g' at {rule}") as err:
        anthropic_strict(anthropic_tool(schema))
    assert err.value.param == "tools[0].input_schema"


def test_anthropic_strict_schemas_anthropic_takes_are_served():
    """What Anthropic takes: a property named like a refused keyword, minItems 0 and 1, uniqueItems false,
    enums of scalars, a $ref shared by two properties; refs only inside the schema, patternProperties refused."""
    shared = {**CLOSED, "properties": {"a": {"$ref": "#/$defs/D"}, "b": {"$ref": "#/$defs/D"},
                                       "minimum": {"type": "array", "minItems": 1, "uniqueItems": False,
                                                   "items": {"enum": ["x", 1, True, None]}},
                                       "maxLength": {"type": "array", "minItems": 0}},
              "$defs": {"D": {"type": "string", "format": "date"}}}
    validator = anthropic_strict(anthropic_tool(shared))["g"]
    check_arguments("g", {"a": "2026-02-28", "b": "2024-02-29", "minimum": ["x", None], "maxLength": []}, validator)
    assert anthropic_strict(anthropic_tool(CLOSED))["g"].is_valid({})
    with pytest.raises(InvalidRequestError, match="does not resolve"):
        anthropic_strict(anthropic_tool({"$ref": "https://example.com/s.json"}))
    with pytest.raises(InvalidRequestError, match="must be a string"):
        anthropic_strict(anthropic_tool({"$schema": True}))
    with pytest.raises(InvalidRequestError, match="patternProperties"):
        anthropic_strict(anthropic_tool({**CLOSED, "patternProperties": {"^x": {}}}))


def test_only_patternproperties_as_a_keyword_is_refused_not_as_a_name_or_data():
    """A property named patternProperties (or pattern), or the word inside const data, is no keyword:
    served. The keyword is refused wherever validation applies it, a $defs entry or a $ref's target included."""
    named = {**CLOSED, "properties": {"patternProperties": {"type": "string"},
                                      "pattern": {"type": "string"}, "c": {"const": {"patternProperties": {}}}},
             "required": ["patternProperties", "pattern", "c"]}
    for tools in (anthropic_tool(named), [{"type": "function", "function": {"name": "g", "strict": True,
                                                                            "parameters": named}}]):
        strict = anthropic_strict(tools) if "input_schema" in tools[0] else openai_strict(tools)
        check_arguments("g", {"patternProperties": "x", "pattern": "y", "c": {"patternProperties": {}}},
                        strict["g"])
    hidden = {**CLOSED, "properties": {"a": {"$ref": "#/x-defs/A"}}, "required": ["a"],
              "x-defs": {"A": {**CLOSED, "patternProperties": {"^x": {}}}}}
    for schema in (hidden, {**CLOSED, "$defs": {"A": {**CLOSED, "patternProperties": {"^x": {}}}}}):
        with pytest.raises(InvalidRequestError, match="patternProperties"):
            anthropic_strict(anthropic_tool(schema))


def test_only_ref_as_a_keyword_must_resolve_not_as_a_name_or_data():
    """A "$ref" key in const, enum or default data, or a property named $ref, is no reference: served. A $ref
    keyword that does not resolve is refused wherever validation would apply it (behind another $ref too)."""
    data = {**CLOSED, "properties": {"$ref": {"type": "string"}, "c": {"const": {"$ref": "#/nowhere"}},
                                     "e": {"enum": [{"$ref": "#/x"}, 1]}},
            "required": ["$ref", "c", "e"]}
    strict = openai_strict([{"type": "function", "function": {"name": "g", "strict": True, "parameters": data}}])
    check_arguments("g", {"$ref": "x", "c": {"$ref": "#/nowhere"}, "e": 1}, strict["g"])
    behind = {**CLOSED, "properties": {"a": {"$ref": "#/x-defs/A"}}, "required": ["a"],
              "x-defs": {"A": {"$ref": "#/nowhere"}}}
    for schema in (behind, {**CLOSED, "properties": {"a": {"items": {"$ref": "#/$defs/B"}}}, "required": ["a"]}):
        with pytest.raises(InvalidRequestError, match="does not resolve"):
            openai_strict([{"type": "function", "function": {"name": "g", "strict": True, "parameters": schema}}])


def test_refs_resolve_against_the_base_a_nested_id_sets_as_the_validator_resolves_them():
    """A $ref inside an embedded resource (a nested $id) resolves against that resource, as the validator resolves
    it: served and applied, not refused as a reference outside the schema; one that resolves nowhere is refused."""
    inner = {**CLOSED, "$id": "https://example.com/inner", "properties": {"x": {"$ref": "#/$defs/B"}},
             "required": ["x"], "$defs": {"B": {"type": "integer"}}}
    nested = {**CLOSED, "properties": {"p": {"$ref": "https://example.com/inner"}, "q": {"$id": "q/", **inner}},
              "required": ["p", "q"], "$defs": {"A": inner}}
    tools = [{"type": "function", "function": {"name": "g", "strict": True, "parameters": nested}}]
    for strict in (openai_strict(tools), anthropic_strict(anthropic_tool(nested))):
        check_arguments("g", {"p": {"x": 1}, "q": {"x": 2}}, strict["g"])
        with pytest.raises(ToolArgumentsError, match=r"at \$\.q\.x"):
            check_arguments("g", {"p": {"x": 1}, "q": {"x": "2"}}, strict["g"])
    broken = {**nested, "$defs": {"A": {**inner, "properties": {"x": {"$ref": "#/$defs/C"}}}}}
    with pytest.raises(InvalidRequestError, match="does not resolve"):
        openai_strict([{"type": "function", "function": {"name": "g", "strict": True, "parameters": broken}}])


def test_a_dynamic_ref_must_resolve_and_counts_as_recursion_where_its_draft_has_it():
    """$dynamicRef (2020-12) resolves as $ref does: one that resolves nowhere is refused with the schema (a call
    checked against it failed on the reference, a server error), one that leads back is Anthropic's recursion. In
    a draft without the keyword it is an unknown one, applied nowhere."""
    lost = {**CLOSED, "properties": {"a": {"$dynamicRef": "#nowhere"}}, "required": ["a"]}
    for refuse in (lambda s: openai_strict([{"type": "function", "function": {"name": "g", "strict": True,
                                                                                "parameters": s}}]),
                   lambda s: anthropic_strict(anthropic_tool(s))):
        with pytest.raises(InvalidRequestError, match="#nowhere.*does not resolve"):
            refuse(lost)
    looped = {**CLOSED, "$dynamicAnchor": "node", "properties": {"a": {"$dynamicRef": "#node"}}, "required": ["a"]}
    with pytest.raises(InvalidRequestError, match="recursive"):
        anthropic_strict(anthropic_tool(looped))
    draft7 = {**lost, "$schema": "http://json-schema.org/draft-07/schema#"}
    check_arguments("g", {"a": 1}, anthropic_strict(anthropic_tool(draft7))["g"])


def test_strict_rules_hold_for_an_object_only_a_ref_reaches():
    """An object schema under an unknown keyword is applied when a $ref reaches it: OpenAI's and Anthropic's strict
    rules hold for it, named by its pointer; closed, it is served."""
    def reaching(target: dict) -> dict:
        return {**CLOSED, "properties": {"a": {"$ref": "#/x-extra/a"}}, "required": ["a"], "x-extra": {"a": target}}
    open_object = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}
    openai = [{"type": "function", "function": {"name": "g", "strict": True, "parameters": reaching(open_object)}}]
    with pytest.raises(InvalidRequestError, match="#/x-extra/a: 'additionalProperties'"):
        openai_strict(openai)
    with pytest.raises(InvalidRequestError, match="#/x-extra/a: For 'object' type, 'additionalProperties'"):
        anthropic_strict(anthropic_tool(reaching(open_object)))
    closed = {**open_object, "additionalProperties": False}
    openai[0]["function"]["parameters"] = reaching(closed)
    validator = openai_strict(openai)["g"]
    with pytest.raises(ToolArgumentsError):
        check_arguments("g", {"a": {"x": "y", "extra": 1}}, validator)
    check_arguments("g", {"a": {"x": "y"}}, anthropic_strict(anthropic_tool(reaching(closed)))["g"])


def test_a_pattern_that_backtracks_without_end_is_given_up_not_waited_for():
    """The caller's pattern meets the model's text on the event loop: past its time bound the call is not served."""
    validator = anthropic_strict(anthropic_tool({**CLOSED, "properties": {
        "word": {"type": "string", "pattern": "^(a|aa)+$"}}}))["g"]
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
    validator = compile_schema({"type": "object", "properties": {"x": {"multipleOf": 0.01},
                                                                 "n": {"multipleOf": 0.1}}}, "at")
    for good in ({"x": 19.99}, {"x": 0.07}, {"x": 3}, {"n": 10 ** 400}, {"n": 1e300}):
        check_arguments("g", good, validator)
    with pytest.raises(ToolArgumentsError, match="19.991 is not a multiple of 0.01"):
        check_arguments("g", {"x": 19.991}, validator)


def test_unique_items_treats_equal_json_values_alike():
    validator = compile_schema({"type": "array", "uniqueItems": True}, "at")
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


#: A value outside each format strict mode may assert.
NOT_OF = {"date-time": "yesterday", "time": "noon", "date": "2026-02-30", "duration": "1 day", "email": "joe",
          "hostname": "host_name", "ipv4": "1.2.3", "ipv6": "fe80::a%eth1", "uuid": "1234", "uri": "abc"}


@pytest.mark.parametrize("api", ["openai", "anthropic"])
@pytest.mark.parametrize("name", [*NOT_OF, "color", "int32"])
def test_a_strict_tool_asserts_exactly_the_formats_its_api_supports(api, name):
    """OpenAI's strict mode supports nine formats, Anthropic's those and uri: a value outside one of them fails
    the call; another format is an annotation (as JSON schema has it), and a value of another type passes."""
    schema = {**CLOSED, "properties": {"v": {"type": ["string", "integer"], "format": name}}, "required": ["v"]}
    if api == "openai":
        validator = openai_strict([{"type": "function", "function": {"name": "g", "strict": True,
                                                                     "parameters": schema}}])["g"]
        asserted = OPENAI_FORMATS
    else:
        validator, asserted = anthropic_strict(anthropic_tool(schema))["g"], ANTHROPIC_FORMATS
    check_arguments("g", {"v": 7}, validator)
    if name not in asserted:
        check_arguments("g", {"v": NOT_OF.get(name, "anything")}, validator)
        return
    with pytest.raises(ToolArgumentsError, match=rf"at \$\.v: '.*' is not a '{name}'"):
        check_arguments("g", {"v": NOT_OF[name]}, validator)
    assert compile_schema(schema, "at").is_valid({"v": NOT_OF[name]})  # a validator of no API asserts none


def test_the_formats_asserted_are_the_apis_lists():
    assert set(OPENAI_FORMATS) == set(NOT_OF) - {"uri"} and set(ANTHROPIC_FORMATS) == set(NOT_OF)


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral"])
def test_a_call_cut_by_max_tokens_is_incomplete_and_the_whole_calls_before_it_are_kept(family):
    """A call max_tokens cut is served with what was written of its arguments, unchecked (as OpenAI serves it);
    the whole call before it is kept and checked. Ended otherwise, the same text is an error (strict)."""
    tools = strict_weather({"type": "string"}) + [{"type": "function", "function": {
        "name": "get_time", "strict": True, "parameters": {"type": "object", "properties": {
            "zone": {"type": "string"}, "hour": {"type": "integer"}}, "required": ["zone", "hour"],
            "additionalProperties": False}}}]
    cut = '{"name": "get_time", "arguments": {"zone": "UTC", "hour": 1'
    text = {"hermes": f"<tool_call>{PARIS_CALL}</tool_call>\n<tool_call>{cut}",
            "llama3_json": f"{PARIS_CALL}; {cut}", "mistral": f"[TOOL_CALLS][{PARIS_CALL}, {cut}"}[family]
    partial = ToolCall("get_time", '{"zone": "UTC", "hour": 1', complete=False)
    for size in (len(text), 3):
        use = openai_tool_use(family, tools, "required")
        parser = use.parser()
        pieces = [p for at in range(0, len(text), size) for p in parser.feed(text[at:at + size])]
        assert use.check(merge_texts(pieces + parser.finish(cut=True)), cut=True) == [PARIS, partial]
    assert partial.input == {"zone": "UTC"}  # the members written whole (the number may go on)
    with pytest.raises(ToolArgumentsError, match="is not JSON"):
        openai_tool_use(family, tools, "required").read(text)  # ended by the model: a broken call
    bad = text.replace('"Paris"', "1")  # a whole call that breaks its schema is still refused
    with pytest.raises(ToolArgumentsError, match=r"\$\.city"):
        openai_tool_use(family, tools, "required").read(bad, cut=True)


@pytest.mark.parametrize("cut", [
    '<tool_call>{"name": "get_weather", "arguments": {"city": "a</tool_call> b',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "a</tool_call>", "zone": "U',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "a</tool_call>", "ok": true',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "a</tool_call>", "n": 1e'])
def test_a_call_cut_after_a_string_quoting_the_end_marker_is_incomplete_not_broken(cut):
    """max_tokens cut a call after (or inside) a string holding </tool_call>: the marker is the argument's, the
    call cut (incomplete, its whole text), not a broken call (an error for a strict tool); a string that closes
    after the marker into what is no JSON is still a call the model broke, and the call after it is read."""
    use = openai_tool_use("hermes", strict_weather({"type": "string"}), "required")
    for size in (len(cut), 3):
        parser = use.parser()
        pieces = [p for at in range(0, len(cut), size) for p in parser.feed(cut[at:at + size])]
        assert merge_texts(pieces + parser.finish(cut=True)) == [
            ToolCall("get_weather", cut[cut.index('{"city'):], complete=False)]
    with pytest.raises(ToolArgumentsError, match="is not JSON"):
        use.read(cut)  # ended by the model: a broken call
    broken, expected = CASES[-1][1:]
    assert openai_tool_use("hermes", [{"function": {"name": n}} for n in TOOLS], "auto").read(broken, cut=True) \
        == expected


@pytest.mark.parametrize("tail", ["\n<", "\n</tool_c", " </tool_call"])
def test_a_whole_call_quoting_the_end_marker_cut_inside_its_closing_tag_is_read_whole(tail):
    """max_tokens cut a call's closing tag after its whole JSON, an argument quoting </tool_call>: the call is
    read whole and checked (what the cut left of the tag is the tag's), not split at the quoted marker as a
    broken call (an error for a strict tool, the text of a loose one)."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a</tool_call>b"}}' + tail
    use = openai_tool_use("hermes", strict_weather({"type": "string"}), "required")
    for size in (len(call), 3):
        parser = use.parser()
        pieces = [p for at in range(0, len(call), size) for p in parser.feed(call[at:at + size])]
        assert merge_texts(pieces + parser.finish(cut=True)) == [ToolCall("get_weather", '{"city": "a</tool_call>b"}')]
    with pytest.raises(ToolArgumentsError, match="do not match"):
        openai_tool_use("hermes", strict_weather({"type": "integer"}), "required").read(call, cut=True)


def test_a_last_call_never_closed_whose_argument_quotes_the_end_marker_is_read_whole():
    """The model ended its answer after a call's JSON without </tool_call> (which counts, its JSON parsing), an
    argument quoting the marker: the call is read whole, not split at the quoted marker as a broken call."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "a</tool_call>b"}}'
    use = openai_tool_use("hermes", strict_weather({"type": "string"}), "required")
    assert use.read(call) == [ToolCall("get_weather", '{"city": "a</tool_call>b"}')]


def test_a_cut_answer_that_makes_no_calls_is_its_text_as_the_whole_answer_is():
    """A call to an undeclared tool before a strict tool's call max_tokens cut: the answer is its text, as the
    same answer written whole is, not a strict tool's broken call (a server error for a client's small limit)."""
    use = openai_tool_use("mistral", strict_weather({"type": "string"}), "auto")
    whole = '[TOOL_CALLS][{"name": "nope", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Paris"}}]'
    assert use.read(whole) == [Text(whole)]
    cut = whole[:whole.index("Paris") + 2]
    assert use.read(cut, cut=True) == [Text(cut)]


def test_a_call_cut_after_its_arguments_is_a_whole_call_and_checked():
    """Mistral's template writes a call's "id" after its arguments: cut inside it, the arguments are whole, so the
    call is (checked against its strict schema), not an incomplete one whose arguments run into the id."""
    use = openai_tool_use("mistral", strict_weather({"type": "string"}), "auto")
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2'
    assert use.read(text, cut=True) == [PARIS]
    with pytest.raises(ToolArgumentsError, match=r"\$\.city"):
        use.read(text.replace('"Paris"', "1"), cut=True)


def test_a_lone_surrogate_escape_is_no_json_as_nan_is_not():
    """"\\ud83d" alone parses as JSON but no UTF-8 text holds it (the answer would fail to encode): a loose tool's
    call is its text, a strict one's an error, a cut call's input leaves the member out; a whole pair is a
    character."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "\\ud83d"}}</tool_call>'
    assert parse("hermes", TOOLS, call) == [Text(call)]
    assert parse("hermes", TOOLS, call.replace("ud83d", "ud83d\\ude00")) == [
        ToolCall("get_weather", '{"city": "\U0001f600"}')]
    with pytest.raises(ToolArgumentsError, match="is not JSON"):
        openai_tool_use("hermes", strict_weather({"type": "string"}), "auto").read(call)
    assert ToolCall("get_weather", '{"n": 1, "\\udc00": 2, "m": 3', complete=False).input == {"n": 1}


@pytest.mark.parametrize(("arguments", "members"), [
    ('{"n": 1e', {}), ('{"n": 1.', {}), ('{"n": 2.5E-', {}), ('{"n": -', {}), ('{"n": 12', {}),
    ('{"n": 12 ', {"n": 12}), ('{"n": 1, "m": 1e', {"n": 1}), ('{"n": 1.5}', {"n": 1.5}), ('{"n": tru', {}),
    ('{"n": true', {"n": True}), ('{"n": [1, 2', {}), ('{"n": {"m": 1}, "s": "\\u00', {"n": {"m": 1}})])
def test_the_input_of_a_cut_call_holds_only_the_members_written_whole(arguments, members):
    """A number the cut may have ended in is not whole: ``1e`` or ``1.`` is no 1 (the model was writing 1e5 or
    1.5), nor is one at the very end."""
    assert ToolCall("get_time", arguments, complete=False).input == members


def test_an_answer_cut_before_its_call_is_named_keeps_its_text_and_breaks_no_tool_choice():
    use = openai_tool_use("hermes", strict_weather({"type": "string"}), "required")
    assert use.read('<tool_call>{"na', cut=True) == [Text('<tool_call>{"na')]
    assert use.read('<tool_call>{"name": "get_weather", "argu', cut=True) == [
        ToolCall("get_weather", "", complete=False)]
    with pytest.raises(ToolCallError, match="answered without one"):
        use.read('<tool_call>{"na')
