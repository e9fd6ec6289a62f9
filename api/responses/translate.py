"""A Responses API request -> a chat completion request, so it takes chat's one path to the engine.

The items become chat messages: ``instructions`` a system message first, then the stored
conversation of ``previous_response_id``, then ``input`` (a string is one user message;
``input_text``/``output_text`` parts are text parts; ``function_call`` items join the
assistant message before them as its ``tool_calls``, or make one; ``function_call_output``
items are tool messages). Flat function tools become chat's nested ones, ``max_output_tokens``
is ``max_tokens``, ``text.format`` chat's ``response_format``, ``include`` of the output text's logprobs chat's
``logprobs``; the cache fields and ``top_logprobs`` pass as they are. What would change the answer unless
honoured and cannot be is refused with a 400 naming it (``refuse``), never dropped.
"""
from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from prefixcache.errors import InvalidRequestError

from ..protocol import ChatCompletionRequest
from .protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    FunctionTool,
    InputItem,
    InputMessage,
    ResponsesRequest,
    TextPart,
    UnsupportedPart,
)

#: The ``include`` value that asks for the output text's logprobs.
LOGPROBS = "message.output_text.logprobs"
_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])


def refuse(req: ResponsesRequest) -> None:
    """Raise a 400 naming the first field whose value this server cannot honour."""
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise InvalidRequestError(f"text.verbosity {req.text.verbosity!r} is not supported (only 'medium')",
                                  param="text.verbosity")
    if req.reasoning is not None and req.reasoning.effort not in (None, "none"):
        raise InvalidRequestError(f"reasoning.effort {req.reasoning.effort!r} is not supported: this model does "
                                  "not reason (only 'none')", param="reasoning.effort")
    if req.truncation == "auto":
        raise InvalidRequestError("truncation 'auto' is not supported (only 'disabled': an input over the context "
                                  "is an error)", param="truncation")
    if req.background:
        raise InvalidRequestError("background responses are not supported", param="background")
    if req.min_p:
        raise InvalidRequestError(f"min_p={req.min_p} is not supported by this server (only 0)", param="min_p")
    if req.repetition_penalty not in (None, 1):
        raise InvalidRequestError(f"repetition_penalty={req.repetition_penalty} is not supported by this server "
                                  "(only 1)", param="repetition_penalty")
    for i, tool in enumerate(req.tools or []):
        if not isinstance(tool, FunctionTool):
            raise InvalidRequestError(f"tools of type {tool.type!r} are not supported (only 'function')",
                                      param=f"tools[{i}].type")


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """``input`` as chat messages."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    return _item_messages(req.input)


def check_call_ids(req: ResponsesRequest, earlier: list[dict[str, Any]]) -> None:
    """Refuse a ``function_call_output`` whose ``call_id`` answers no ``function_call`` of the conversation (the
    input's items, or the calls of the ``earlier`` conversation it continues), with OpenAI's message; and an input
    item whose ``call_id`` repeats a ``function_call``'s, or a ``function_call_output``'s, of the conversation before
    it (each call has one id and one output: a repeat would pair an output with the wrong call)."""
    if isinstance(req.input, str):
        return
    called = {call["id"] for message in earlier for call in message.get("tool_calls") or ()}
    answered = {message["tool_call_id"] for message in earlier if message["role"] == "tool"}
    calls = called | {item.call_id for item in req.input if isinstance(item, FunctionCallItem)}
    for i, item in enumerate(req.input):
        if isinstance(item, FunctionCallOutputItem) and item.call_id not in calls:
            raise InvalidRequestError(f"No tool call found for function call output with call_id {item.call_id}.",
                                      param=f"input[{i}].call_id")
        if isinstance(item, FunctionCallItem | FunctionCallOutputItem):
            seen = called if isinstance(item, FunctionCallItem) else answered
            if item.call_id in seen:
                raise InvalidRequestError(f"Duplicate {item.type} for call_id {item.call_id}: each function_call "
                                          "has its own call_id and one function_call_output.",
                                          param=f"input[{i}].call_id")
            seen.add(item.call_id)


def output_messages(output: list[BaseModel]) -> list[dict[str, Any]]:
    """An answer's output items as the chat messages it continues as: those the same items sent back as ``input``
    make, so ``previous_response_id`` and the whole conversation sent as items give one prompt."""
    return _item_messages(_ITEMS.validate_python([item.model_dump() for item in output]))


def _item_messages(items: list[Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        at = f"input[{i}]"
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": _content(item.content, f"{at}.content")})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _content(item.output, f"{at}.output")})
        else:
            raise InvalidRequestError(f"input items of type {item.type!r} are not supported (only message, "
                                      "function_call and function_call_output)", param=f"{at}.type")
    return messages


def _content(content: str | list[Any], at: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, UnsupportedPart) or not isinstance(part, TextPart):
            raise InvalidRequestError(f"content parts of type {part.type!r} are not supported by this text-only "
                                      "model (only input_text and output_text)", param=f"{at}[{j}].type")
        parts.append({"type": "text", "text": part.text})
    return parts


def response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``: ``json_schema``'s flat fields (``name``, ``schema``,
    ``strict``, ``description``) nested under ``json_schema``, as chat carries them (None: plain text)."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    fields = {k: v for k, v in (fmt.model_extra or {}).items() if k in ("name", "schema", "strict", "description")}
    return {"type": "json_schema", "json_schema": fields}


def chat_tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    """The function tools in chat's nested shape."""
    if not req.tools:
        return None
    return [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in req.tools if isinstance(tool, FunctionTool)]


def wants_logprobs(req: ResponsesRequest) -> bool:
    """Whether ``include`` asks for the output text's logprobs (chat's ``logprobs``; ``top_logprobs`` as chat's)."""
    return LOGPROBS in (req.include or [])


def chat_request(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request of ``req`` after the stored ``conversation`` (instructions first, then it, then the input)."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions is not None else []) \
        + conversation
    choice = req.tool_choice
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p,
        "top_k": req.top_k if req.top_k is not None and req.top_k > 0 else None, "tools": chat_tools(req),
        "tool_choice": {"type": "function", "function": {"name": choice.name}}
        if isinstance(choice, FunctionChoice) else choice,
        "parallel_tool_calls": req.parallel_tool_calls, "response_format": response_format(req),
        "prompt_cache_key": req.prompt_cache_key, "logprobs": wants_logprobs(req) or None,
        "top_logprobs": req.top_logprobs, "prompt_cache_retention": req.prompt_cache_retention, "cache_salt": req.cache_salt, "user": req.user,
        "prompt_cache_options": None if req.prompt_cache_options is None
        else req.prompt_cache_options.model_dump(exclude_none=True)}
    if not messages:
        raise InvalidRequestError("the input is empty", param="input")
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:  # the Responses schema admits only what chat's does; never a 500 if not
        raise InvalidRequestError(f"the input does not make a valid conversation: {exc.errors()[0]['msg']}",
                                  param="input") from exc


_TOOL_FIELD = re.compile(r"^tools\[(\d+)\]\.function")


def param_of(param: str | None) -> str | None:
    """A chat request's parameter path, as the Responses request names it."""
    if param is None:
        return None
    if param.startswith("messages"):
        return "input"
    if param in ("max_tokens", "max_completion_tokens"):
        return "max_output_tokens"
    if param == "logprobs":
        return "include"
    if param == "response_format" or param.startswith("response_format."):
        return "text.format" + param[len("response_format"):].replace(".json_schema", "", 1)
    return _TOOL_FIELD.sub(r"tools[\1]", param)
