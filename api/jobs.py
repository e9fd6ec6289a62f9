"""OpenAI request -> one ``Job`` for the engine: every sampling parameter honoured or refused.

Honoured: max_tokens / max_completion_tokens, temperature, top_p, top_k and ignore_eos
(extensions, as in vLLM), stop, seed, presence_penalty, frequency_penalty, logit_bias, echo, tools (rendered by
the chat template; the model's calls parsed in its template's syntax, ``tool_calls.py``), tool_choice
"none" (tools hidden), "auto", "required" and a named tool (an answer without the call is an error),
parallel_tool_calls; prompt_cache_options and prompt_cache_breakpoint (``serving/prompt_cache.py``),
prompt_cache_retention, and the diagnostics extension.
Strict functions: their calls are validated against their schemas (``tool_schemas.py``); a forced call
("required" or a named function) to strict functions only is constrained to them as well
(``structured.tool_call_grammar``). response_format
json_object / json_schema: the answer constrained to the schema (``structured.py``; a schema it cannot
compile, or a strict one against OpenAI's rules, is a 400; not with continue_final_message, ignore_eos or a
forced tool call).
n (choices): up to the server's ``max_n``, each choice a job of its own (``choices``).
logprobs and top_logprobs (chat), logprobs (completions: the alternatives per token, not with echo).
Refused with a 400 naming the parameter, here: suffix, completions' logprobs with echo, an earlier assistant message's function_call, audio
or refusal text, max_tokens over the server's limit, SGLang's extensions (which
sglang-router adds to every chat body) with a value other than what this server does
(``no_stop_trim``, ``skip_special_tokens``, ``return_hidden_states``); by the schema (``protocol``):
best_of > 1, token-id or multi-prompt completions, non-text content parts.
"""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

import xxhash

from prefixcache.errors import ContextLengthExceededError, InvalidRequestError
from prefixcache.serving.breakpoints import RETENTION_SECONDS
from prefixcache.serving.options import AnswerOptions
from prefixcache.serving.request import CallStats
from prefixcache.serving.sampling import GREEDY_BELOW
from prefixcache.serving.structured import ToolCallGrammar, tool_call_grammar
from prefixcache.serving.tool_calls import ToolUse, openai_tool_use

from .protocol import ChatCompletionRequest, CompletionRequest, GenerationFields, NamedToolChoice
from .settings import Settings


@dataclass(slots=True)
class Job:
    """One generation as the engine sees it. Built from a request; read by ``serving``."""

    endpoint: Literal["chat", "completions", "messages"]
    tenant: str
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    prompt: str | None = None
    #: ``messages``: the Anthropic-shaped prompt (``PrefixCache.encode_messages`` keyword arguments).
    anthropic: dict[str, Any] | None = None
    cache_key: str | None = None  # OpenAI's prompt_cache_key, counted in metrics
    retention: str | None = None  # OpenAI's prompt_cache_retention, counted in metrics
    cache_salt: str | None = None  # vLLM's cache_salt: splits the tenant's namespace (None or "": not split)
    #: Cache diagnostics: asked for, the id compared with, this job's own id (its response's, set by
    #: ``routes.respond``) and a chat's ``tool_choice`` (a prompt-affecting parameter).
    diagnose: bool = False
    previous_id: str | None = None
    record_id: str | None = None
    tool_choice: str | None = None
    #: OpenAI's cache breakpoints: written under OpenAI's rules when asked for (``prompt_cache_options`` or a
    #: ``prompt_cache_breakpoint``); the options' mode and ttl.
    breakpoints: bool = False
    cache_mode: str | None = None
    cache_ttl: str | None = None
    max_tokens: int | None = None  # None: the default, capped to what fits (see ``max_new_tokens``)
    echo: bool = False
    #: Sampling and stops, checked; the worker sets the length, callbacks and timeout (``Serving``).
    options: AnswerOptions = field(default_factory=AnswerOptions)
    ttl_seconds: float | None = None  # None: the cache's default TTL
    tool_use: ToolUse | None = None  # how the answer's tool calls are read (None: the answer is text)
    continue_final: bool = False  # a chat whose answer continues its last (assistant) message
    api: str | None = None  # the API a chat job was asked through, if not chat's ("responses"): metrics' endpoint
    #: A request asking for several choices (``n``): this job's choice, and the prompt its choices share.
    choice: int = 0
    shared: SharedPrompt | None = None

    @property
    def label(self) -> str:
        """The ``endpoint`` label of its metrics."""
        return self.api or self.endpoint

    def max_new_tokens(self, prompt_tokens: int, max_context: int, default: int) -> int:
        """The requested ``max_tokens``, or the default capped to the room left in the context.

        Checked here, before a stream starts, so an overlong request is a plain 400
        (the SDK would refuse it too, but only once the response is streaming).
        """
        room = max_context - prompt_tokens
        param = "prompt" if self.endpoint == "completions" else "messages"
        if self.max_tokens is not None and self.max_tokens > room:
            raise ContextLengthExceededError(
                f"prompt ({prompt_tokens} tokens) + max_tokens ({self.max_tokens}) exceeds the model's context of "
                f"{max_context} tokens", param=param)
        if room < 1:
            raise ContextLengthExceededError(
                f"the prompt ({prompt_tokens} tokens) leaves no room in the model's context of {max_context} "
                "tokens", param=param)
        return self.max_tokens if self.max_tokens is not None else min(default, room)


class SharedPrompt:
    """The prompt of a request's choices, prefilled once: the first choice prefills and stores it, then sets
    ``ready``; the others wait for that and read it from the cache (``Serving``). ``read`` is what the cache
    supplied to that prefill and ``written`` what it stored (None: not prefilled ahead; each choice's own
    reading counts)."""

    def __init__(self, choices: int) -> None:
        self.ready = threading.Event()
        self.read: int | None = None
        self.written = 0
        self._choices = choices
        self._lock = threading.Lock()
        self._served: dict[int, CallStats] = {}

    def served(self, choice: int, stats: CallStats) -> list[CallStats] | None:
        """Note ``choice`` served; once every choice is, their stats by index (the request is then counted as
        served, once), else None (a choice cut short leaves the request to its error's count)."""
        with self._lock:
            self._served[choice] = stats
            if len(self._served) < self._choices:
                return None
            return [self._served[i] for i in range(self._choices)]


def choices(job: Job, n: int | None, settings: Settings) -> list[Job]:
    """``job`` as the ``n`` choices of its request (400 over ``max_n``), sharing its prompt; choice i
    samples with ``choice_seed(seed, i)``, and only choice 0 keeps the cache diagnostics."""
    n = n or 1
    if n > settings.max_n:
        raise InvalidRequestError(f"n is {n}; this server allows at most {settings.max_n} choices", param="n")
    if n == 1:
        return [job]
    shared, seed = SharedPrompt(n), job.options.seed
    return [dataclasses.replace(job, choice=i, shared=shared, diagnose=job.diagnose and i == 0,
                                options=dataclasses.replace(job.options, seed=choice_seed(seed, i)))
            for i in range(n)]


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice ``index``'s sampling seed: the request's for choice 0 (one choice samples as without ``n``),
    for the others the 64-bit xxh64 of ``"<seed>/<index>"``, so each is reproducible and they differ.
    No seed: None (each choice draws its own)."""
    if seed is None or index == 0:
        return seed
    return xxhash.xxh64_intdigest(f"{seed}/{index}".encode())


def chat_job(req: ChatCompletionRequest, tenant: str, settings: Settings, vocab_size: int,
             tool_family: str | None = None) -> Job:
    """``tool_family``: the syntax of the model's tool calls (``tool_calls.tokenizer_family``)."""
    _only_defaults(req)
    structured = req.response_format is not None and req.response_format.type != "text"
    if structured and req.continue_final_message:
        raise InvalidRequestError("response_format json_object / json_schema cannot continue a final assistant "
                                  "message (the answer's JSON starts at its first token)", param="response_format")
    if structured and req.ignore_eos:
        raise InvalidRequestError("response_format json_object / json_schema ends the answer at the end of its JSON; "
                                  "ignore_eos cannot be set with it", param="ignore_eos")
    if structured and req.tools and req.tool_choice not in (None, "none", "auto"):
        raise InvalidRequestError("a forced tool call cannot be made with response_format json_object / json_schema "
                                  "(the answer is the JSON)", param="tool_choice")
    if req.logprobs and req.tools and req.tool_choice != "none" and not structured:
        # OpenAI's logprobs are the content's; which tokens are content is known here only once a parser has read
        # the whole answer, so a streamed answer could not attach them to its deltas (a format's JSON is all content)
        raise InvalidRequestError("logprobs are not reported for an answer that may call tools (send tool_choice "
                                  "none, or no tools)", param="logprobs")
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise InvalidRequestError("max_tokens and max_completion_tokens differ; send one", param="max_tokens")
    _renderable(req)
    tools = None
    if req.tools and req.tool_choice != "none":  # "none": the model must not call tools, so it does not see them
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
    messages = [m.model_dump(exclude_none=True) for m in req.messages]  # ``_renderable``: the refused fields are None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    choice = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice
    asked = req.model_dump(include={"tools", "tool_choice"}, exclude_none=True)
    reading = openai_tool_use(tool_family, asked.get("tools"), asked.get("tool_choice"), req.parallel_tool_calls)
    reading = None if structured else reading  # the answer is the format's JSON: no call to read in it
    # A forced call to strict functions is constrained to their schemas (not where it continues a final message).
    forced = None if req.continue_final_message else tool_call_grammar(reading)
    options = _options(req, settings, vocab_size, blend=req.prefixcache_blend,
                       response_format=None if req.response_format is None else req.response_format.model_dump(),
                       logprobs=req.logprobs, top_logprobs=req.top_logprobs, tool_grammar=forced)
    return Job("chat", tenant, messages=messages, tools=tools, max_tokens=limit_max_tokens(max_tokens, settings),
               options=options, cache_key=req.prompt_cache_key, continue_final=bool(req.continue_final_message),
               retention=req.prompt_cache_retention, cache_salt=req.cache_salt or None,
               diagnose=req.diagnostics is not None, tool_choice=choice, tool_use=reading,
               previous_id=req.diagnostics.previous_message_id if req.diagnostics else None,
               breakpoints=req.prompt_cache_options is not None or any(
                   isinstance(m.content, list) and any(p.prompt_cache_breakpoint for p in m.content)
                   for m in req.messages), **_cache_options(req), ttl_seconds=_retention_ttl(req))


def _renderable(req: ChatCompletionRequest) -> None:
    """Refuse what would otherwise be dropped from the prompt without a word: an earlier assistant turn's
    deprecated ``function_call``, ``audio`` or ``refusal`` text (the conversation would lose it)."""
    for i, message in enumerate(req.messages):
        for name, instead in (("function_call", "send it as tool_calls"), ("audio", "send its transcript as content"),
                              ("refusal", "send its text as content")):
            if getattr(message, name, None) is not None:
                raise InvalidRequestError(f"an assistant message's {name} is not supported ({instead})",
                                          param=f"messages[{i}].{name}")


def completion_job(req: CompletionRequest, tenant: str, settings: Settings, vocab_size: int) -> Job:
    prompt = req.prompt
    if isinstance(prompt, list):
        prompt = prompt[0]  # the schema allows exactly one
    _only_defaults(req)
    if req.suffix:
        raise InvalidRequestError("suffix (insertion) is not supported", param="suffix")
    if req.logprobs is not None and req.echo:
        raise InvalidRequestError("logprobs with echo would need the prompt's logprobs, which this server does not "
                                  "compute; send one of them", param="logprobs")
    return Job("completions", tenant, prompt=prompt, max_tokens=limit_max_tokens(req.max_tokens, settings),
               echo=bool(req.echo),
               options=_options(req, settings, vocab_size, logprobs=req.logprobs is not None or None,
                                top_logprobs=req.logprobs), cache_key=req.prompt_cache_key,
               retention=req.prompt_cache_retention, cache_salt=req.cache_salt or None,
               breakpoints=req.prompt_cache_options is not None, **_cache_options(req),
               ttl_seconds=_retention_ttl(req))


def _cache_options(req: GenerationFields) -> dict[str, str | None]:
    options = req.prompt_cache_options
    return {"cache_mode": options.mode if options else None, "cache_ttl": options.ttl if options else None}


#: SGLang's extensions and the one value each may take here: what this server does anyway.
_SGLANG_DEFAULTS = {"no_stop_trim": False, "skip_special_tokens": True, "return_hidden_states": False}


def _only_defaults(req: GenerationFields, **more: bool) -> None:
    """Refuse an SGLang extension set to a value that would change the answer (unset or default is fine)."""
    for name, default in {**_SGLANG_DEFAULTS, **more}.items():
        value = getattr(req, name)
        if value is not None and value != default:
            raise InvalidRequestError(f"{name}={str(value).lower()} is not supported by this server (only "
                                      f"{str(default).lower()})", param=name)


def limit_max_tokens(max_tokens: int | None, settings: Settings) -> int | None:
    cap = settings.max_tokens_limit
    if max_tokens is not None and cap is not None and max_tokens > cap:
        raise InvalidRequestError(f"max_tokens is {max_tokens}; this server allows at most {cap}", param="max_tokens")
    return max_tokens


def server_temperature(temperature: float | None, settings: Settings) -> float:
    """The request's temperature, or the server default; below ``GREEDY_BELOW`` it is greedy (0)."""
    temperature = settings.default_temperature if temperature is None else temperature
    # logits / 1e-300 overflow to inf and sampling fails; the limit is argmax anyway
    return 0.0 if temperature < GREEDY_BELOW else temperature


def _options(req: GenerationFields, settings: Settings, vocab_size: int, blend: bool | float | None = None,
             response_format: dict[str, Any] | None = None,
             tool_grammar: ToolCallGrammar | None = None, **logprobs: Any) -> AnswerOptions:
    """``logprobs``: chat's ``logprobs`` and ``top_logprobs`` (``AnswerOptions.parse`` checks them)."""
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return AnswerOptions.parse(temperature=server_temperature(req.temperature, settings), top_p=req.top_p,
                               top_k=req.top_k or None, seed=req.seed, stop=[s for s in stops if s] or None,
                               ignore_eos=bool(req.ignore_eos), presence_penalty=req.presence_penalty,
                               frequency_penalty=req.frequency_penalty,
                               logit_bias=_logit_bias(req.logit_bias, vocab_size) or None, blend=blend,
                               response_format=response_format, tool_grammar=tool_grammar, **logprobs)


def _retention_ttl(req: GenerationFields) -> float | None:
    """The TTL OpenAI's ``prompt_cache_retention`` asks for (None: the cache's default)."""
    return RETENTION_SECONDS.get(req.prompt_cache_retention or "in_memory")


def _logit_bias(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (raw or {}).items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab_size or str(token) != key.strip():
            raise InvalidRequestError(f"logit_bias key {key!r} is not a token id in [0, {vocab_size})",
                                      param="logit_bias")
        if value:
            out[token] = float(value)
    return out
