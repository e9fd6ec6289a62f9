"""Request and response schemas of the proxy (OpenAI's shapes, plus the cache admin routes).

Requests forbid unknown fields: OpenAI answers an unrecognized argument with a 400,
and a sampling option we silently dropped would change answers without a word. Every
OpenAI sampling parameter is declared; the ones the proxy cannot honour are refused
with a 400, by the schema itself where it can say so (``n`` is at most 1) and
otherwise in ``jobs.py``. Chat messages ignore extra keys (clients echo back
``annotations``…), and the canonicalizer drops them anyway; an assistant message's
``function_call``, ``audio`` and ``refusal`` are declared, so ``jobs.py`` refuses them
rather than drop part of the conversation (a null ``refusal``, as echoed, is fine).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, model_validator
from pydantic.json_schema import SkipJsonSchema


def _valid_unicode(value: Any) -> Any:
    """Reject lone surrogates anywhere in a value: JSON allows them, tokenizers crash on them."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError("text must be valid Unicode (a lone surrogate escape was sent)") from exc
    elif isinstance(value, dict):
        for k, v in value.items():
            _valid_unicode(k)
            _valid_unicode(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _valid_unicode(v)
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]
JSONObject = Annotated[dict[str, Any], AfterValidator(_valid_unicode)]
_REQUEST = ConfigDict(extra="forbid", allow_inf_nan=False)


# -- requests ----------------------------------------------------------------------
class PromptCacheBreakpoint(BaseModel):
    model_config = _REQUEST
    mode: Literal["explicit"]
    ttl: Literal["30m", "12h"] | None = Field(None, description="Least lifetime of this breakpoint. Unset: the "
                                              "request's prompt_cache_options.ttl.")


class ContentPart(BaseModel):
    """Only text parts: a text-only model has nothing to do with images, audio or files."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: Text
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = Field(
        None, description="Marks the end of a reusable prefix: up to 4 are written per request (3 beside the "
        "implicit one in implicit mode), the latest ones.")
    prefixcache_chunk: StrictBool | None = Field(None, description="Extension: true marks this part a reusable chunk (a retrieved document): its KV is kept on its "
        "own and reused wherever it appears in a later prompt of this API key, a share of its tokens "
        "recomputed (usage.prompt_tokens_details.chunk_*). Other servers ignore or refuse it.")


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    content: Text | list[ContentPart]
    name: Text | None = None


class SystemMessage(_Message):
    role: Literal["system"]


class DeveloperMessage(_Message):
    role: Literal["developer"]


class UserMessage(_Message):
    role: Literal["user"]


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: Text | list[ContentPart] | None = None  # null beside tool_calls
    tool_calls: list[JSONObject] | None = None
    # Earlier turns this server cannot render: declared so they are refused (``jobs``), not dropped.
    function_call: SkipJsonSchema[JSONObject | None] = None
    audio: SkipJsonSchema[JSONObject | None] = None
    refusal: SkipJsonSchema[Text | None] = None  # null as echoed back from this server's answers


class ToolMessage(_Message):
    role: Literal["tool"]
    tool_call_id: Text


MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
ChatMessage = Annotated[SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage,
                        Field(discriminator="role")]


class FunctionDefinition(BaseModel):
    model_config = _REQUEST
    name: Text = Field(min_length=1, max_length=64)
    description: Text | None = None
    parameters: JSONObject | None = None
    strict: bool | None = Field(None, description="true: the model's calls are validated against parameters, "
                                "which must set additionalProperties false and require every property on each "
                                "object (else 400); a call that does not match is an error (500 "
                                "tool_arguments_invalid), never an answer.")


class Tool(BaseModel):
    model_config = _REQUEST
    type: Literal["function"]
    function: FunctionDefinition


class DiagnosticsRequest(BaseModel):
    """Cache diagnostics (Anthropic's ``diagnostics``): the request opts in; its fingerprint is kept under its
    response id."""

    model_config = _REQUEST
    previous_message_id: Text | None = Field(None, max_length=256, description="The id of this API key's "
                                             "earlier response to compare with (null: opt in, nothing to compare).")


class NamedFunction(BaseModel):
    model_config = _REQUEST
    name: Text


class NamedToolChoice(BaseModel):
    """Force a call to this tool."""

    model_config = _REQUEST
    type: Literal["function"]
    function: NamedFunction


class PromptCacheOptions(BaseModel):
    model_config = _REQUEST
    mode: Literal["implicit", "explicit"] | None = Field(None, description="implicit (unset): one implicit "
                                                         "breakpoint at the end of the newest non-assistant "
                                                         "message and the latest 3 marked ones are written; "
                                                         "explicit: only the latest 4 marked ones.")
    ttl: Literal["30m", "12h"] | None = Field(None, description="Least lifetime of the breakpoints written. "
                                              "Unset: 30m.")


class StreamOptions(BaseModel):
    model_config = _REQUEST
    include_usage: bool | None = Field(None, description="Send a last chunk with usage (choices empty).")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]


class GenerationFields(BaseModel):
    """Parameters chat and text completions share."""

    model_config = _REQUEST
    model: Text = Field(description="The served model name (see /v1/models).")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float | None = Field(None, ge=0, le=2, description="0 = greedy. Unset: the server default.")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, description="Extension (as in vLLM): keep the k likeliest tokens.")
    n: int | None = Field(None, ge=1, description="Choices for the prompt, each a separate generation (at most "
                          "the server's max_n); the prompt is prefilled once and every choice reads it from the "
                          "cache.")
    stop: Text | Annotated[list[Text], Field(max_length=4)] | None = Field(
        None, description="Up to 4 strings; the text ends before the first one generated.")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, description="Token id (as a string) -> bias added to its logit.")
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1, description="Same seed, same sample.")
    ignore_eos: bool | None = Field(None, description="Extension (as in vLLM): go on past the end-of-sequence "
                                    "token until max_tokens (benchmarks).")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Text | None = Field(None, description="End-user id, for the caller's records. Never selects a "
                              "tenant or cache namespace: that comes from the API key.")
    # SGLang's fields, which sglang-router adds to every body it forwards: accepted with the
    # values that match what this server does, refused (400) otherwise (see ``jobs``).
    no_stop_trim: bool | None = Field(None, description="SGLang extension: only false (the stop string is "
                                      "trimmed from the answer).")
    skip_special_tokens: bool | None = Field(None, description="SGLang extension: only true (special tokens "
                                             "are left out of the text).")
    return_hidden_states: bool | None = Field(None, description="SGLang extension: only false.")
    prompt_cache_key: Text | None = Field(None, max_length=256, description="A hint grouping requests that share "
                                          "prefixes, counted in metrics. Matching stays inside the API key's "
                                          "tenant and finds every shared prefix there with or without it; the key "
                                          "never reaches another tenant's entries.")
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(
        None, description="Deprecated by OpenAI for prompt_cache_options.ttl, still honoured: how long this "
        "request's prefix is kept when idle: in_memory = the server's TTL, 24h = 24 hours (in the lowest "
        "persistent tier where tiers are configured).")
    prompt_cache_options: PromptCacheOptions | None = Field(
        None, description="OpenAI's cache breakpoints: which prefixes this request writes and for how long "
        "(prompt_tokens_details.cache_write_tokens counts them).")
    cache_salt: Text | None = Field(None, max_length=256, description="vLLM's extension: a secret mixed into "
                                    "the cache namespace, so requests of this API key with different salts never "
                                    "share cached prefixes (callers sharing a key cannot learn each other's "
                                    "prompts from cached_tokens or timing). Unset or empty: the key's namespace.")

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> GenerationFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


#: A request's blending switch (extension): false = prefill its marked chunks this time, a number = the share recomputed.
BlendSwitch = StrictBool | Annotated[float, Field(ge=0, le=1, strict=True)] | None
BLEND_DESC = ("Extension: false = this request's parts marked prefixcache_chunk are prefilled like other text; a "
              "number in [0, 1] = the share of their tokens recomputed (1 = a full prefill). Unset or true: the "
              "server's share, if the server blends.")


class ChatCompletionRequest(GenerationFields):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, json_schema_extra={"examples": [{
        "model": "default", "max_tokens": 16, "stream": True, "prompt_cache_key": "support",
        "messages": [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Hello"}]}, {
        "model": "default", "max_tokens": 8, "prompt_cache_options": {"mode": "explicit", "ttl": "30m"},
        "diagnostics": {"previous_message_id": None},
        "messages": [{"role": "system", "content": [{"type": "text", "text": "You are brief.",
                                                     "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"}}]},
                     {"role": "user", "content": "Hello"}]}]})
    messages: list[ChatMessage] = Field(min_length=1)
    prefixcache_blend: BlendSwitch = Field(None, description=BLEND_DESC)
    max_completion_tokens: int | None = Field(None, ge=1, description="Alias of max_tokens.")
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="'none' hides the tools from the model; 'required' or a named tool: an answer without "
        "that call is an error (422 tool_call_missing), never a text answer. The model's calls are parsed in "
        "its chat template's syntax (Hermes/Qwen, Llama 3.1+ JSON, Mistral).")
    parallel_tool_calls: bool | None = Field(None, description="false: calls after the first are dropped.")
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    continue_final_message: bool | None = Field(None, description="SGLang extension: true continues the last "
                                                "message, an assistant turn of text (the answer extends it); "
                                                "false or unset: the answer is a new assistant message.")
    separate_reasoning: bool | None = Field(None, description="SGLang extension: accepted, no effect (no "
                                            "reasoning parser: the whole answer is content).")
    stream_reasoning: bool | None = Field(None, description="SGLang extension: accepted, no effect (as "
                                          "separate_reasoning).")
    diagnostics: DiagnosticsRequest | None = Field(None, description="Extension (Anthropic's cache diagnostics): "
                                                   "previous_message_id names an earlier chat completion id of this "
                                                   "API key; the answer's diagnostics.cache_miss_reason says why this "
                                                   "request could not reuse all of that one's prompt.")


class CompletionRequest(GenerationFields):
    prompt: Text | Annotated[list[Text], Field(min_length=1, max_length=1)] = Field(
        description="One prompt (a string, or a list holding one string).")
    suffix: Text | None = None
    echo: bool | None = Field(None, description="Return the prompt before the completion.")
    best_of: int | None = Field(None, ge=1, le=1, description="Only 1 is supported.")
    logprobs: int | None = Field(None, ge=0, le=5)


class PrewarmRequest(BaseModel):
    """Prefill and keep a prefix: chat ``messages`` (without a generation prompt) or a text ``prompt``."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, json_schema_extra={
        "oneOf": [{"required": ["messages"]}, {"required": ["prompt"]}]})
    model: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | SkipJsonSchema[None] = None
    prompt: Text | SkipJsonSchema[None] = None
    tools: list[Tool] | None = None
    pin: bool = Field(False, description="Keep it until flushed or its TTL ends. The admin key's pin has no TTL "
                      "unless given; a tenant key's lapses after pin_ttl_seconds without a read, its prefix kept "
                      "with at most that TTL.")
    ttl_seconds: float | None = Field(None, gt=0, description="Idle expiry of this prefix. Unset: the server's.")
    cache_salt: Text | None = Field(None, max_length=256, description="Warm the prefix under this salt: only "
                                    "requests with the same cache_salt read it.")

    @model_validator(mode="after")
    def _one_source(self) -> PrewarmRequest:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of messages or prompt")
        return self


# -- responses ---------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens whose KV came from the prefix cache.")
    cache_write_tokens: int = Field(0, description="Prompt tokens this request wrote to the cache: after the "
                                    "read ones up to its last breakpoint kept (prompt_cache_options or "
                                    "prompt_cache_breakpoint), else those it stored.")
    chunk_reused_tokens: int = Field(0, description="Extension: tokens of parts marked prefixcache_chunk whose "
                                     "stored KV was reused at their place in this prompt (not in cached_tokens).")
    chunk_recomputed_tokens: int = Field(0, description="Extension: tokens of marked parts recomputed in context "
                                         "(the recompute share) instead of reused.")


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CacheMissChanged(BaseModel):
    """The prompt parted from the compared request's at the model (or cache namespace), tools, system or an
    earlier message."""

    type: Literal["model_changed", "tools_changed", "system_changed", "messages_changed"]
    cache_missed_input_tokens: int = Field(description="About how many of the compared request's prompt tokens "
                                           "would have been read from the cache had the prefix matched.")


class CacheMissUndiagnosed(BaseModel):
    """No comparison: the compared id is unknown to this key (or expired), or another prompt-affecting
    parameter (tool_choice) differs."""

    type: Literal["previous_message_not_found", "unavailable"]


class CacheDiagnostics(BaseModel):
    cache_miss_reason: Annotated[CacheMissChanged | CacheMissUndiagnosed, Field(discriminator="type")] | None = None

    @classmethod
    def of(cls, reason: str | None, missed: int | None) -> CacheDiagnostics | None:
        """A call's diagnosis from its stats (``CallStats.miss_reason``); None when there is no divergence."""
        if reason is None:
            return None
        if missed is None:
            return cls(cache_miss_reason=CacheMissUndiagnosed(type=reason))
        return cls(cache_miss_reason=CacheMissChanged(type=reason, cache_missed_input_tokens=missed))


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="The arguments, a JSON object as text.")


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="The text (null when the answer is tool calls alone).")
    refusal: None = None
    tool_calls: list[ResponseToolCall] | None = None


class TopLogprob(BaseModel):
    token: str = Field(description="The token's own text (part of a character reads as U+FFFD).")
    logprob: float = Field(description="Its log-probability under the model's own distribution (raw logits: "
                           "before temperature, penalties, logit_bias, top-k/top-p and response_format); "
                           "-9999.0 for a probability of zero.")
    bytes: list[int] | None = Field(description="The UTF-8 bytes of token.")


class TokenLogprobInfo(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(description="The top_logprobs likeliest tokens at this position, "
                                           "likeliest first.")


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobInfo] | None = Field(description="One per answer token (special tokens, whose text "
                                                   "the answer leaves out, left out).")
    refusal: None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] = Field(description="Per position: the logprobs likeliest tokens and the "
                                                 "chosen one (up to logprobs + 1, as OpenAI's).")
    text_offset: list[int]


class ChatChoice(BaseModel):
    index: int
    logprobs: ChoiceLogprobs | None = Field(None, description="Set when the request asked (logprobs true).")
    finish_reason: Literal["stop", "length", "tool_calls"]
    message: ResponseMessage


class CompletionChoice(BaseModel):
    index: int
    logprobs: CompletionLogprobs | None = Field(None, description="Set when the request asked (logprobs set).")
    finish_reason: Literal["stop", "length"]
    text: str


class _Answer(BaseModel):
    """What chat and text completions both return around their choices."""

    id: str
    created: int
    model: str
    system_fingerprint: str
    usage: UsageInfo


class ChatCompletion(_Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    diagnostics: CacheDiagnostics | None = Field(None, description="Extension: cache diagnostics, when the "
                                                 "request asked and its prompt parted from the compared one.")


class Completion(_Answer):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "prefixcache"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class PrewarmResponse(BaseModel):
    object: Literal["cache.prewarm"] = "cache.prewarm"
    tenant: str
    prompt_tokens: int
    cached_tokens: int = Field(description="Tokens that were already cached before this call.")
    stored_tokens: int
    pinned: bool


class FlushResponse(BaseModel):
    object: Literal["cache.flush"] = "cache.flush"
    tenant: str | None = Field(description="The tenant flushed; null = every tenant (admin).")
    freed_bytes: int


class QueueInfo(BaseModel):
    running: int
    waiting: int
    capacity: int


class RestoreSeconds(BaseModel):
    buckets: dict[str, int]  # cumulative counts by upper bound ("+Inf" last)
    sum: float
    count: int


class TierInfo(BaseModel):
    """One lower tier (host, disk or redis): what it holds and what it did since start."""

    bytes: int
    budget_bytes: int
    entries: int
    degraded: int  # 1 while unreachable (Redis) or full (disk)
    queued_bytes: int = 0  # blocks queued for the tiers below, not yet written (the writer's backlog, shared)
    hits: int
    misses: int
    restores: int
    restored_bytes: int
    write_backs: int
    failed_writes: int
    corrupt_entries: int
    restore_seconds: RestoreSeconds


class CacheStats(BaseModel):
    """Hit counters of one tenant (or all, for admin) and memory figures.

    The hit counters count every generation the engine ran, those cut short (a timeout, a
    client gone, shutdown) included, as /metrics' ``prefixcache_hit_ratio`` does; its request
    counters hold answers delivered.

    Entries, pinned bytes and evictions are the caller's own; other tenants' bytes and the
    queue are shown to admin only: for a tenant they would reveal other tenants' traffic.
    """

    object: Literal["cache.stats"] = "cache.stats"
    tenant: str | None
    queries: int
    hits: int
    partial_hits: int
    misses: int
    bypassed: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    hit_rate: float
    token_hit_rate: float
    bytes: int
    budget_bytes: int
    tenant_quota_bytes: int | None
    entries: int | None = None
    pinned_bytes: int | None = None
    tenant_bytes: dict[str, int] | None = None
    evictions: dict[str, int] | None = None
    reclaimed_bytes: dict[str, int] | None = None
    #: Cache breakpoints (Anthropic's cache_control) by TTL: reads, writes, short, dropped, read/write tokens.
    breakpoints: dict[str, dict[str, int]] | None = None
    queue: QueueInfo | None = None
    #: Admin: whether the batching engine serves the model, and why not.
    batching_enabled: bool | None = None
    batching_disabled_reason: str | None = None
    #: Admin, all tenants: all KV memory by kind (stored, private, serial, prewarm) and its bound.
    kv_bytes: dict[str, int] | None = None
    kv_total_bytes: int | None = None
    #: Admin with ``audit=true`` (walks the store): bytes of live snapshot tensors and refcounts held;
    #: at idle ``live_tensor_bytes == bytes`` and ``refcounts == 0``.
    live_tensor_bytes: int | None = None
    refcounts: int | None = None
    #: Admin: the lower tiers by name (host, disk, redis), when any is configured.
    tiers: dict[str, TierInfo] | None = None
    #: Admin: why the batching engine counts as faulting (its recent steps all failed), while it does.
    engine_faulting: str | None = None


class Health(BaseModel):
    status: str
    #: /readyz: whether the batching engine serves, and why not.
    batching: bool | None = None
    detail: str | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
