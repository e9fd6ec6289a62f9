"""Anthropic-shaped requests as canonical chat, with the positions of their cache breakpoints.

Input: ``system`` (a string or text blocks), ``messages`` (role ``user`` / ``assistant``,
content a string or blocks: ``text``, ``tool_use``, ``tool_result``) and ``tools``
(``name``, ``description``, ``input_schema``). They become the OpenAI-shaped chat the
canonicalizer encodes: system blocks one system message (joined with "\\n", as text parts
are), ``tool_use`` blocks an assistant's ``tool_calls``, ``tool_result`` blocks ``tool``
messages, tools function definitions. Other blocks (images, documents, …) are refused.

A top-level ``cache_control`` (automatic caching) marks the last cacheable block: the last
block of the last message (the whole message when its content is a string). It is one of
the ``MAX_BREAKPOINTS`` and follows the TTL order as any marker; on a block that carries its
own ``cache_control`` it adds nothing (the block's marker, TTL included, stands).

``output_config`` (``output_format``): ``format`` holds the answer to a JSON schema (``structured.py``);
``effort`` is accepted only as "high", Anthropic's default, which changes nothing on a model that does not
reason.

A breakpoint's position is the number of leading tokens the prompt shares with the same
request cut right after the marked block (encoded without a generation prompt): exactly
the tokens every request that agrees up to that block starts with, whatever the chat
template does with the text after it.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prefixcache.errors import InvalidRequestError
from prefixcache.serving.breakpoints import DEFAULT_TTL, Breakpoint, check_breakpoints
from prefixcache.serving.canonicalize import CHUNK_FIELD, Canonicalizer
from prefixcache.serving.structured import ResponseFormat, parse_output_format

ROLES = ("user", "assistant")
#: The ``output_config.effort`` levels honoured: Anthropic's default, the same as leaving it unset.
EFFORTS = ("high",)
#: Every level Anthropic defines (any other is no level at all).
EFFORT_LEVELS = ("low", "medium", "high", "xhigh", "max")
#: Where the cut of a breakpoint falls: ("tools", i), ("system", j) or ("messages", m, k).
Cut = tuple


@dataclass(frozen=True, slots=True)
class MessagesPrompt:
    """The canonical ids of a messages request and its breakpoints (positions set), in prefix order."""

    token_ids: tuple[int, ...]
    breakpoints: tuple[Breakpoint, ...]
    chunks: tuple[tuple[int, int], ...] = ()  # text blocks marked ``CHUNK_FIELD`` (``CanonicalPrompt.chunks``)
    unplaced: int = 0


def encode_messages(canon: Canonicalizer, messages: Sequence[dict[str, Any]], system: Any = None,
                    tools: Sequence[dict[str, Any]] | None = None, tool_choice: dict[str, Any] | None = None,
                    cache_control: dict[str, Any] | None = None) -> MessagesPrompt:
    """Encode a messages request and locate its breakpoints (``cache_control``: the top-level, automatic
    marker). Raises ``InvalidRequestError`` (with ``param``)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of messages", param="messages")
    tools = list(tools or [])
    hide_tools = _tool_choice(tool_choice, tools)
    marks = _marks(messages, system, tools)
    if cache_control is not None:
        marks += _automatic(messages, cache_control, marks)
    check_breakpoints([bp for bp, _ in marks])
    chat, chat_tools = to_chat(messages, system, tools)
    chat_tools = None if hide_tools else chat_tools
    prefill = bool(chat) and chat[-1]["role"] == "assistant"  # a final assistant turn: the answer continues it
    encoded = canon.encode_chat(chat, chat_tools, add_generation_prompt=not prefill, continue_final_message=prefill)
    full = encoded.token_ids
    located, floor = [], 0
    for bp, cut in marks:
        floor = max(floor, _position(canon, full, messages, system, tools, cut, hide_tools))
        located.append(Breakpoint(bp.where, bp.ttl, floor))
    return MessagesPrompt(full, tuple(located), encoded.chunks, encoded.unplaced)


def output_format(config: Any, messages: Sequence[Any] = (), tool_choice: Any = None) -> ResponseFormat | None:
    """Anthropic's ``output_config``, checked: its ``format`` compiled (``structured.parse_output_format``; None:
    the answer is text). ``effort`` other than "high" (the default) is refused: the model does not reason, so
    no other level can be honoured. A format cannot continue a prefilled final assistant turn nor come with a
    forced tool call (the answer's JSON starts at its first token). Raises ``InvalidRequestError`` (with
    ``param``)."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise InvalidRequestError("output_config must be an object with format and/or effort", param="output_config")
    unknown = sorted(set(config) - {"format", "effort"})
    if unknown:
        raise InvalidRequestError(f"output_config.{unknown[0]}: unknown field", param=f"output_config.{unknown[0]}")
    effort = config.get("effort")
    if effort is not None and effort not in EFFORTS:
        known = effort in EFFORT_LEVELS
        raise InvalidRequestError(f"output_config.effort {effort!r} is " + (
            "not supported by this model (it does not reason): only 'high', the default, is accepted" if known
            else f"not one of {', '.join(EFFORT_LEVELS)}"), param="output_config.effort")
    fmt = parse_output_format(config.get("format"), "output_config.format")
    if fmt is None:
        return None
    if prefilled(messages):
        raise InvalidRequestError("output_config.format cannot be used with a prefilled assistant message (the "
                                  "answer's JSON starts at its first token): end messages with a user turn",
                                  param="output_config.format")
    if isinstance(tool_choice, dict) and tool_choice.get("type") in ("any", "tool"):
        raise InvalidRequestError("a forced tool call (tool_choice any or tool) cannot be made with "
                                  "output_config.format (the answer is its JSON)", param="tool_choice")
    return fmt


def prefilled(messages: Any) -> bool:
    """Whether ``messages`` end with an assistant turn (a prefill: the answer continues it)."""
    last = messages[-1] if isinstance(messages, (list, tuple)) and messages else None
    return isinstance(last, dict) and last.get("role") == "assistant"


def to_chat(messages: Sequence[Any], system: Any, tools: Sequence[Any]) -> tuple[list[dict], list[dict] | None]:
    """OpenAI-shaped chat messages and tool definitions of an Anthropic-shaped request."""
    chat: list[dict] = []
    if system is not None and system != []:
        chat.append({"role": "system", "content": _joined(_blocks(system, "system"))})
    for i, message in enumerate(messages):
        chat += _message(message, f"messages[{i}]")
    defs = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    return chat, defs or None


def _tool_choice(choice: dict[str, Any] | None, tools: list) -> bool:
    """Whether the tools are hidden from the model (``none``). Forcing a call (``any``, ``tool``) is read off
    the answer (``tool_calls.tool_use``): the prompt is the same as for ``auto``."""
    if choice is None:
        return False
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise InvalidRequestError("tool_choice.type must be one of auto, any, tool, none", param="tool_choice.type")
    if kind == "tool" and not isinstance(choice.get("name"), str):
        raise InvalidRequestError("tool_choice of type 'tool' needs the tool's name", param="tool_choice.name")
    return kind == "none"


def _marks(messages: Sequence[Any], system: Any, tools: Sequence[Any]) -> list[tuple[Breakpoint, Cut]]:
    """Every block with ``cache_control``, in prefix order (tools, system, messages)."""
    found: list[tuple[Breakpoint, Cut]] = []

    def visit(block: Any, where: str, cut: Cut) -> None:
        control = block.get("cache_control") if isinstance(block, dict) else None
        if control is not None:
            found.append((_breakpoint(control, where), cut))

    for i, tool in enumerate(tools):
        visit(tool, f"tools[{i}]", ("tools", i))
    if isinstance(system, list):
        for j, block in enumerate(system):
            visit(block, f"system[{j}]", ("system", j))
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for k, block in enumerate(content):
                visit(block, f"messages[{m}].content[{k}]", ("messages", m, k))
                inner = block.get("content") if isinstance(block, dict) and block.get("type") == "tool_result" else None
                for j, part in enumerate(inner if isinstance(inner, list) else []):
                    # A tool result is rendered as one text: a mark inside it keeps the prefix to its end.
                    visit(part, f"messages[{m}].content[{k}].content[{j}]", ("messages", m, k))
    return found


def _breakpoint(control: Any, where: str) -> Breakpoint:
    """The breakpoint a ``cache_control`` value at ``where`` asks for (``where`` is "cache_control" for the
    top-level marker: its param is then ``cache_control.type``)."""
    at = f"{where}.cache_control" if where != "cache_control" else where
    if not isinstance(control, dict) or control.get("type") != "ephemeral":
        raise InvalidRequestError(f"{at}.type must be 'ephemeral'", param=f"{at}.type")
    ttl = control.get("ttl", DEFAULT_TTL)  # only an absent ttl is the default; a wrong one is refused
    return Breakpoint(where, ttl if isinstance(ttl, str) else repr(ttl))


def _automatic(messages: Sequence[Any], control: Any, marks: list[tuple[Breakpoint, Cut]]
               ) -> list[tuple[Breakpoint, Cut]]:
    """The top-level marker on the last cacheable block, unless that block carries its own."""
    bp = _breakpoint(control, "cache_control")
    m = len(messages) - 1
    content = messages[m].get("content") if isinstance(messages[m], dict) else None
    cut: Cut = ("messages", m, len(content) - 1) if isinstance(content, list) and content else ("messages", m, None)
    if any(c == cut for _, c in marks):
        return []
    return [(bp, cut)]


def _position(canon: Canonicalizer, full: Sequence[int], messages: Sequence[Any], system: Any,
              tools: list, cut: Cut, hide_tools: bool) -> int:
    """Tokens ``full`` shares with the request cut right after the block at ``cut``."""
    kind = cut[0]
    if kind == "tools":
        # Nothing after the tools: probe with two different lone user turns and keep what both share.
        probes = [(tools[: cut[1] + 1], None, [{"role": "user", "content": text}]) for text in ("", ".")]
    elif kind == "system":
        probes = [(tools, system[: cut[1] + 1], [])]
    else:
        m, k = cut[1], cut[2]
        last = messages[m] if k is None else dict(messages[m], content=messages[m]["content"][: k + 1])
        probes = [(tools, system, [*messages[:m], last])]
    shared = len(full)
    for probe_tools, probe_system, probe_messages in probes:
        chat, defs = to_chat(probe_messages, probe_system, probe_tools)
        ids = canon.encode_chat(chat, None if hide_tools else defs, add_generation_prompt=False).token_ids
        shared = min(shared, common_prefix(full, ids))
    return shared


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _texts(value: Any, where: str) -> str:
    """A string, or text blocks joined with "\\n"."""
    return "\n".join(text for text, _ in _blocks(value, where))


def _blocks(value: Any, where: str) -> list[tuple[str, bool]]:
    """(text, marked ``CHUNK_FIELD``) of a string or of each text block."""
    if isinstance(value, str):
        return [(value, False)]
    if not isinstance(value, list):
        raise InvalidRequestError(f"{where} must be a string or a list of text blocks", param=where)
    parts = []
    for j, block in enumerate(value):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise InvalidRequestError(f"{where}[{j}] must be a text block ({{'type': 'text', 'text': ...}}); got "
                                      f"type {kind!r}", param=f"{where}[{j}]")
        parts.append((block["text"], _marked(block, f"{where}[{j}]")))
    return parts


def _marked(block: dict, at: str) -> bool:
    marked = block.get(CHUNK_FIELD, False)
    if not isinstance(marked, bool):
        raise InvalidRequestError(f"{at}.{CHUNK_FIELD} must be true or false", param=f"{at}.{CHUNK_FIELD}")
    return marked


def _joined(texts: list[tuple[str, bool]]) -> str | list[dict[str, Any]]:
    """Texts joined with "\\n"; as text parts when one is marked a chunk (rendered the same: parts join with "\\n")."""
    if not any(marked for _, marked in texts):
        return "\n".join(text for text, _ in texts)
    return [{"type": "text", "text": text, CHUNK_FIELD: marked} for text, marked in texts]


def _message(message: Any, where: str) -> list[dict]:
    """One Anthropic message as chat messages (a user turn with tool results becomes tool messages first)."""
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise InvalidRequestError(f"{where}.role must be 'user' or 'assistant'", param=f"{where}.role")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content must be a string or a list of content blocks",
                                  param=f"{where}.content")
    out: list[dict] = []
    texts: list[tuple[str, bool]] = []
    calls: list[dict] = []
    for k, block in enumerate(content):
        at = f"{where}.content[{k}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append((block["text"], _marked(block, at)))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(block, at))
        elif kind == "tool_result" and role == "user":
            if texts:  # a text before a tool result: keep the order
                out.append({"role": "user", "content": _joined(texts)})
                texts = []
            out.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", at),
                        "content": _result_text(block.get("content"), f"{at}.content")})
        else:
            raise InvalidRequestError(f"{at} has type {kind!r}: a {role} message takes text"
                                      f"{' and tool_use' if role == 'assistant' else ' and tool_result'} blocks "
                                      "(images, documents and other blocks are not supported)", param=f"{at}.type")
    if texts or calls or not out:
        turn: dict[str, Any] = {"role": role, "content": _joined(texts)}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    return out


def _tool_call(block: dict, at: str) -> dict:
    arguments = block.get("input")
    if not isinstance(arguments, dict):
        raise InvalidRequestError(f"{at}.input must be an object", param=f"{at}.input")
    return {"id": _string(block, "id", at), "type": "function",
            "function": {"name": _string(block, "name", at), "arguments": json.dumps(arguments, sort_keys=True)}}


def _result_text(content: Any, at: str) -> str:
    if content is None:
        return ""
    return _texts(content, at)


def _tool(tool: Any, at: str) -> dict:
    if not isinstance(tool, dict):
        raise InvalidRequestError(f"{at} must be a tool definition object", param=at)
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{at}.input_schema must be a JSON schema object", param=f"{at}.input_schema")
    function: dict[str, Any] = {"name": _string(tool, "name", at), "parameters": schema}
    if tool.get("description") is not None:
        function["description"] = _string(tool, "description", at)
    return {"type": "function", "function": function}


def _string(block: dict, key: str, at: str) -> str:
    value = block.get(key)
    if not isinstance(value, str) or not value and key != "description":
        raise InvalidRequestError(f"{at}.{key} must be a non-empty string", param=f"{at}.{key}")
    return value
