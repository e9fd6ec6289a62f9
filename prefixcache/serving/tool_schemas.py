"""Strict tools: their JSON schemas checked when a request declares them, and each call's arguments against them.

A strict tool (OpenAI's ``function.strict``, Anthropic's ``strict``) promises arguments that match its
schema. Sampling is constrained to it only where a request forces a call to strict tools only
(``structured.tool_call_grammar``), so a call's arguments are validated as they are parsed
(``tool_calls.ToolCallParser``) and a mismatch is ``ToolArgumentsError``, never an answer. The request side follows OpenAI's: a strict function's schema must have ``additionalProperties:
false`` on every object and list every property in ``required``, or the request is refused (400); an
Anthropic strict tool's follows Anthropic's (``check_anthropic_shape``). Every schema must be a valid JSON
schema whose ``$ref``s point inside it (nothing is fetched). The string ``format``s each API's strict mode
supports are asserted (``string_formats``); any other ``format`` is an annotation, as JSON schema has it.

Validation runs on the event loop, on text the model wrote, with patterns the caller wrote: a pattern
that backtracks without end would hold every request up. So the ``pattern``s met in checking one call
share one time bound (``regex``'s timeout; past it the call is not served), and ``patternProperties``,
whose patterns jsonschema matches in several places with ``re``, is refused as a keyword of any schema validation
applies (``schema_objects``; a property of that name is data). ``uniqueItems`` is checked
in time linear in the array (jsonschema's compares every pair of unhashable items) and ``multipleOf``
exactly on the numbers as written (jsonschema divides floats: 19.99 would not be a multiple of 0.01).
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from decimal import Decimal
from fractions import Fraction
from typing import Any

import regex
from jsonschema import FormatChecker, SchemaError, ValidationError, validators
from jsonschema.exceptions import best_match
from jsonschema.protocols import Validator
from referencing import Registry
from referencing.exceptions import Unresolvable
from referencing.jsonschema import specification_with

from prefixcache.errors import InvalidRequestError, ToolArgumentsError
from prefixcache.serving import string_formats

log = logging.getLogger(__name__)

#: The schema of a strict function declared without parameters: it takes none.
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_MESSAGE_CHARS = 300  # a validation message quotes the instance: kept short
#: The string formats OpenAI's strict mode supports (its sampling guarantees them): asserted on strict functions.
OPENAI_FORMATS = ("date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid")
#: Those Anthropic's strict tools support: OpenAI's and ``uri``.
ANTHROPIC_FORMATS = (*OPENAI_FORMATS, "uri")
#: The keywords Anthropic refuses in a strict tool's schema, each with the type its error names.
ANTHROPIC_UNSUPPORTED = {"minimum": "number", "maximum": "number", "exclusiveMinimum": "number",
                         "exclusiveMaximum": "number", "multipleOf": "number", "minLength": "string",
                         "maxLength": "string", "maxItems": "array", "uniqueItems": "array"}
PATTERN_SECONDS = 0.25  # the most the ``pattern``s checked in one call's arguments may take together (wall-clock:
# thousands of times what patterns on a model's output need, so load on the machine does not fail a valid call)


def openai_strict(tools: Sequence[Any] | None) -> dict[str, Validator]:
    """The validators of the strict functions among OpenAI-shaped ``tools``, or ``InvalidRequestError``
    (400) naming a schema that breaks OpenAI's strict-mode rules (``check_strict_shape``)."""
    out: dict[str, Validator] = {}
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or function.get("strict") is not True:
            continue
        at = f"tools[{i}].function.parameters"
        schema = function.get("parameters")
        schema = NO_ARGUMENTS if schema is None else schema
        out[function.get("name")] = compile_schema(schema, at, formats=OPENAI_FORMATS)
        check_strict_shape(schema, str(function.get("name")), at)
    return out


def anthropic_strict(tools: Sequence[Any] | None) -> dict[str, Validator]:
    """The validators of the strict tools among Anthropic-shaped ``tools`` (``{"name", "input_schema",
    "strict"}``), or ``InvalidRequestError`` (400) naming a schema that breaks Anthropic's rules for them
    (``check_anthropic_shape``)."""
    out: dict[str, Validator] = {}
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("strict") is not True:
            continue
        at = f"tools[{i}].input_schema"
        validator = compile_schema(tool.get("input_schema"), at, formats=ANTHROPIC_FORMATS)
        check_anthropic_shape(validator.schema, str(tool.get("name")), at)
        out[tool.get("name")] = validator
    return out


def compile_schema(schema: Any, at: str, patterns: Patterns | None = None,
                   formats: Sequence[str] = ()) -> Validator:
    """A validator of ``schema`` (its ``$schema``'s draft, else 2020-12), or ``InvalidRequestError`` if it is
    no valid JSON schema or has a ``$ref`` that does not resolve inside it. ``patterns``: how its patterns are
    matched and which ``format``s asserted (``Patterns``: ``PATTERN_SECONDS`` per call's check and ``formats``
    by default)."""
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{at} must be a JSON schema object", param=at)
    if not isinstance(schema.get("$schema", ""), str):
        raise InvalidRequestError(f"{at}.$schema must be a string (a JSON schema dialect's URI)", param=at)
    kind = validators.validator_for(schema, default=validators.Draft202012Validator)
    try:
        kind.check_schema(schema)
    except SchemaError as exc:
        raise InvalidRequestError(f"{at} is not a valid JSON schema: {exc.message}", param=at) from exc
    unresolved: list[str] = []
    applied = list(schema_objects(schema, unresolved))
    if unresolved:
        raise InvalidRequestError(f"{at}: {unresolved[0]} does not resolve inside the schema (only "
                                  "references within it, such as #/$defs/..., are supported)", param=at)
    if any("patternProperties" in node for node in applied):
        raise InvalidRequestError(f"{at}: patternProperties is not supported in a strict tool's schema (its "
                                  "patterns cannot be bounded in time)", param=at)
    # The registry is empty: a $ref outside fails instead of being fetched.
    return _bounded(kind)(schema, registry=Registry(), format_checker=patterns or Patterns(formats=formats))


def check_arguments(name: str, arguments: dict[str, Any], validator: Validator) -> None:
    """Raise ``ToolArgumentsError`` naming where ``arguments`` of a call to ``name`` first break its schema."""
    try:
        error = first_mismatch(arguments, validator)
    except RecursionError as exc:  # a $ref loop that consumes nothing ({"$ref": "#"}): the schema's fault
        raise InvalidRequestError(f"the schema of strict tool {name!r} cannot be applied: its $refs loop without "
                                  "end") from exc
    except _OutOfTime as exc:
        log.warning("strict tool call not served: %r: %s", name, exc)
        raise ToolArgumentsError(f"the model's call to strict tool {name!r} could not be checked against its "
                                 f"schema: {exc}") from exc
    if error is None:
        return
    message = error.message if len(error.message) <= _MESSAGE_CHARS else error.message[:_MESSAGE_CHARS] + "..."
    log.warning("strict tool call not served: %r at %s: %s", name, error.json_path, message)
    raise ToolArgumentsError(f"the model called strict tool {name!r} with arguments that do not match its schema "
                             f"at {error.json_path}: {message}")


def first_mismatch(instance: Any, validator: Validator) -> ValidationError | None:
    """The error that best says where ``instance`` breaks ``validator``'s schema, or None if it matches. The
    ``pattern``s it checks share one time bound (``Patterns``; past it ``_OutOfTime`` is raised)."""
    patterns = validator.format_checker
    if isinstance(patterns, Patterns):
        patterns.start()
    return best_match(validator.iter_errors(instance))


def check_strict_shape(schema: Any, name: str, at: str, where: str = "#", owner: str = "strict function") -> None:
    """OpenAI's strict-mode rules, whose breach it refuses with a 400: every object schema validation may apply in
    ``schema`` (``_shaped``: a valid schema) sets ``additionalProperties`` to false and lists each of its
    ``properties`` in ``required``. ``owner``: what the error calls the schema's owner (named ``name``)."""
    for path, node in _shaped(schema, where):
        if not _is_object(node):
            continue
        if node.get("additionalProperties") is not False:
            raise InvalidRequestError(f"Invalid schema for {owner} {name!r} at {path}: "
                                      "'additionalProperties' is required to be supplied and to be false", param=at)
        required = node.get("required")
        properties = node.get("properties")
        missing = [key for key in properties or {} if not isinstance(required, list) or key not in required] \
            if isinstance(properties, dict) else []
        if missing:
            raise InvalidRequestError(f"Invalid schema for {owner} {name!r} at {path}: 'required' is "
                                      "required to be supplied and to be an array including every key in "
                                      f"properties; missing {missing[0]!r}", param=at)


def check_anthropic_shape(schema: dict[str, Any], name: str | None, at: str, owner: str = "strict tool") -> None:
    """Anthropic's rules for a strict tool's schema (its structured outputs' JSON schema limitations), whose
    breach it refuses with a 400: every object schema sets ``additionalProperties`` to false; no numeric bounds
    or ``multipleOf``, string lengths, ``maxItems``, ``uniqueItems`` or ``minItems`` past 1; ``enum`` values
    of no object or array; no recursion (a ``$ref`` into a schema holding it). ``schema`` is valid and its
    ``$ref``s resolve inside it (``compile_schema``). ``owner``: what the error calls the schema's owner (named
    ``name``, if it has one)."""
    subject = owner if name is None else f"{owner} {name!r}"

    def refuse(where: str, rule: str) -> InvalidRequestError:
        return InvalidRequestError(f"Invalid schema for {subject} at {where}: {rule}", param=at)

    for where, node in _shaped(schema):
        kind = node.get("type")
        if _is_object(node) and node.get("additionalProperties") is not False:
            raise refuse(where, "For 'object' type, 'additionalProperties' must be explicitly set to false")
        for key, named in ANTHROPIC_UNSUPPORTED.items():
            if key in node and not (key == "uniqueItems" and node[key] is False):
                raise refuse(where, f"For '{kind if isinstance(kind, str) else named}' type, property {key!r} is "
                                    "not supported")
        if node.get("minItems", 0) not in (0, 1):
            raise refuse(where, "For 'array' type, 'minItems' values other than 0 and 1 are not supported")
        if any(isinstance(value, dict | list) for value in node.get("enum") or ()):
            raise refuse(where, "'enum' values must be strings, numbers, booleans or null")
    ref = _recursive_ref(schema)
    if ref is not None:
        raise refuse("#", f"recursive schemas are not supported ({ref} leads back into a schema holding it)")


class _OutOfTime(Exception):
    """The patterns of one call's check took longer than their bound: the check stops there."""


class Patterns(FormatChecker):
    """One schema's compiled patterns and the time left to the check under way (``start``). It rides on the
    validator as its format checker (which jsonschema hands to every subschema's validator), and asserts the
    ``formats`` named (``string_formats``; a value of another type passes, as JSON schema has it)."""

    def __init__(self, seconds: float = PATTERN_SECONDS, clock: Callable[[], float] = time.monotonic,
                 formats: Sequence[str] = ()):
        super().__init__(formats=())
        for name in formats:
            self.checks(name)(_on_strings(string_formats.CHECKERS[name]))
        self._seconds, self._clock, self._deadline = seconds, clock, clock() + seconds
        self._compiled: dict[str, Any] = {}

    def start(self) -> None:
        """A new call's check begins: its patterns get ``seconds`` in all."""
        self._deadline = self._clock() + self._seconds

    def search(self, pattern: str, text: str) -> bool:
        """Whether ``pattern`` matches somewhere in ``text``; ``_OutOfTime`` once the check's time is spent."""
        if pattern not in self._compiled:
            self._compiled[pattern] = regex.compile(pattern)
        left = self._deadline - self._clock()
        try:
            if left <= 0:
                raise TimeoutError
            return self._compiled[pattern].search(text, timeout=left) is not None
        except TimeoutError:
            raise _OutOfTime(f"its patterns took over {self._seconds:g} s to match ({pattern!r} at the "
                             "end)") from None


def _on_strings(check: Callable[[str], bool]) -> Callable[[Any], bool]:
    return lambda instance: not isinstance(instance, str) or check(instance)


@functools.cache
def _bounded(kind: type[Validator]) -> type[Validator]:
    """``kind`` with ``pattern`` matched in bounded time, ``uniqueItems`` in linear time and ``multipleOf``
    exact."""
    return validators.extend(kind, {"pattern": _pattern, "uniqueItems": _unique_items, "multipleOf": _multiple_of})


def _pattern(validator: Validator, pattern: str, instance: Any, schema: dict[str, Any]) -> Iterator[ValidationError]:
    """JSON schema's ``pattern`` (a search, as jsonschema's), within the check's time (``Patterns``)."""
    if not validator.is_type(instance, "string"):
        return
    patterns = validator.format_checker
    if not isinstance(patterns, Patterns):  # a validator not made by ``compile_schema``
        patterns = Patterns()
    try:
        found = patterns.search(pattern, instance)
    except regex.error as exc:
        yield ValidationError(f"{pattern!r} cannot be compiled: {exc}")
    else:
        if not found:
            yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _unique_items(validator: Validator, unique: Any, instance: Any, schema: dict[str, Any]) -> Iterator[ValidationError]:
    """JSON schema's ``uniqueItems``, by hashing each item's value (1 and 1.0 alike, true and 1 not)."""
    if not unique or not validator.is_type(instance, "array"):
        return
    seen: set[Any] = set()
    for item in instance:
        key = _value_key(item)
        if key in seen:
            yield ValidationError(f"{instance!r} has non-unique elements")
            return
        seen.add(key)


def _value_key(value: Any) -> Any:
    """A hashable key equal for JSON values JSON schema calls equal."""
    if isinstance(value, bool) or value is None:
        return "b", value
    if isinstance(value, int | float):
        return "n", value  # Python's 1 == 1.0, with the same hash
    if isinstance(value, list):
        return "a", tuple(_value_key(item) for item in value)
    if isinstance(value, dict):
        return "o", frozenset((key, _value_key(item)) for key, item in value.items())
    return "s", value


def _multiple_of(validator: Validator, by: Any, instance: Any, schema: dict[str, Any]) -> Iterator[ValidationError]:
    """JSON schema's ``multipleOf``, exact on the decimal numbers as written (a float's shortest repr)."""
    if validator.is_type(instance, "number") and _exact(instance) % _exact(by) != 0:
        yield ValidationError(f"{instance!r} is not a multiple of {by!r}")


def _exact(number: int | float) -> Fraction:
    return Fraction(number) if isinstance(number, int) else Fraction(Decimal(repr(number)))


def _is_object(schema: dict[str, Any]) -> bool:
    """Whether ``schema`` describes an object: its type is (or includes) ``object``, or it lists ``properties``."""
    kind = schema.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in schema


def schema_objects(schema: dict[str, Any], unresolved: list[str] | None = None) -> Iterator[dict[str, Any]]:
    """Every schema object validation may apply in ``schema`` (a valid JSON schema): it, those inside it
    (``_subschemas``) and those its references (``_references``) reach, wherever they lie, each once. Their keys are keywords; a property's name
    (a key of ``properties``) or a key inside ``const``, ``enum`` or ``default`` is data, never met here. A
    reference that does not resolve is skipped, and added to ``unresolved`` when given."""
    seen: set[int] = set()
    todo = [(schema, _resolver(schema))]
    while todo:
        node, at = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for sub, key, ref, resolved in _references(node, at, schema):
            if key is None:
                yield sub
            elif resolved is None:
                if unresolved is not None:
                    unresolved.append(f"{key} {ref!r}")
            elif isinstance(resolved.contents, dict):
                todo.append((resolved.contents, resolved.resolver))


def _shaped(schema: Any, where: str = "#") -> Iterator[tuple[str, dict[str, Any]]]:
    """The schema objects a strict schema's rules hold for, each with its JSON pointer: those inside ``schema``
    (``_subschemas``), then those only a reference reaches (a ``$ref`` into a place no keyword holds schemas, as
    an unknown keyword's value), each once."""
    seen: set[int] = set()
    for path, node in _subschemas(schema, where):
        seen.add(id(node))
        yield path, node
    if not isinstance(schema, dict):
        return
    for node in schema_objects(schema):
        if id(node) not in seen:
            seen.add(id(node))
            yield _pointer(schema, node, where) or f"{where} (a $ref's target)", node


def _pointer(node: Any, target: Any, where: str) -> str | None:
    """The JSON pointer of ``target`` (by identity) inside ``node`` at ``where``, or None."""
    if node is target:
        return where
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        if isinstance(value, dict | list):
            found = _pointer(value, target, f"{where}/{str(key).replace('~', '~0').replace('/', '~1')}")
            if found is not None:
                return found
    return None


def _references(node: dict[str, Any], resolver: Any,
                root: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str | None, str | None, Any]]:
    """Each schema object in ``node`` (``_subschemas``) as (it, None, None, None), then each of its references
    (``$ref``, and ``$dynamicRef`` where ``root``'s draft has it) as (it, the keyword, the reference, what it
    resolves to, or None where it does not). ``resolver``: ``node``'s (the root's, or a reference's target's);
    each reference resolves against the base of the resource it lies in, a nested ``$id`` changing it, as the
    validator resolves it."""
    kind = validators.validator_for(root, default=validators.Draft202012Validator)
    keywords = [key for key in ("$ref", "$dynamicRef") if key in kind.VALIDATORS]
    specification = specification_with(kind.META_SCHEMA["$schema"])

    def walk(sub: dict[str, Any], at: Any) -> Iterator[tuple[dict[str, Any], str | None, str | None, Any]]:
        yield sub, None, None, None
        for key in keywords:
            ref = sub.get(key)
            if isinstance(ref, str):
                try:
                    yield sub, key, ref, at.lookup(ref)
                except Unresolvable:
                    yield sub, key, ref, None
        for _, child in _children(sub):
            if isinstance(child, dict):
                yield from walk(child, at.in_subresource(specification.create_resource(child)))

    yield from walk(node, resolver)


def _resolver(schema: dict[str, Any]) -> Any:
    """A ``referencing`` resolver of ``$ref``s inside ``schema`` (its draft's), with nothing outside it."""
    kind = validators.validator_for(schema, default=validators.Draft202012Validator)
    return Registry().resolver_with_root(specification_with(kind.META_SCHEMA["$schema"]).create_resource(schema))


_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas", "dependencies", "patternProperties")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "allOf", "oneOf", "items")
_SCHEMA_ONES = ("items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties",
                "contains", "propertyNames", "not", "if", "then", "else")


def _subschemas(node: Any, where: str = "#") -> Iterator[tuple[str, dict[str, Any]]]:
    """``node`` and every schema object inside it (through the keywords that hold schemas, not ``$ref``s), each
    with its JSON pointer."""
    if not isinstance(node, dict):
        return
    yield where, node
    for path, child in _children(node, where):
        yield from _subschemas(child, path)


def _children(node: dict[str, Any], where: str = "#") -> Iterator[tuple[str, Any]]:
    """What ``node``'s keywords that hold schemas hold (schema objects, booleans, or other values where the schema
    is not valid), each with its JSON pointer."""
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for child, sub in node[key].items():
                yield f"{where}/{key}/{child}", sub
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield f"{where}/{key}/{i}", sub
    for key in _SCHEMA_ONES:
        if key in node:
            yield f"{where}/{key}", node[key]


def _recursive_ref(schema: dict[str, Any]) -> str | None:
    """The first reference (``_references``: keyword and reference) met in ``schema`` that leads back into a schema
    it lies inside of (following references), else None. Each schema a reference reaches is walked once."""
    cleared: set[int] = set()  # reached by a reference and walked without meeting a way back

    def walk(node: dict[str, Any], resolver: Any, inside: tuple[int, ...]) -> str | None:
        for _, key, ref, resolved in _references(node, resolver, schema):
            if resolved is None:  # no reference, or one compile_schema let through: no recursion seen
                continue
            target = resolved.contents
            if id(target) in inside:
                return f"{key} {ref!r}"
            if id(target) in cleared or not isinstance(target, dict):
                continue
            found = walk(target, resolved.resolver, (*inside, id(target)))
            if found is not None:
                return found
            cleared.add(id(target))
        return None

    return walk(schema, _resolver(schema), (id(schema),))
