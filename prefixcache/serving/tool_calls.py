"""A model's tool calls, parsed out of its text in the syntax its chat template taught it.

Families, chosen from the tokenizer's chat template (``family_of``):

- ``hermes`` (Qwen 2.5+, Hermes, and others): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one tag per call, text allowed around them; a last tag the model did not close counts if its JSON parses.
- ``llama3_json`` (Llama 3.1+): the whole answer is ``{"name": ..., "parameters": {...}}`` (``arguments``
  accepted too), optionally after ``<|python_tag|>``; several calls separated by ``;``.
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, after any text.

Special tokens are left out of decoded text, so a marker that is a special token of the
tokenizer (``<|python_tag|>``, Mistral's ``[TOOL_CALLS]``) may be missing: an answer that
opens with the family's JSON (``{`` or ``[``) is read as calls too.

``ToolUse`` holds what a request asks of its calls and checks ``tool_choice``.
``ToolCallParser`` reads text as it streams (``feed`` each delta, then ``finish``) and returns
``Text`` and ``ToolCall`` pieces; a whole answer fed at once gives the same pieces, so a
streamed and an unstreamed answer agree. Text before a call is released as it comes (less
what could begin a marker). A call whose JSON does not parse, or that names a tool the
request did not declare, is returned as the text the model wrote, and the reason logged.

A call to a strict tool is checked against its schema as it is parsed, before it is returned (or
streamed): arguments that do not match, or are not a JSON object, raise ``ToolArgumentsError``
(``tool_schemas.py``), and so does a call whose JSON does not parse when it names a strict tool.
Calls dropped past ``limit`` are not checked.

An answer cut by ``max_tokens`` (``finish(cut=True)``) may end inside a call: once its name is written it is
returned as an incomplete call (``ToolCall.complete`` false) whose ``arguments`` are the text the model wrote of
them, as OpenAI returns a call cut by the limit; it is not checked (strict or not), and the complete calls before
it are kept (and checked). A call cut before its name is the text the model wrote, as a call that does not parse
(one naming a strict tool too: the cut broke its JSON, not the model).
JSON here is JSON: ``NaN``, ``Infinity`` and numbers
past a float's range do not parse (they would be written back as no JSON), nor does a string holding a lone
surrogate escape (``"\\ud83d"``: no UTF-8 answer carries it), nor nesting deeper than Python's stack.
"""
from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jsonschema.protocols import Validator

from prefixcache.errors import InvalidRequestError, ToolArgumentsError, ToolCallError
from prefixcache.serving.tool_schemas import anthropic_strict, check_arguments, openai_strict

log = logging.getLogger(__name__)

FAMILIES = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True, slots=True)
class Text:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call: the tool's ``name`` and its ``arguments``, a JSON object as compact text; a call cut by
    ``max_tokens`` is not ``complete``, its ``arguments`` the text written of them (no JSON, or not all of it)."""

    name: str
    arguments: str
    complete: bool = True

    @property
    def input(self) -> dict[str, Any]:
        """The arguments as a dict (Anthropic's ``input``); of an incomplete call, its members written whole."""
        return json.loads(self.arguments) if self.complete else _whole_members(self.arguments)


Piece = Text | ToolCall


@dataclass(frozen=True, slots=True)
class _Syntax:
    start: str  # the marker that opens the calls
    end: str | None  # the marker that closes one call; None: the calls run to the end of the answer
    bare: str | None  # what opens calls written without the marker, at the very start of an answer
    arguments: tuple[str, ...]  # the keys that may hold a call's arguments; the first is the template's
    #: How a forced call is written (``structured.tool_call_grammar``): what opens the calls, what separates two,
    #: what closes them. Llama's and Mistral's markers are special tokens: left out, as this parser reads calls
    #: without them.
    forced: tuple[str, str, str]


_SYNTAX = {
    "hermes": _Syntax("<tool_call>", "</tool_call>", None, ("arguments",),
                      ("<tool_call>\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>")),
    "llama3_json": _Syntax("<|python_tag|>", None, "{", ("parameters", "arguments"), ("", "; ", "")),
    "mistral": _Syntax("[TOOL_CALLS]", None, "[", ("arguments",), ("[", ", ", "]")),
}


def family_of(template: str | None) -> str | None:
    """The tool-call family a chat template teaches its model, or None if it is none of ``FAMILIES``."""
    if not template:
        return None
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return "llama3_json"
    return None


def call_layout(family: str) -> tuple[tuple[str, str, str], str, tuple[str, ...]]:
    """How ``family`` writes forced calls: (what opens them, what separates two, what closes them), the key of a
    call's arguments (each call is ``{"name": ..., <key>: {...}}``) and the family's markers."""
    syntax = _SYNTAX[family]
    return syntax.forced, syntax.arguments[0], tuple(m for m in (syntax.start, syntax.end) if m is not None)


def tokenizer_family(tokenizer: Any) -> str | None:
    """``family_of`` the template the tokenizer applies when tools are given."""
    try:
        template = tokenizer.get_chat_template(None, [{"type": "function", "function": {"name": "f"}}])
    except Exception:  # no template at all (or none for tools): no calls to parse
        return None
    return family_of(template)


class ToolCallParser:
    """Splits an answer into ``Text`` and ``ToolCall`` pieces as it streams (see the module docstring).

    ``tools``: the names the request declared (a call to another name stays text); ``strict``: the strict
    tools' schemas, each call to one checked (``ToolArgumentsError``).
    """

    def __init__(self, family: str, tools: Collection[str], limit: int | None = None,
                 strict: Mapping[str, Validator] | None = None):
        if family not in _SYNTAX:
            raise ValueError(f"unknown tool-call family {family!r}; one of {FAMILIES}")
        self._syntax, self._tools, self._limit = _SYNTAX[family], frozenset(tools), limit
        self._strict = dict(strict or {})
        self._calls = 0
        self._buffer = ""  # text not yet released
        self._inside = False  # in a call: the buffer holds its body
        self._opened = ""  # the marker that opened the call, with the whitespace before it ("" for a bare one)
        self._started = False  # something was released or opened: a bare call can no longer begin
        self._after_call = False  # a call just closed: the whitespace that follows is not an answer

    def feed(self, text: str) -> list[Piece]:
        """The pieces ``text`` (the next delta) completes."""
        self._buffer += text
        out: list[Piece] = []
        while self._step(out):
            pass
        return out

    def finish(self, cut: bool = False) -> list[Piece]:
        """The pieces left at the end of the answer (``cut``: by ``max_tokens``, so a call may be incomplete)."""
        out: list[Piece] = []
        end = self._syntax.end
        # Each marker was inside a string (none outside): the call ends at the first, as a call the model broke;
        # unless the whole body is JSON (the markers its strings', the last tag never closed) or, cut by
        # max_tokens, the beginning of JSON, the closing tag the cut may have begun after it left out (the markers
        # its strings', the call cut): read below.
        if self._inside and end is not None and end in self._buffer and not (
                _json_prefix(self._buffer[:len(self._buffer) - _held(self._buffer, end)]) if cut
                else _json_whole(self._buffer)):
            body, _, self._buffer = self._buffer.partition(end)
            self._close(body, end, out)
            while self._step(out):
                pass
            return merge_texts(out + self.finish(cut))
        if self._inside:
            self._close(self._buffer, "", out, cut)
        elif self._buffer and not self._after_call:
            out.append(Text(self._buffer))
        self._buffer = ""
        return merge_texts(out)

    def _step(self, out: list[Piece]) -> bool:
        """Release what the buffer decides; True if it may decide more."""
        syntax = self._syntax
        if self._inside:
            at = -1 if syntax.end is None else _end_of_call(self._buffer, syntax.end)
            if at < 0:
                return False
            body, self._buffer = self._buffer[:at], self._buffer[at + len(syntax.end):]
            self._close(body, syntax.end, out)
            return True
        if self._after_call:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return False
            self._after_call = False
        if not self._started and syntax.bare is not None:
            head = self._buffer.lstrip()
            if not head or (syntax.start.startswith(head) and head != syntax.start):
                return False  # only whitespace, or what may still become the marker: undecided
            if head.startswith(syntax.bare) and not head.startswith(syntax.start):
                self._open("", self._buffer)
                return True
        at = self._buffer.find(syntax.start)
        if at >= 0:
            before = self._buffer[:at].rstrip()  # the whitespace before a call is the call's
            self._release(before, out)
            self._open(self._buffer[len(before):at + len(syntax.start)], self._buffer[at + len(syntax.start):])
            return True
        # Held back: what may begin a marker, and the whitespace before it (dropped if a call follows).
        cut = len(self._buffer[:len(self._buffer) - _held(self._buffer, syntax.start)].rstrip())
        self._release(self._buffer[:cut], out)
        self._buffer = self._buffer[cut:]
        return False

    def _release(self, text: str, out: list[Piece]) -> None:
        if text:
            out.append(Text(text))
            self._started = True

    def _open(self, marker: str, rest: str) -> None:
        self._inside, self._opened, self._buffer, self._started = True, marker, rest, True

    def _close(self, body: str, end: str, out: list[Piece], cut: bool = False) -> None:
        """A call's body is complete (``cut``: or ends where ``max_tokens`` cut it): its calls, or (invalid) the
        text the model wrote."""
        self._inside = False
        room = None if self._limit is None else max(self._limit - self._calls, 0)
        calls, reason = self._parse_cut(body, room) if cut else ([], "")
        if not calls:
            calls, reason = self._parse(body, room, cut)
        if calls:
            room = len(calls) if room is None else room
            if room < len(calls):
                log.warning("dropped %d tool call(s) past the %d allowed (parallel calls off)", len(calls) - room,
                            self._limit)
            out.extend(calls[:room])
            self._calls += len(calls)
            self._after_call = True
        else:
            log.warning("tool call returned as text: %s", reason)
            out.append(Text(self._opened + body + end))

    def _parse(self, body: str, room: int | None, cut: bool = False) -> tuple[list[ToolCall], str]:
        """The calls in ``body``, or ([], why not); only the first ``room`` (None: all) are kept, and checked. A
        body ``max_tokens`` cut that does not parse is no broken call: text, whatever tool it names."""
        try:
            values = _json_values(body)
        except ValueError as exc:
            if room != 0 and not cut:
                self._unparsed(body, exc)
            return [], f"not JSON ({exc}): {body[:200]!r}"
        objects = [item for value in values for item in (value if isinstance(value, list) else [value])]
        if not objects:
            return [], "no call in the tool-call syntax"
        return self._read_calls(objects, room)

    def _read_calls(self, objects: list[Any], room: int | None) -> tuple[list[ToolCall], str]:
        """The calls ``objects`` make, the first ``room`` (None: all) checked; ([], why) if one is no call."""
        calls = []
        for i, obj in enumerate(objects):
            call = obj if isinstance(obj, ToolCall) else self._call(obj, room is None or i < room)
            if isinstance(call, str):
                return [], call
            calls.append(call)
        return calls, ""

    def _parse_cut(self, body: str, room: int | None) -> tuple[list[ToolCall], str]:
        """The calls in ``body``, which ``max_tokens`` cut: those written whole (checked, as ``_parse``), then
        the call it cut once its name is written (incomplete, not checked). ([], why) where no call in it is
        whole and the cut one names no declared tool yet (``_parse`` then reads ``body``)."""
        objects, rest = _whole_values(body)
        cut = _CUT_CALL.match(rest)
        name = None if cut is None else _string(cut.group("name"))
        if cut is not None and name in self._tools:
            arguments = (cut.group("arguments") or "").strip()
            try:  # the arguments are whole, only the rest of the call is missing (its end, or a member after them,
                # as the "id" Mistral's template writes): a whole call
                objects.append({"name": name, "arguments": _leading_value(arguments)})
            except ValueError:
                objects.append(ToolCall(name, arguments, complete=False))
        elif not objects:
            return [], "cut before a call's name"
        elif rest.strip():
            log.warning("what max_tokens left of a call after %d whole one(s) is dropped: %r", len(objects),
                        rest[:200])
        return self._read_calls(objects, room)

    def _unparsed(self, body: str, exc: ValueError) -> None:
        """Raise ``ToolArgumentsError`` if ``body``, which does not parse, names a strict tool."""
        for quoted in _NAME.findall(body):
            try:
                name = json.loads(quoted)
            except ValueError:
                continue
            if name in self._strict:
                log.warning("strict tool call not served: %r: not JSON (%s)", name, exc)
                raise ToolArgumentsError(f"the model's call to strict tool {name!r} is not JSON ({exc})")

    def _call(self, obj: Any, check: bool = True) -> ToolCall | str:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return f"a call must be an object with a string name: {json.dumps(obj)[:200]}"
        name = obj["name"]
        if name not in self._tools:
            return f"the model called {name!r}, which the request did not declare"
        args = next((obj[k] for k in self._syntax.arguments if k in obj), {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = _loads(args)
            except ValueError:
                return self._broken(name, "a string that is not JSON", check)
        if not isinstance(args, dict):
            return self._broken(name, "not a JSON object", check)
        if check and name in self._strict:
            check_arguments(name, args, self._strict[name])
        return ToolCall(name, json.dumps(args, ensure_ascii=False))

    def _broken(self, name: str, what: str, check: bool) -> str:
        """Why a call's arguments are unusable: text of a loose tool's call, an error for a strict one's."""
        reason = f"the arguments of {name!r} are {what}"
        if check and name in self._strict:
            log.warning("strict tool call not served: %s", reason)
            raise ToolArgumentsError(f"the model called strict tool {name!r} with arguments that are {what}")
        return reason


@dataclass(frozen=True, slots=True)
class ToolUse:
    """How one request reads its answer's calls: the template's ``family``, the declared tool ``names``,
    what ``tool_choice`` asks ("auto", "required" or a tool's name) and whether several calls may come back
    (``parallel``; if not, calls after the first are dropped and logged)."""

    family: str
    names: frozenset[str]
    choice: str = "auto"
    parallel: bool = True
    strict: Mapping[str, Validator] = field(default_factory=dict)  # the strict tools' schemas (``tool_schemas``)

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.family, self.names, None if self.parallel else 1, self.strict)

    def check(self, pieces: list[Piece], cut: bool = False) -> list[Piece]:
        """``pieces``, once ``check_choice`` accepts their calls (``cut``: the answer was cut by ``max_tokens``)."""
        check_choice(calls_of(pieces), self.choice, cut)
        return pieces

    def read(self, text: str, cut: bool = False) -> list[Piece]:
        """The checked pieces of a whole answer (``cut``: by ``max_tokens``; its last call may be incomplete)."""
        parser = self.parser()
        return self.check(merge_texts(parser.feed(text) + parser.finish(cut)), cut)


def tool_use(family: str | None, names: Collection[str], choice: str | None, parallel: bool = True,
             param: str = "tool_choice", strict: Mapping[str, Validator] | None = None) -> ToolUse | None:
    """How a request's answer is read for calls (None: as plain text), or ``InvalidRequestError``.

    ``choice``: None or "auto", "none" (the tools are hidden: no calls), "required", or a declared tool's
    name. A request forcing a call needs tools, and a template whose call syntax is known (``family``).
    ``strict``: the strict tools' schemas (``tool_schemas``), their calls checked against them; they too need
    a known ``family`` unless the tools are hidden.
    """
    names = frozenset(names)
    if choice == "none":
        return None
    forced = choice not in (None, "auto")
    if forced and not names:
        raise InvalidRequestError(f"tool_choice {choice!r} needs tools", param=param)
    if forced and choice != "required" and choice not in names:
        raise InvalidRequestError(f"tool_choice names {choice!r}, which is not one of the tools", param=param)
    if family is None:
        if forced:
            raise InvalidRequestError(f"tool_choice {choice!r} cannot be honoured: this model's chat template "
                                      f"writes tool calls in none of the syntaxes this server reads "
                                      f"({', '.join(FAMILIES)})", param=param)
        if strict and names:  # its calls could not be told from text, so not checked against their schemas
            raise InvalidRequestError(f"strict tool {sorted(strict)[0]!r} cannot be honoured: this model's chat "
                                      f"template writes tool calls in none of the syntaxes this server reads "
                                      f"({', '.join(FAMILIES)}), so its calls cannot be checked against its "
                                      "schema (send strict false)", param="tools")
        return None
    if not names:
        return None
    return ToolUse(family, names, "auto" if choice is None else choice, parallel, dict(strict or {}))


def openai_tool_use(family: str | None, tools: Sequence[Any] | None, choice: str | dict[str, Any] | None,
                    parallel: bool | None = None) -> ToolUse | None:
    """``tool_use`` of an OpenAI-shaped request: ``tools`` of ``{"type": "function", "function": {"name"}}``,
    ``choice`` a string or ``{"type": "function", "function": {"name": ...}}``. A strict function's schema
    is checked (``tool_schemas.openai_strict``) whatever ``choice`` is."""
    strict = openai_strict(tools)
    if isinstance(choice, dict):
        choice = (choice.get("function") or {}).get("name")
        if not isinstance(choice, str):
            raise InvalidRequestError("a tool_choice object names a function: {'type': 'function', 'function': "
                                      "{'name': ...}}", param="tool_choice")
    names = [(t.get("function") or {}).get("name") for t in tools or [] if isinstance(t, dict)]
    return tool_use(family, [n for n in names if isinstance(n, str)], choice, parallel is not False, strict=strict)


def anthropic_tool_use(family: str | None, tools: Sequence[Any] | None,
                       choice: dict[str, Any] | None) -> ToolUse | None:
    """``tool_use`` of an Anthropic-shaped request: ``tools`` of ``{"name", "input_schema", "strict"}``,
    ``choice`` ``{"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}``."""
    strict = anthropic_strict(tools)
    choice = choice if isinstance(choice, dict) else {}
    kind = choice.get("type")
    names = [t.get("name") for t in tools or [] if isinstance(t, dict)]
    return tool_use(family, [n for n in names if isinstance(n, str)],
                    {"any": "required", "tool": choice.get("name")}.get(kind, kind),
                    not choice.get("disable_parallel_tool_use"), param="tool_choice.type", strict=strict)


def parse(family: str, tools: Collection[str], text: str) -> list[Piece]:
    """The pieces of a whole answer (as ``feed`` of all of it, then ``finish``)."""
    parser = ToolCallParser(family, tools)
    return merge_texts(parser.feed(text) + parser.finish())


def calls_of(pieces: list[Piece]) -> list[ToolCall]:
    return [p for p in pieces if isinstance(p, ToolCall)]


def text_of(pieces: list[Piece]) -> str:
    return "".join(p.text for p in pieces if isinstance(p, Text))


def cut_short(pieces: list[Piece]) -> bool:
    """Whether ``max_tokens`` cut the answer inside a call (its last call is incomplete)."""
    return any(isinstance(p, ToolCall) and not p.complete for p in pieces)


def check_choice(calls: list[ToolCall], choice: str | None, cut: bool = False) -> None:
    """Raise ``ToolCallError`` if the answer's calls break ``choice``: "required" (at least one call) or a
    tool's name (a call, every one to that tool). None, "auto" and "none" accept anything. An answer ``cut``
    by ``max_tokens`` may lack its call: it ended before it."""
    if choice in (None, "auto", "none"):
        return
    if not calls and cut:
        return
    if not calls:
        wanted = "a tool call" if choice == "required" else f"a call to {choice!r}"
        raise ToolCallError(f"tool_choice asked for {wanted}; the model answered without one")
    if choice != "required":
        other = next((c.name for c in calls if c.name != choice), None)
        if other is not None:
            raise ToolCallError(f"tool_choice named {choice!r}; the model called {other!r}")


#: A call's ``"name": "..."``, found in a body that does not parse.
_NAME = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")')


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"{text} is past a float's range")
    return number


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")


_DECODER = json.JSONDecoder(parse_float=_finite, parse_constant=_no_constant)
#: The escape of a UTF-16 surrogate (``\ud83d``): JSON allows it alone, UTF-8 cannot write it.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _decode(text: str, at: int = 0) -> tuple[Any, int]:
    """``_DECODER.raw_decode``, and ValueError for a string (or key) holding a lone surrogate escape
    (``"\\ud83d"``): as ``NaN``, it could not be written back (no UTF-8 text holds it; the answer would fail)."""
    value, end = _DECODER.raw_decode(text, at)
    if _SURROGATE_ESCAPE.search(text, at, end) is None:
        return value, end
    todo = [value]
    while todo:
        node = todo.pop()
        if isinstance(node, str):
            try:
                node.encode()
            except UnicodeEncodeError:
                raise ValueError("a string holds a lone surrogate escape (no Unicode text)") from None
        elif isinstance(node, dict):
            todo.extend(node)
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return value, end


def _loads(text: str) -> Any:
    """``text``'s JSON value, or ValueError (``_json_values``)."""
    values = _json_values(text)
    if len(values) != 1:
        raise ValueError(f"{len(values)} JSON values")
    return values[0]


def _json_values(body: str) -> list[Any]:
    """The JSON values in ``body``, separated by whitespace or ``;`` (Llama's several calls); ValueError for
    what is not JSON, ``NaN``, ``Infinity`` and a number past a float's range included, or nests too deep."""
    values, at = [], 0
    while True:
        while at < len(body) and (body[at].isspace() or body[at] == ";"):
            at += 1
        if at == len(body):
            return values
        try:
            value, at = _decode(body, at)
        except RecursionError:
            raise ValueError("nested deeper than this server parses") from None
        values.append(value)


#: What ``max_tokens`` left of a call: its name, and what was written of its arguments (once their key was).
_CUT_CALL = re.compile(r'\s*\{\s*"name"\s*:\s*(?P<name>"(?:[^"\\]|\\.)*")\s*'
                       r'(?:,\s*(?:"(?:arguments|parameters)"\s*:(?P<arguments>.*)|"?[a-z]*"?\s*))?\Z', re.DOTALL)


def _string(quoted: str) -> str | None:
    try:
        value = json.loads(quoted)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _leading_value(text: str) -> Any:
    """The JSON value ``text`` (a member's value onward, cut by ``max_tokens``) begins with, whole, where what
    follows it is nothing or the object's next member; ValueError otherwise."""
    try:
        value, end = _decode(text)
    except RecursionError:
        raise ValueError("nested deeper than this server parses") from None
    rest = text[end:].strip()
    if rest and not rest.startswith(","):
        raise ValueError(f"{rest[:20]!r} after a value")
    return value


def _whole_values(body: str) -> tuple[list[Any], str]:
    """The JSON values ``body`` (a call body cut by ``max_tokens``) holds whole, lists flattened (Mistral's
    ``[...]`` of calls may be cut before it closes), and the rest, which does not parse."""
    values: list[Any] = []
    at = len(body) - len(body.lstrip())
    if body.startswith("[", at):
        try:
            _decode(body, at)
        except (ValueError, RecursionError):
            at += 1  # a list of calls cut before it closes: its items one by one
    while True:
        while at < len(body) and (body[at].isspace() or body[at] in ";,"):
            at += 1
        try:
            value, end = _decode(body, at)
        except (ValueError, RecursionError):
            return values, body[at:]
        values.extend(value if isinstance(value, list) else [value])
        at = end


def _whole_members(text: str) -> dict[str, Any]:
    """The members of a JSON object cut short (``text``) that were written whole."""
    members: dict[str, Any] = {}
    at = len(text) - len(text.lstrip())
    if not text.startswith("{", at):
        return members
    at += 1
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ","):
            at += 1
        try:
            key, at = _decode(text, at)
            while at < len(text) and text[at].isspace():
                at += 1
            if not isinstance(key, str) or not text.startswith(":", at):
                return members
            at += 1
            while at < len(text) and text[at].isspace():
                at += 1
            value, end = _decode(text, at)
        except (ValueError, RecursionError):
            return members
        if isinstance(value, int | float) and not isinstance(value, bool) and not text[end:end + 1].isspace() \
                and not text.startswith((",", "}"), end):
            return members  # a number the cut may have ended in (``1e``, ``1.``: read as 1), or at the very end
        members[key] = value
        at = end


#: A JSON string (to its closing quote, or the end of the text), or anything else that is no quote.
_STRING_OR_NOT = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\\?\Z)|[^"]+', re.DOTALL)


def _json_whole(body: str) -> bool:
    """Whether ``body`` is JSON values (``_json_values``)."""
    try:
        _json_values(body)
    except ValueError:
        return False
    return True


#: What a cut may leave unfinished where JSON stops parsing: an open string (an escape begun at its end), a
#: literal or a number begun, or a ``\uXXXX`` escape begun (where the decoder reports it).
_UNFINISHED = re.compile(r'\s*(?:"(?:[^"\\]|\\.)*\\?|t(?:r(?:ue?)?)?|f(?:a(?:l(?:se?)?)?)?|n(?:u(?:ll?)?)?'
                         r'|-?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d*)?)?|u[0-9a-fA-F]{0,3})', re.DOTALL)


def _json_prefix(body: str) -> bool:
    """Whether ``body`` (a call's body, cut by ``max_tokens``) is the beginning of JSON values: JSON up to the cut,
    not JSON the model broke before it."""
    at = 0
    while True:
        while at < len(body) and (body[at].isspace() or body[at] in ";,"):
            at += 1
        if at == len(body):
            return True
        try:
            _, at = _decode(body, at)
        except json.JSONDecodeError as exc:
            begun = exc.pos
            while begun > 0 and body[begun - 1] in "0123456789.eE+-":  # a number it read short (1 of 1e)
                begun -= 1
            return any(_UNFINISHED.fullmatch(body, stop) is not None for stop in (exc.pos, begun))
        except (ValueError, RecursionError):
            return False


def _end_of_call(body: str, end: str) -> int:
    """Where the first ``end`` marker in ``body`` (a call's body so far) outside a JSON string begins; -1 for
    none (a marker inside a string, as an argument that quotes it, is the string's)."""
    if end not in body:
        return -1
    for match in _STRING_OR_NOT.finditer(body):
        if match.group().startswith('"'):
            continue
        at = match.group().find(end)
        if at >= 0:
            return match.start() + at
    return -1


def _held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` to hold back: a marker may begin there."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def merge_texts(pieces: list[Piece]) -> list[Piece]:
    """``pieces`` with adjacent texts joined (a stream splits text where its deltas fall)."""
    out: list[Piece] = []
    for piece in pieces:
        if isinstance(piece, Text) and out and isinstance(out[-1], Text):
            out[-1] = Text(out[-1].text + piece.text)
        else:
            out.append(piece)
    return out
