"""Input limits: every request is measured against ``Settings`` before any work starts.

Two stages. The raw body (``read_body``): at most ``max_body_bytes`` are read, with or
without a Content-Length (413 above), within ``body_timeout_seconds`` (408 after), it must be
UTF-8 (400 otherwise: ``json.loads`` would also take UTF-16 or UTF-32, whose bytes the nesting
count below cannot read), and its nesting is measured before it is parsed
(a deep body would exhaust the parser's and the validators' recursion); it is parsed once,
here, so an integer too long for Python to convert is refused naming its parameter. Then the parsed
request (``check_chat``, ``check_completion``, ``check_prewarm``): message count, text
bytes, tools, stop strings, logit_bias. Every refusal is a ``LimitExceededError`` (400)
naming the parameter, or a ``PayloadTooLargeError`` (413).
"""
from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterable
from typing import Any

import numpy as np
from starlette.requests import ClientDisconnect, Request

from .errors import BodyTimeoutError, ClientClosedError, LimitExceededError, PayloadTooLargeError
from .protocol import ChatCompletionRequest, CompletionRequest, GenerationFields, PrewarmRequest, Tool
from .settings import Settings

_OPEN, _CLOSE = frozenset(b"[{"), frozenset(b"]}")
_NOT_BRACKET = bytes(sorted(set(range(256)) - _OPEN - _CLOSE))
_OFF_LOOP_BYTES = 64 << 10  # larger bodies are measured on a thread, not the event loop


# -- raw body ---------------------------------------------------------------------------
async def read_body(request: Request, settings: Settings) -> tuple[bytes, Any]:
    """The body, read chunk by chunk and never past ``max_body_bytes``; its nesting checked; and
    the JSON it holds (``NOT_JSON`` if it holds none: the route's parser then says why).

    Raises ``PayloadTooLargeError`` (a declared or actual size over the limit), ``BodyTimeoutError``
    (not all there within ``body_timeout_seconds``) or ``LimitExceededError`` (not UTF-8, nested deeper
    than ``max_json_depth``, or a number too long to parse).
    """
    limit = settings.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(settings.body_timeout_seconds):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:  # a chunked upload without a length: stop reading here
                    raise _too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise BodyTimeoutError(f"the request body did not arrive within {settings.body_timeout_seconds:g} s") from None
    except ClientDisconnect:  # gone before its body came in: nobody reads an answer (not a 500)
        raise ClientClosedError("the client closed the connection before its body arrived") from None
    body = b"".join(chunks)
    if size > _OFF_LOOP_BYTES:
        return body, await asyncio.to_thread(inspect_json, body, settings.max_json_depth)
    return body, inspect_json(body, settings.max_json_depth)


def inspect_json(body: bytes, max_depth: int) -> Any:
    """``body``'s JSON (``NOT_JSON`` if it holds none), once it is known to be UTF-8 and no deeper than
    ``max_depth``; raises ``LimitExceededError`` otherwise."""
    text = utf8_text(body)
    depth = json_depth(body)  # byte-wise, sound for UTF-8 only: no byte of a multi-byte character is a quote
    if depth > max_depth:
        raise LimitExceededError(f"the request body nests {depth} levels deep; at most {max_depth} are accepted",
                                 code="json_too_deep")
    return parse_json(text)


def utf8_text(body: bytes) -> str:
    """``body`` decoded as UTF-8 (a leading byte order mark dropped); ``LimitExceededError`` if it is not.

    JSON is parsed from this text, never from the bytes: ``json.loads(bytes)`` guesses UTF-16 or UTF-32
    from NUL bytes, and would read text the depth count never saw."""
    try:
        return body.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise LimitExceededError(f"the request body is not valid UTF-8 (at byte {exc.start}); send JSON in UTF-8",
                                 code="invalid_encoding") from None


NOT_JSON = object()


class _HugeInt:
    """An integer literal longer than Python converts (``sys.get_int_max_str_digits``)."""

    def __init__(self, digits: int):
        self.digits = digits


def parse_json(raw: str) -> Any:
    """``json.loads(raw)``, except that an integer too long to convert is a ``LimitExceededError``
    naming where it is (json.loads would raise a bare ``ValueError``); ``NOT_JSON`` if not JSON."""
    limit = sys.get_int_max_str_digits()
    huge: list[_HugeInt] = []

    def parse_int(text: str) -> int | _HugeInt:
        if limit and len(text.lstrip("-")) > limit:
            huge.append(_HugeInt(len(text.lstrip("-"))))
            return huge[-1]
        return int(text)

    try:
        value = json.loads(raw, parse_int=parse_int)
    except ValueError:  # malformed (JSONDecodeError) or not UTF-8: FastAPI's parser reports it
        return NOT_JSON
    except RecursionError:  # deeper than the interpreter's stack (``read_body`` checks the depth first)
        raise LimitExceededError("the request body nests too deeply", code="json_too_deep") from None
    if huge:
        where, number = _find(value, huge[0])
        raise LimitExceededError(f"{where or 'the body'}: the number has {number.digits} digits; it cannot be a "
                                 "valid value", param=where, code="number_too_large")
    return value


def _find(value: Any, target: _HugeInt) -> tuple[str | None, _HugeInt]:
    """The path of ``target`` in parsed JSON, spelled as errors name parameters (``messages[0].content``)."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if item is target:
            return path or None, target
        if isinstance(item, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(item))
    return None, target


def _too_large(limit: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(f"the request body is larger than {limit} bytes")


def json_depth(raw: bytes) -> int:
    """Deepest nesting of arrays and objects in JSON text, in time linear in its length.

    Brackets inside strings do not count. Escapes go first (an escaped backslash, then
    an escaped quote), so the quotes left delimit strings; text outside them is every
    other piece between quotes. Malformed text gets a number too; the parser refuses it.
    """
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(unescaped.split(b'"')[::2])
    brackets = np.frombuffer(outside.translate(None, _NOT_BRACKET), dtype=np.uint8)
    if not brackets.size:
        return 0
    steps = np.where(np.isin(brackets, list(_OPEN)), 1, -1).astype(np.int32)
    return int(np.cumsum(steps).max())


# -- parsed requests ----------------------------------------------------------------------
def check_chat(req: ChatCompletionRequest, settings: Settings) -> None:
    _check_messages(req.messages, settings)
    _check_tools(req.tools, settings)
    _check_sampling(req, settings)
    _check_response_format(req, settings)


def _check_response_format(req: ChatCompletionRequest, settings: Settings) -> None:
    """A json_schema response format is bounded as a tool definition is: compiling it costs with its size."""
    spec = (req.response_format.model_extra or {}).get("json_schema") if req.response_format is not None else None
    if isinstance(spec, dict):
        _check_format_schema(spec, spec.get("schema"), "response_format.json_schema", settings)


def _check_format_schema(value: Any, schema: Any, param: str, settings: Settings) -> None:
    """An answer format (``value`` at ``param``, its JSON schema at ``param``.schema) within the tool limits."""
    size = _json_bytes(value)
    if size > settings.max_tool_schema_bytes:
        raise LimitExceededError(f"{param} is {size} bytes as JSON; at most {settings.max_tool_schema_bytes} are "
                                 "accepted", param=param, code="string_above_max_length")
    depth = _depth(schema)
    if depth > settings.max_tool_schema_depth:
        raise LimitExceededError(f"{param}.schema nests {depth} levels deep; at most "
                                 f"{settings.max_tool_schema_depth} are accepted", param=f"{param}.schema",
                                 code="json_too_deep")


def check_completion(req: CompletionRequest, settings: Settings) -> None:
    prompts = req.prompt if isinstance(req.prompt, list) else [req.prompt]
    _check_bytes(_utf8(prompts) + _utf8([req.suffix]), settings, "prompt")
    _check_sampling(req, settings)


def check_prewarm(req: PrewarmRequest, settings: Settings) -> None:
    """The prewarm's text; its length in tokens is checked once encoded (``Serving.prewarm``)."""
    if req.messages is not None:
        _check_messages(req.messages, settings)
    else:
        _check_bytes(_utf8([req.prompt]), settings, "prompt")
    _check_tools(req.tools, settings)


def check_counts(body: Any, settings: Settings) -> None:
    """The array sizes of a parsed body, before it is validated: validating 20,000 messages (or
    tools, logit_bias entries) costs far more than refusing them."""
    if not isinstance(body, dict):
        return
    for param, limit in (("messages", settings.max_messages), ("input", settings.max_messages),
                         ("tools", settings.max_tools), ("logit_bias", settings.max_logit_bias)):
        value = body.get(param)
        if isinstance(value, (list, dict)):
            _check_count(param, len(value), limit)


def _check_count(param: str, count: int, limit: int) -> None:
    if count > limit:
        raise LimitExceededError(f"{param} has {count} entries; at most {limit} are accepted", param=param,
                                 code="array_above_max_length")
def check_anthropic(req: Any, settings: Settings) -> None:
    """An Anthropic messages (or token counting) request: messages, text bytes, tools, output format, stop
    sequences."""
    if len(req.messages) > settings.max_messages:
        raise LimitExceededError(f"messages has {len(req.messages)} messages; at most {settings.max_messages} are "
                                 "accepted", param="messages", code="array_above_max_length")
    dump = req.model_dump(exclude_none=True, include={"messages", "system"})
    _check_bytes(_json_bytes(dump), settings, "messages")
    tools = req.tools or []
    if len(tools) > settings.max_tools:
        raise LimitExceededError(f"tools has {len(tools)} definitions; at most {settings.max_tools} are accepted",
                                 param="tools", code="array_above_max_length")
    for i, tool in enumerate(tools):
        _check_tool(i, tool.model_dump(exclude_none=True), tool.input_schema, "input_schema", settings)
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:
        _check_format_schema(fmt.model_dump(by_alias=True), fmt.schema_, "output_config.format", settings)
    for i, stop in enumerate(getattr(req, "stop_sequences", None) or []):
        if len(stop) > settings.max_stop_chars:
            raise LimitExceededError(f"stop_sequences[{i}] is {len(stop)} characters long; at most "
                                     f"{settings.max_stop_chars} are accepted", param="stop_sequences",
                                     code="string_above_max_length")


def _check_messages(messages: list[Any], settings: Settings) -> None:
    _check_count("messages", len(messages), settings.max_messages)
    _check_bytes(sum(_message_bytes(m) for m in messages), settings, "messages")


def _message_bytes(message: Any) -> int:
    content = message.content
    texts = [content] if isinstance(content, str) else [part.text for part in content or ()]
    texts += [message.name, getattr(message, "tool_call_id", None)]
    calls = getattr(message, "tool_calls", None)
    return _utf8(texts) + (_json_bytes(calls) if calls else 0)


def _check_bytes(size: int, settings: Settings, param: str) -> None:
    if size > settings.max_content_bytes:
        raise LimitExceededError(f"{param} holds {size} bytes of text; at most {settings.max_content_bytes} are "
                                 "accepted", param=param, code="string_above_max_length")


def _check_tools(tools: list[Tool] | None, settings: Settings) -> None:
    if not tools:
        return
    _check_count("tools", len(tools), settings.max_tools)
    for i, tool in enumerate(tools):
        _check_tool(i, tool.model_dump(exclude_none=True), tool.function.parameters, "function.parameters", settings)


def _check_tool(i: int, definition: dict[str, Any], schema: Any, schema_param: str, settings: Settings) -> None:
    size = _json_bytes(definition)
    if size > settings.max_tool_schema_bytes:
        raise LimitExceededError(f"tools[{i}] is {size} bytes as JSON; at most {settings.max_tool_schema_bytes} "
                                 "are accepted", param=f"tools[{i}]", code="string_above_max_length")
    depth = _depth(schema)
    if depth > settings.max_tool_schema_depth:
        raise LimitExceededError(f"tools[{i}].{schema_param} nests {depth} levels deep; at most "
                                 f"{settings.max_tool_schema_depth} are accepted",
                                 param=f"tools[{i}].{schema_param}", code="json_too_deep")


def _check_sampling(req: GenerationFields, settings: Settings) -> None:
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    for i, stop in enumerate(stops):
        if len(stop) > settings.max_stop_chars:
            raise LimitExceededError(f"stop[{i}] is {len(stop)} characters long; at most {settings.max_stop_chars} "
                                     "are accepted", param="stop", code="string_above_max_length")
    if req.logit_bias is not None:
        _check_count("logit_bias", len(req.logit_bias), settings.max_logit_bias)


def _utf8(texts: Iterable[str | None]) -> int:
    return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts if t)


def _json_bytes(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass"))


def _depth(value: Any) -> int:
    """Nesting of dicts and lists (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest
