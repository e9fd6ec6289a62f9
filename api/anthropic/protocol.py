"""Request and response schemas of Anthropic's Messages API, as the official SDK sends and reads them.

Requests refuse unknown top-level fields (Anthropic answers them with a 400). Content
blocks are a union tagged by ``type``: text, tool_use and tool_result are served; image
and document blocks parse, so the refusal names them (``serving/messages.py``).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from ..protocol import BlendSwitch, CacheDiagnostics, DiagnosticsRequest, JSONObject, Text

_REQUEST = ConfigDict(extra="forbid", allow_inf_nan=False)


class CacheControl(BaseModel):
    model_config = _REQUEST
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = Field(None, description="How long the prefix up to this block is kept, "
                                            "refreshed on use. Unset: 5m.")


class _Block(BaseModel):
    model_config = _REQUEST
    cache_control: CacheControl | None = Field(None, description="A cache breakpoint: keep the prefix up to "
                                               "and including this block.")


class TextBlock(_Block):
    type: Literal["text"]
    text: Text
    prefixcache_chunk: StrictBool | None = Field(None, description="Extension: true marks this block a reusable chunk "
                                           "(a retrieved document): its KV is kept on its own and reused wherever "
                                           "it appears in a later prompt of this API key, a share of its tokens "
                                           "recomputed (usage.chunk_*_input_tokens).")
    citations: list[JSONObject] | None = Field(None, description="Accepted and ignored (echoed responses).")


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: Text = Field(min_length=1)
    name: Text = Field(min_length=1)
    input: JSONObject


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: Text = Field(min_length=1)
    content: Text | list[TextBlock] | None = None
    is_error: bool | None = None


class UnsupportedBlock(_Block):
    """Parsed so the answer can say what is not supported (a text-only model has no use for them)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image", "document", "search_result", "thinking", "redacted_thinking", "server_tool_use",
                  "web_search_tool_result", "container_upload"]


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | UnsupportedBlock, Field(discriminator="type")]


class InputMessage(BaseModel):
    model_config = _REQUEST
    role: Literal["user", "assistant"]
    content: Text | list[ContentBlock]


class ToolDefinition(BaseModel):
    model_config = _REQUEST
    name: Text = Field(min_length=1, max_length=128, pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: Text | None = None
    input_schema: JSONObject
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = Field(None, description="true: the model's calls are validated against input_schema; "
                                "one that does not match is an error (500 api_error), never an answer.")


class ToolChoice(BaseModel):
    """auto; any (a call is required); tool (a call to ``name`` is required); none (the tools are hidden).
    A required call the model does not make is an error (422), never a text answer."""

    model_config = _REQUEST
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: bool | None = Field(None, description="true: calls after the first are dropped.")


class Metadata(BaseModel):
    model_config = _REQUEST
    user_id: Text | None = Field(None, max_length=256, description="The caller's end-user id, for its records. "
                                 "Never selects a tenant or cache namespace: that comes from the API key.")


class OutputFormat(BaseModel):
    model_config = _REQUEST
    type: Literal["json_schema"]
    schema_: JSONObject = Field(alias="schema", description="The answer's JSON schema, under Anthropic's rules for "
                                "it: every object with additionalProperties false; no numeric or length bounds, "
                                "maxItems, uniqueItems or minItems past 1; no recursion.")


class OutputConfig(BaseModel):
    model_config = _REQUEST
    format: OutputFormat | None = Field(None, description="The answer's text is JSON matching this schema "
                                        "(constrained decoding). Not with a prefilled final assistant message or "
                                        "a forced tool call.")
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = Field(
        None, description="Only high (the default, the same as unset): this model does not reason.")


class _Prompt(BaseModel):
    """What Messages and token counting share: the model and the prompt."""

    model_config = _REQUEST
    model: Text = Field(description="The served model name (see /v1/models).")
    messages: list[InputMessage] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: CacheControl | None = Field(None, description="Automatic caching: a cache_control marker on "
                                               "the last cacheable block (the last block of the last message), "
                                               "one of the 4 breakpoints. A block with its own marker keeps it.")
    output_config: OutputConfig | None = Field(None, description="format: the answer held to a JSON schema; "
                                               "effort: only high. Token counting checks it too.")
    cache_salt: Text | None = Field(None, max_length=256, description="Extension (vLLM's name): a secret mixed "
                                    "into the cache namespace, so requests of this API key with different salts "
                                    "never share cached prefixes. Unset or empty: the key's namespace. Token "
                                    "counting accepts and ignores it.")

    def prompt(self) -> dict[str, Any]:
        """Keyword arguments of ``PrefixCache.encode_messages``: plain dicts, cache_control kept."""
        dump = self.model_dump(exclude_none=True, include={"messages", "system", "tools", "tool_choice",
                                                           "cache_control"})
        return {"messages": dump["messages"], "system": dump.get("system"), "tools": dump.get("tools"),
                "tool_choice": dump.get("tool_choice"), "cache_control": dump.get("cache_control")}

    def output(self) -> dict[str, Any] | None:
        """``output_config`` as ``PrefixCache.messages`` takes it (``serving/messages.output_format``)."""
        return None if self.output_config is None else self.output_config.model_dump(exclude_none=True, by_alias=True)


class MessagesRequest(_Prompt):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, json_schema_extra={"examples": [{
        "model": "default", "max_tokens": 16, "stream": stream,
        "system": [{"type": "text", "text": "You are brief.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello", "cache_control": {
            "type": "ephemeral"}}]}]} for stream in (False, True)] + [{
        "model": "default", "max_tokens": 8, "stream": True, "cache_control": {"type": "ephemeral", "ttl": "5m"},
        "diagnostics": {"previous_message_id": "msg-unknown"}, "messages": [{"role": "user", "content": "Hi"}]}]})
    max_tokens: int = Field(ge=1, description="Most tokens to generate.")
    stop_sequences: Annotated[list[Annotated[Text, Field(min_length=1)]], Field(max_length=8)] | None = Field(
        None, description="Up to 8 strings; generation stops before the first one (stop_reason stop_sequence).")
    temperature: float | None = Field(None, ge=0, le=1, description="0 = greedy. Unset: the server default.")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool | None = False
    metadata: Metadata | None = None
    diagnostics: DiagnosticsRequest | None = Field(None, description="Cache diagnostics: opt in, and name "
                                                   "previous_message_id to learn why this request could not reuse "
                                                   "all of that one's prompt (diagnostics.cache_miss_reason).")
    prefixcache_blend: BlendSwitch = Field(
        None, description="Extension: false = this request's blocks marked prefixcache_chunk are prefilled like "
        "other text; a number in [0, 1] = the share of their tokens recomputed. Unset or true: the server's share.")


class CountTokensRequest(_Prompt):
    pass


# -- responses ---------------------------------------------------------------------
class CacheCreation(BaseModel):
    ephemeral_5m_input_tokens: int
    ephemeral_1h_input_tokens: int


class Usage(BaseModel):
    input_tokens: int = Field(description="Prompt tokens neither read from the cache nor written at a breakpoint.")
    output_tokens: int
    cache_creation_input_tokens: int = Field(description="Tokens written at this request's breakpoints.")
    cache_read_input_tokens: int = Field(description="Prompt tokens read from the cache.")
    chunk_reused_input_tokens: int = Field(0, description="Extension: tokens of blocks marked prefixcache_chunk "
                                           "whose stored KV was reused at their place in this prompt.")
    chunk_recomputed_input_tokens: int = Field(0, description="Extension: tokens of marked blocks recomputed in "
                                               "context (the recompute share).")
    cache_creation: CacheCreation


class ResponseText(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ResponseToolUse(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class Message(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[ResponseText | ResponseToolUse]
    model: str
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: Usage
    diagnostics: CacheDiagnostics | None = Field(None, description="Null when the request did not ask, or when "
                                                 "its prompt did not part from the compared one.")


class TokenCount(BaseModel):
    input_tokens: int


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: ErrorDetail
