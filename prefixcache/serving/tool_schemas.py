"""Strict tools: their JSON schemas checked when a request declares them, and each call's arguments against them.

A strict tool (OpenAI's ``function.strict``, Anthropic's ``strict``) promises arguments that match its
schema. OpenAI constrains sampling to the schema; nothing does here, so a call's arguments are validated
as they are parsed (``tool_calls.ToolCallParser``) and a mismatch is ``ToolArgumentsError``, never an
answer. The request side follows OpenAI's: a strict function's schema must have ``additionalProperties:
false`` on every object and list every property in ``required``, or the request is refused (400). Every
schema must be a valid JSON schema whose ``$ref``s point inside it (nothing is fetched).

Validation runs on the event loop, on text the model wrote, with patterns the caller wrote: a pattern
that backtracks without end would hold every request up. So ``pattern`` is matched with a time bound
(``regex``'s timeout; past it the call is not served), and ``patternProperties``, whose patterns
jsonschema matches in several places with ``re``, is refused.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import regex
from jsonschema import SchemaError, ValidationError, validators
from jsonschema.exceptions import best_match
from jsonschema.protocols import Validator
from referencing import Registry
from referencing.exceptions import Unresolvable
from referencing.jsonschema import specification_with

from prefixcache.errors import InvalidRequestError, ToolArgumentsError

log = logging.getLogger(__name__)

#: The schema of a strict function declared without parameters: it takes none.
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_MESSAGE_CHARS = 300  # a validation message quotes the instance: kept short
PATTERN_SECONDS = 0.05  # the most one ``pattern`` may take to match one string


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
        check_strict_shape(schema, str(function.get("name")), at)
        out[function.get("name")] = compile_schema(schema, at)
    return out


def anthropic_strict(tools: Sequence[Any] | None) -> dict[str, Validator]:
    """The validators of the strict tools among Anthropic-shaped ``tools`` (``{"name", "input_schema",
    "strict"}``)."""
    return {tool.get("name"): compile_schema(tool.get("input_schema"), f"tools[{i}].input_schema")
            for i, tool in enumerate(tools or []) if isinstance(tool, dict) and tool.get("strict") is True}


def compile_schema(schema: Any, at: str) -> Validator:
    """A validator of ``schema`` (its ``$schema``'s draft, else 2020-12), or ``InvalidRequestError`` if it is
    no valid JSON schema or has a ``$ref`` that does not resolve inside it."""
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{at} must be a JSON schema object", param=at)
    if not isinstance(schema.get("$schema", ""), str):
        raise InvalidRequestError(f"{at}.$schema must be a string (a JSON schema dialect's URI)", param=at)
    kind = validators.validator_for(schema, default=validators.Draft202012Validator)
    try:
        kind.check_schema(schema)
    except SchemaError as exc:
        raise InvalidRequestError(f"{at} is not a valid JSON schema: {exc.message}", param=at) from exc
    if _has_key(schema, "patternProperties"):
        raise InvalidRequestError(f"{at}: patternProperties is not supported in a strict tool's schema (its "
                                  "patterns cannot be bounded in time)", param=at)
    resolver = Registry().resolver_with_root(specification_with(kind.META_SCHEMA["$schema"]).create_resource(schema))
    for ref in _refs(schema):
        try:
            resolver.lookup(ref)
        except Unresolvable as exc:
            raise InvalidRequestError(f"{at}: $ref {ref!r} does not resolve inside the schema (only references "
                                      "within it, such as #/$defs/..., are supported)", param=at) from exc
    return _bounded(kind)(schema, registry=Registry())  # empty: a $ref outside fails instead of being fetched


def check_arguments(name: str, arguments: dict[str, Any], validator: Validator) -> None:
    """Raise ``ToolArgumentsError`` naming where ``arguments`` of a call to ``name`` first break its schema."""
    try:
        error = best_match(validator.iter_errors(arguments))
    except RecursionError as exc:  # a $ref loop that consumes nothing ({"$ref": "#"}): the schema's fault
        raise InvalidRequestError(f"the schema of strict tool {name!r} cannot be applied: its $refs loop without "
                                  "end") from exc
    if error is None:
        return
    message = error.message if len(error.message) <= _MESSAGE_CHARS else error.message[:_MESSAGE_CHARS] + "..."
    log.warning("strict tool call not served: %r at %s: %s", name, error.json_path, message)
    raise ToolArgumentsError(f"the model called strict tool {name!r} with arguments that do not match its schema "
                             f"at {error.json_path}: {message}")


def check_strict_shape(schema: Any, name: str, at: str, where: str = "#") -> None:
    """OpenAI's strict-mode rules, whose breach it refuses with a 400: every object schema in ``schema``
    sets ``additionalProperties`` to false and lists each of its ``properties`` in ``required``."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            check_strict_shape(item, name, at, f"{where}/{i}")
        return
    if not isinstance(schema, dict):
        return
    kind = schema.get("type")
    if kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in schema:
        if schema.get("additionalProperties") is not False:
            raise InvalidRequestError(f"Invalid schema for strict function {name!r} at {where}: "
                                      "'additionalProperties' is required to be supplied and to be false", param=at)
        required = schema.get("required")
        properties = schema.get("properties")
        missing = [key for key in properties or {} if not isinstance(required, list) or key not in required] \
            if isinstance(properties, dict) else []
        if missing:
            raise InvalidRequestError(f"Invalid schema for strict function {name!r} at {where}: 'required' is "
                                      "required to be supplied and to be an array including every key in "
                                      f"properties; missing {missing[0]!r}", param=at)
    for key in ("properties", "$defs", "definitions"):
        children = schema.get(key)
        if isinstance(children, dict):
            for child, sub in children.items():
                check_strict_shape(sub, name, at, f"{where}/{key}/{child}")
    for key in ("items", "prefixItems", "anyOf", "allOf", "oneOf", "not"):
        if key in schema:
            check_strict_shape(schema[key], name, at, f"{where}/{key}")


@functools.cache
def _bounded(kind: type[Validator]) -> type[Validator]:
    """``kind`` with its ``pattern`` matched in bounded time."""
    return validators.extend(kind, {"pattern": _pattern})


def _pattern(validator: Validator, pattern: str, instance: Any, schema: dict[str, Any]) -> Iterator[ValidationError]:
    """JSON schema's ``pattern`` (a search, as jsonschema's), given up after ``PATTERN_SECONDS``."""
    if not validator.is_type(instance, "string"):
        return
    try:
        found = regex.search(pattern, instance, timeout=PATTERN_SECONDS)
    except TimeoutError:
        yield ValidationError(f"{pattern!r} took over {PATTERN_SECONDS:g} s to match, so it was not checked")
    except regex.error as exc:
        yield ValidationError(f"{pattern!r} cannot be compiled: {exc}")
    else:
        if found is None:
            yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _has_key(node: Any, key: str) -> bool:
    if isinstance(node, list):
        return any(_has_key(item, key) for item in node)
    return isinstance(node, dict) and (key in node or any(_has_key(value, key) for value in node.values()))


def _refs(node: Any) -> list[str]:
    """Every ``$ref`` string in ``node``."""
    if isinstance(node, list):
        return [ref for item in node for ref in _refs(item)]
    if not isinstance(node, dict):
        return []
    own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
    return own + [ref for value in node.values() for ref in _refs(value)]
