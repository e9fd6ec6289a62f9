"""Request and response schemas of OpenAI's Responses API, as the official ``openai`` client sends and reads them.

Requests refuse unknown top-level fields (OpenAI answers them with a 400). Input items and
content parts are unions tagged by ``type`` (a message may omit it); the kinds a text-only
model cannot serve (images, files, reasoning items, hosted tools...) parse as an
``Unsupported*`` form, so the refusal names them (``responses/translate.py``). Fields that
would change the answer unless honoured are declared with the values that change nothing
here, and refused otherwise (``translate.refuse``).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from ..protocol import FunctionDefinition, PromptCacheOptions, Text

_REQUEST = ConfigDict(extra="forbid", allow_inf_nan=False)
#: Echoed items (an earlier answer's output sent back) carry ids, statuses and annotations: ignored.
_ITEM = ConfigDict(extra="ignore", allow_inf_nan=False)


def _kind(known: frozenset[str], default: str | None) -> Any:
    """The tag of a union member: ``:`` and its ``type`` (``default`` when absent), or ``:unsupported`` for any
    other type. Not an identifier, so an error's ``param`` leaves it out (``errors._param``)."""

    def tag(value: Any) -> str:
        kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", default)
        return f":{kind}" if kind in known else ":unsupported"

    return Discriminator(tag)


# -- request: input ------------------------------------------------------------------
class TextPart(BaseModel):
    """``input_text``, or ``output_text`` of an earlier answer sent back (its annotations ignored)."""

    model_config = _ITEM
    type: Literal["input_text", "output_text"]
    text: Text


class UnsupportedPart(BaseModel):
    """Parsed so the refusal names it: images, files, audio, refusals."""

    model_config = ConfigDict(extra="allow")
    type: Text


_PART_TYPES = frozenset({"input_text", "output_text"})
ContentPart = Annotated[Annotated[TextPart, Tag(":input_text")] | Annotated[TextPart, Tag(":output_text")]
                        | Annotated[UnsupportedPart, Tag(":unsupported")], _kind(_PART_TYPES, None)]


class InputMessage(BaseModel):
    model_config = _ITEM
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[ContentPart]


class FunctionCallItem(BaseModel):
    """A call the model made, sent back before its output."""

    model_config = _ITEM
    type: Literal["function_call"]
    call_id: Text = Field(min_length=1)
    name: Text = Field(min_length=1)
    arguments: Text


class FunctionCallOutputItem(BaseModel):
    model_config = _ITEM
    type: Literal["function_call_output"]
    call_id: Text = Field(min_length=1)
    output: Text | list[ContentPart]


class UnsupportedItem(BaseModel):
    """Parsed so the refusal names it: reasoning items, item references, hosted tools' calls..."""

    model_config = ConfigDict(extra="allow")
    type: Text


_ITEM_TYPES = frozenset({"message", "function_call", "function_call_output"})
InputItem = Annotated[Annotated[InputMessage, Tag(":message")] | Annotated[FunctionCallItem, Tag(":function_call")]
                      | Annotated[FunctionCallOutputItem, Tag(":function_call_output")]
                      | Annotated[UnsupportedItem, Tag(":unsupported")], _kind(_ITEM_TYPES, "message")]


# -- request: tools and options ------------------------------------------------------
class FunctionTool(FunctionDefinition):
    """A function, in the Responses API's flat shape (chat's definition beside its ``type``)."""

    type: Literal["function"]


class UnsupportedTool(BaseModel):
    """Hosted tools (web_search, file_search, ...), custom and MCP tools: parsed so the refusal names them."""

    model_config = ConfigDict(extra="allow")
    type: Text


ResponseTool = Annotated[Annotated[FunctionTool, Tag(":function")] | Annotated[UnsupportedTool, Tag(":unsupported")],
                         _kind(frozenset({"function"}), None)]


class FunctionChoice(BaseModel):
    """Force a call to this function."""

    model_config = _REQUEST
    type: Literal["function"]
    name: Text


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]


class TextConfig(BaseModel):
    model_config = _REQUEST
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="Only medium (the model's own).")


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None, description="Only none (or unset): the model does not reason.")


class StreamOptions(BaseModel):
    model_config = _REQUEST
    include_obfuscation: bool | None = Field(None, description="Accepted, no effect (no padding is added).")


Includable = Literal["file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                     "message.input_image.image_url", "computer_call_output.output.image_url",
                     "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs"]


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, json_schema_extra={"examples": [{
        "model": "default", "max_output_tokens": 16, "instructions": "You are brief.", "input": "Hello",
        "prompt_cache_key": "support", "stream": True}, {
        "model": "default", "max_output_tokens": 8, "store": False,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}]}]})
    model: Text = Field(description="The served model name (see /v1/models).")
    input: Text | Annotated[list[InputItem], Field(min_length=1)] = Field(
        description="A user message as text, or a list of items: messages, function_call and "
        "function_call_output items.")
    instructions: Text | None = Field(None, description="A system message put first (not carried over by "
                                      "previous_response_id).")
    previous_response_id: Text | None = Field(None, max_length=256, description="Continue after this stored "
                                              "response of the same API key: its input and output come first.")
    store: bool | None = Field(None, description="Keep this response (its conversation) for previous_response_id "
                               "and GET, in memory, bounded. Unset: true.")
    tools: list[ResponseTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = Field(
        None, description="'none' hides the tools from the model; 'required' or a named function: an answer "
        "without that call is an error (422 tool_call_missing).")
    parallel_tool_calls: bool | None = Field(None, description="false: calls after the first are dropped.")
    max_output_tokens: int | None = Field(None, ge=1, description="Most tokens to generate; reached, the "
                                          "response is incomplete.")
    temperature: float | None = Field(None, ge=0, le=2, description="0 = greedy. Unset: the server default.")
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[Includable] | None = Field(None, description="message.output_text.logprobs: the output text's "
                                             "logprobs (output_text.logprobs, and each text delta's; not with "
                                             "tools the model may call). The others concern items this server "
                                             "never makes: no effect.")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="The likeliest tokens reported at each "
                                     "position, with include message.output_text.logprobs.")
    truncation: Literal["auto", "disabled"] | None = Field(None, description="Only disabled: an input over the "
                                                           "context is a 400.")
    background: bool | None = Field(None, description="Only false.")
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = Field(
        None, description="Accepted, no effect (the answer reports default).")
    max_tool_calls: int | None = Field(None, ge=1, description="Accepted, no effect (it bounds hosted tools' "
                                       "calls; there are none).")
    metadata: Annotated[dict[Annotated[Text, Field(max_length=64)], Annotated[Text, Field(max_length=512)]],
                        Field(max_length=16)] | None = Field(None, description="Echoed and stored, no effect.")
    user: Text | None = Field(None, description="End-user id, for the caller's records. Never selects a tenant "
                              "or cache namespace: that comes from the API key.")
    safety_identifier: Text | None = Field(None, max_length=128, description="Accepted, echoed, no effect.")
    prompt_cache_key: Text | None = Field(None, max_length=256, description="A hint grouping requests that share "
                                          "prefixes, counted in metrics (as chat's).")
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(
        None, description="How long this request's prefix is kept when idle (as chat's).")
    prompt_cache_options: PromptCacheOptions | None = Field(None, description="OpenAI's cache breakpoints (as "
                                                            "chat's).")
    cache_salt: Text | None = Field(None, max_length=256, description="vLLM's extension, as chat's: splits the "
                                    "API key's cache namespace.")
    # SGLang's sampling fields, which sglang-router adds to every Responses body it forwards (top_k -1, min_p 0,
    # repetition_penalty 1, priority 0): accepted where they change nothing here, refused otherwise (``refuse``).
    top_k: int | None = Field(None, ge=-1, description="SGLang extension: keep the k likeliest tokens, as chat's "
                              "top_k; -1 or 0: all of them.")
    min_p: float | None = Field(None, ge=0, le=1, description="SGLang extension: only 0.")
    repetition_penalty: float | None = Field(None, gt=0, le=2, description="SGLang extension: only 1.")
    priority: int | None = Field(None, description="SGLang extension (a scheduling priority): accepted, no effect "
                                 "(requests are served in their key's fair order).")


# -- response ------------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: Literal["in_progress", "completed", "incomplete"]
    call_id: str
    name: str
    arguments: str = Field(description="The arguments, a JSON object as text.")


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Input tokens whose KV came from the prefix cache.")
    cache_write_tokens: int = Field(0, description="Input tokens this request wrote to the cache (as chat's).")


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseErrorInfo(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    instructions: str | None = None
    output: list[Annotated[OutputMessage | OutputFunctionCall, Field(discriminator="type")]]
    usage: ResponseUsage | None = None
    parallel_tool_calls: bool
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    previous_response_id: str | None = None
    store: bool
    metadata: dict[str, str] = Field(default_factory=dict)
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    user: str | None = None
    service_tier: str = "default"
    background: bool = False
    truncation: Literal["disabled"] = "disabled"
    top_logprobs: int = 0
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}, "verbosity": "medium"})
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True
