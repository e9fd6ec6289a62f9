"""The public SDK: ``PrefixCache`` wraps a model's ``generate()`` with prefix reuse."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig

from prefixcache.cache.handles import EvictHook
from prefixcache.cache.hashing import BlockHasher, HashFn, xxh3_64
from prefixcache.cache.scope import Scope
from prefixcache.cache.store import KVStore
from prefixcache.cache.tiers import KVShape, TierChain, build_chain
from prefixcache.config import CacheConfig
from prefixcache.errors import (
    CacheClosedError,
    CapacityError,
    ConfigError,
    ContextLengthExceededError,
    InvalidRequestError,
    PinQuotaExceededError,
)
from prefixcache.loading import model_fingerprint
from prefixcache.model.hf_cache import probe
from prefixcache.model.layout import long_tensor
from prefixcache.model.threads import WorkerThreads
from prefixcache.serving import prompt_cache
from prefixcache.serving.blend import blend_plan, with_documents
from prefixcache.serving.breakpoints import Breakpoints, CacheUsage
from prefixcache.serving.canonicalize import Canonicalizer, CanonicalPrompt
from prefixcache.serving.diagnostics import MissReason, PromptRecords, fingerprint
from prefixcache.serving.dispatch import Dispatcher
from prefixcache.serving.engine import BatchConfig, BatchEngine
from prefixcache.serving.logprobs import TokenLogprob
from prefixcache.serving.messages import MessagesPrompt, encode_messages, output_format, prefilled, to_chat
from prefixcache.serving.options import AnswerOptions, check_cancel, check_seed, seconds
from prefixcache.serving.request import CallStats
from prefixcache.serving.serial import SerialEngine
from prefixcache.serving.stats import CacheReport, ServerFigures
from prefixcache.serving.structured import Vocabulary, tool_call_grammar
from prefixcache.serving.text_stream import TextStream, first_stop
from prefixcache.serving.tool_calls import (
    ToolCall,
    ToolUse,
    anthropic_tool_use,
    calls_of,
    cut_short,
    openai_tool_use,
    text_of,
    tokenizer_family,
)

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"
#: Marks the namespace part that follows as a caller's ``cache_salt`` (a NUL: no name or id holds one).
SALT_PART = "\x00cache_salt"
#: Most seconds ``close`` spends writing the device's blocks to the lower tiers.
DRAIN_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """One chat or completion answer."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop", "length", "cancelled", or "tool_calls" (calls parsed out: ``tool_calls``)
    usage: Usage
    stats: CallStats
    #: ``messages()``: the input tokens as Anthropic counts them (read, written at breakpoints, the rest).
    cache: CacheUsage | None = None
    #: ``chat()`` / ``messages()`` with tools: the calls parsed out of the answer (``text`` is what is left); a
    #: last call cut by ``max_tokens`` is incomplete (``ToolCall.complete``), and ``finish_reason`` "length".
    tool_calls: tuple[ToolCall, ...] = ()
    #: With ``logprobs=True``: each answer token's log-probability and its ``top_logprobs`` likeliest
    #: alternatives (``serving/logprobs.py``), special tokens left out (None: not asked for); stopped by a
    #: ``stop`` string, those up to the token in which ``text`` ends (the stop string may begin inside it).
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True, slots=True)
class WarmResult:
    prompt_tokens: int
    cached_tokens: int  # already cached before warming
    stored_tokens: int
    pinned: bool


class PrefixCache:
    """Prefix-cached generation around a Hugging Face causal LM.

    ``generate()`` takes ``model.generate()``'s arguments and returns what it returns;
    ``chat()`` / ``complete()`` take OpenAI-shaped input and return a ``GenerationResult``.
    All methods are thread-safe. Time comes from ``clock`` (monotonic seconds) so tests
    can drive TTLs without sleeping. ``on_evict`` receives every snapshot about to be
    dropped (an ``EvictedSnapshot``). The lower tiers ``config`` names (host memory, disk,
    Redis) sit below the store; their TTLs are absolute ``wall_clock`` times, so they
    survive a restart.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, config: CacheConfig | None = None, *,
                 clock: Callable[[], float] = time.monotonic, hash_fn: HashFn = xxh3_64,
                 start_sweeper: bool = True, on_evict: EvictHook | None = None,
                 batching: BatchConfig | dict[str, Any] | bool = True, wall_clock: Callable[[], float] = time.time):
        if not isinstance(batching, (bool, BatchConfig, dict)):  # 0, None or "off" must not mean batching on
            raise ConfigError("batching", batching, "True, False, a BatchConfig or a dict of its fields")
        if config is not None and not isinstance(config, CacheConfig):
            raise ConfigError("config", config, "a CacheConfig (CacheConfig(**fields) from a dict)")
        self.model = model.eval()
        self.tokenizer = tokenizer
        #: The syntax of the model's tool calls, from its chat template (None: calls stay text).
        self.tool_family = tokenizer_family(tokenizer)
        self.config = config if config is not None else CacheConfig()
        self._clock = clock
        self.canonicalizer = None if tokenizer is None else Canonicalizer(
            tokenizer, normalize_whitespace=self.config.normalize_whitespace,
            unicode_normalization=self.config.unicode_normalization)
        self.store = KVStore(self.config, BlockHasher(self.config.hash_seed, hash_fn), clock, on_evict)
        support = probe(self.model)  # the model's KV layout, once for both engines
        # Threads that compute and then wait give their CPU workers back (``model/threads.py``).
        self._threads = threads = WorkerThreads.of_torch()
        self.serial = SerialEngine(self.model, self.store, clock, support=support, threads=threads)
        self.breakpoints = Breakpoints(self.store, self.config.breakpoint_min_tokens)
        self.prompt_records = PromptRecords(clock)
        # Every call the batching engine reproduces exactly runs there (continuous batching with
        # cascade attention over shared prefixes); the rest runs on the serial engine (``Dispatcher``).
        self.batcher: BatchEngine | None = None
        self.tiers: TierChain | None = None
        layout = self.serial.layout
        try:  # whatever started (the tier writer, the batching loop) stops again if the rest fails
            if layout is not None:  # first: a tier directory another process holds is refused before any thread
                self.tiers = build_chain(self.config, KVShape(layout.num_layers, layout.num_kv_heads, layout.head_dim,
                                                              self.config.block_size, layout.dtype, layout.device),
                                         wall_clock, idle=threads.release)
                self.store.attach(self.tiers)
            if batching is not False:  # True, a BatchConfig, or a mapping of fields (an empty one too)
                # A BatchConfig as given; else sized for the device, with a mapping's fields over those defaults.
                batch_config = batching if isinstance(batching, (BatchConfig, dict)) else None
                self.batcher = BatchEngine(self.model, self.store, clock, batch_config, self.config.cache_generated,
                                           support=support, threads=threads)
        except BaseException:
            if self.batcher is not None:
                self.batcher.close()
            if self.tiers is not None:
                self.tiers.close()
            raise
        self.dispatcher = Dispatcher(self.serial, self.batcher, self.config.cache_generated)
        head = self.model.get_output_embeddings()
        #: llguidance's view of the tokenizer, for calls with a ``response_format`` (``serving/structured.py``).
        self.vocabulary = Vocabulary(tokenizer, head.weight.shape[0] if head is not None else self.vocab_size)
        self._model_key = tuple(model_fingerprint(model))
        self._local = threading.local()
        self._closed = threading.Event()
        self._sweeper: threading.Thread | None = None
        if start_sweeper and self.config.ttl_seconds is not None:
            self._sweeper = threading.Thread(target=self._sweep_loop, name="prefixcache-sweeper", daemon=True)
            self._sweeper.start()
        threads.release()  # the probes above ran on this thread, which computes no more until a serial call

    # -- identity ------------------------------------------------------------------
    @property
    def model_id(self) -> str:
        return self._model_key[0]

    @property
    def vocab_size(self) -> int:
        """Token ids the model embeds: ``[0, vocab_size)``."""
        return self.model.get_input_embeddings().num_embeddings

    @property
    def max_prewarm_tokens(self) -> int:
        """Longest prefix ``warm`` fills: ``config.max_prewarm_tokens``, at most the model's context."""
        limit = self.config.max_prewarm_tokens
        return self.max_context if limit is None else min(limit, self.max_context)

    @property
    def max_context(self) -> int:
        cfg = self.model.config.get_text_config(decoder=True)
        for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            if getattr(cfg, name, None):
                return int(getattr(cfg, name))
        return 2048

    def namespace(self, tenant: str, cache_salt: str | None = None) -> tuple[str, ...]:
        """Cache namespace: tenant, model identity, dtype, tokenizer/template fingerprint; and the caller's
        ``cache_salt`` when one is given (non-empty): calls of one tenant with different salts (or one with
        a salt and one without) never share a block. The tenant's quotas and counters are the same."""
        template = self.canonicalizer.fingerprint if self.canonicalizer is not None else "no-tokenizer"
        base = (tenant, *self._model_key, template, *self.config.namespace_extra)
        return (*base, SALT_PART, _salt(cache_salt)) if cache_salt else base

    def scope(self, tenant: str | None = None, cache_salt: str | None = None,
              ttl_seconds: float | None = None) -> Scope:
        """A call's checked scope: the tenant (default ``"default"``), its namespace under ``cache_salt``,
        and the TTL (default ``config.ttl_seconds``; ``math.inf``: no expiry)."""
        return self._scope(self._tenant(tenant), cache_salt, self._ttl(ttl_seconds))

    def _scope(self, tenant: str, cache_salt: str | None, ttl: float | None) -> Scope:
        """``scope`` of a checked tenant with its TTL already resolved."""
        return Scope(self.namespace(tenant, cache_salt), tenant, ttl, cache_salt or None)

    @property
    def batching_disabled_reason(self) -> str | None:
        """Why every call runs on the serial engine (None: the batching engine serves what it reproduces)."""
        if self.batcher is None:
            return "batching is off (PrefixCache(batching=False))"
        if self.batcher.failure is not None:
            return f"the batching loop stopped: {self.batcher.failure}"
        return self.batcher.disabled_reason

    @property
    def engine_failure(self) -> str | None:
        """Why the batching loop stopped (None while it runs, or without one). Calls then run on
        the serial engine; the process should be restarted to batch again."""
        return None if self.batcher is None else self.batcher.failure

    @property
    def engine_faulting(self) -> str | None:
        """Why the running batching loop counts as faulting (its recent steps all failed), or None."""
        return None if self.batcher is None else self.batcher.faulting

    @property
    def last_call(self) -> CallStats | None:
        """Stats of this thread's last call (``cached_tokens`` is the reused-token count)."""
        return getattr(self._local, "last", None)

    # -- generate() drop-in --------------------------------------------------------
    def generate(self, input_ids: torch.Tensor | Sequence[int] | Sequence[Sequence[int]] | None = None,
                 attention_mask: torch.Tensor | None = None, generation_config: GenerationConfig | None = None, *,
                 tenant: str | None = None, ttl_seconds: float | None = None, timeout_seconds: float | None = None,
                 **kwargs: Any) -> Any:
        """``model.generate()`` with prefix reuse; same arguments, same return value.

        ``timeout_seconds`` bounds a call the batching engine serves: past it the call is
        cancelled and ``GenerationTimeoutError`` raised. An engine fault raises ``EngineFaultError``.

        A batch (padded or not) is served row by row: each row's padding is removed using
        ``attention_mask``, the rows run concurrently on the batching engine (one after another
        with a streamer, or on the serial engine), and are put back together padded as
        ``generate()`` pads them. ``return_dict_in_generate`` needs batch size 1. A right-padded
        row (its mask ends in zeros) raises ``InvalidRequestError``: ``generate()`` would continue
        it from a pad token, so no answer is both its and right; pad on the left.
        """
        self._check_open()
        ids = self._as_ids(kwargs.pop("inputs", input_ids))
        scope = self.scope(tenant, None, ttl_seconds)
        timeout = None if timeout_seconds is None else seconds(timeout_seconds, "timeout_seconds")
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(ids.shape):
            raise InvalidRequestError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                                      f"{tuple(ids.shape)}", param="attention_mask")
        check_seed(kwargs.get("seed"))
        config = self.dispatcher.serial_engine.effective_config(generation_config, kwargs)  # once per call
        inferred = attention_mask is None
        if inferred:  # as generate() infers it: the pad id masked, where it is no EOS id
            attention_mask = self._inferred_mask(ids, config)
        rows = [ids[i] if attention_mask is None else ids[i][attention_mask[i].to(torch.bool)]
                for i in range(ids.shape[0])]
        if any(len(r) == 0 for r in rows):
            raise InvalidRequestError("a prompt row has no tokens (attention_mask is all zeros)", param="input_ids")
        if attention_mask is not None:
            _check_left_padded(attention_mask, inferred)
        whole = len(rows) == 1 and len(rows[0]) == ids.shape[1]
        if not whole and config.return_dict_in_generate:
            raise InvalidRequestError("return_dict_in_generate needs one unpadded prompt per call (batch size 1)",
                                      param="return_dict_in_generate")
        routes = [self.dispatcher.route(len(r), config, kwargs) for r in rows]
        if all(params is not None for params, _ in routes):
            outs, self._local.last = self.dispatcher.generate_batched(rows, [p for p, _ in routes], scope, kwargs,
                                                                      timeout)
        else:
            outs = []
            for row in rows:
                out, self._local.last = self.dispatcher.serial(row.unsqueeze(0), scope, generation_config, kwargs)
                if whole:
                    return out
                outs.append(out[0, len(row):])
        if whole:
            return torch.cat([ids, outs[0].unsqueeze(0)], dim=1)
        pad = self._pad_id(config)
        width = max(len(o) for o in outs)
        new = torch.full((len(outs), width), pad, dtype=ids.dtype, device=ids.device)
        for i, o in enumerate(outs):
            new[i, : len(o)] = o
        return torch.cat([ids, new], dim=1)

    # -- OpenAI-shaped calls -------------------------------------------------------
    def chat(self, messages: Sequence[dict[str, Any]], *, tools: Sequence[dict[str, Any]] | None = None,
             tool_choice: str | dict[str, Any] | None = None, parallel_tool_calls: bool = True,
             previous_id: str | None = None, record_id: str | None = None, documents: Sequence[str] | None = None,
             **options: Any) -> GenerationResult:
        """Answer a chat conversation. Options: see ``complete``.

        ``documents``: texts placed, in order, at the start of the last user message as content parts
        marked ``prefixcache_chunk`` (parts marked in ``messages`` count the same). Each marked part's KV
        is kept on its own and reused wherever it appears in a later prompt of the tenant, a share of its
        tokens recomputed (``blend``, ``CacheConfig.blend_recompute_share``); ``result.stats`` says how
        many tokens were reused and recomputed.

        With ``tools`` (OpenAI's ``{"type": "function", "function": {...}}``) the model's calls are parsed
        in its chat template's syntax into ``result.tool_calls`` (``finish_reason`` "tool_calls", or "length"
        where ``max_tokens`` cut the last), ``text`` holding the rest. ``tool_choice``: "auto" (default), "none"
        (tools hidden), "required" or ``{"type": "function", "function": {"name": ...}}``; a forced call the
        answer lacks raises ``ToolCallError`` (unless ``max_tokens`` cut the answer before it).
        ``parallel_tool_calls=False`` keeps the first call only.

        Cache diagnostics: ``record_id`` keeps this call's prompt fingerprint under that id; ``previous_id``
        compares with the fingerprint kept under it, and ``result.stats.miss_reason`` says why this call
        could not reuse all of that prompt (``serving/diagnostics.py``; None: it could).
        """
        reading = openai_tool_use(self.tool_family, tools, tool_choice, parallel_tool_calls)
        forced = tool_call_grammar(reading)  # a forced call to strict tools: constrained to their schemas
        if forced is not None:
            options["tool_grammar"] = forced
        shown = None if tool_choice == "none" else tools
        messages = with_documents(_message_list(messages), documents)
        prompt = self._canon().encode_chat(messages, tools=shown)
        ids = list(prompt.token_ids)
        miss = None
        if previous_id is not None or record_id is not None:
            miss = self.diagnose(messages, shown, ids, tenant=options.get("tenant"),
                                 cache_salt=options.get("cache_salt"), tool_choice=tool_choice,
                                 previous_id=previous_id, record_id=record_id)
        result = self.answer(ids, chunks=prompt.chunks, unplaced=prompt.unplaced, **options)
        return _with_calls(_noted(result, miss), reading)

    def complete(self, prompt: str, **options: Any) -> GenerationResult:
        """Continue a text prompt.

        Options: ``tenant``, ``max_new_tokens`` (default 256), ``temperature`` (0 or
        unset = greedy), ``top_p``, ``top_k``, ``do_sample``, ``seed``, ``stop`` (list of
        strings, excluded from the text), ``presence_penalty``, ``frequency_penalty``,
        ``logit_bias`` (token id -> bias), ``on_text`` (callback for text deltas),
        ``cancel`` (threading.Event), ``ttl_seconds``, ``ignore_eos`` (go on past the
        end-of-sequence token until ``max_new_tokens``), ``timeout_seconds`` (as ``generate``),
        ``cache_salt`` (share cached prefixes only with calls of the tenant with the same salt),
        ``response_format`` (OpenAI's ``json_schema`` or ``json_object``: the answer constrained to that JSON,
        ``serving/structured.py``; one that does not match when done raises ``OutputFormatError``),
        ``logprobs`` (True: ``result.logprobs`` holds each answer token's log-probability under the model's
        own distribution, before temperature, penalties, top-k/top-p and a response format's mask;
        ``serving/logprobs.py``), ``top_logprobs`` (0-20 likeliest alternatives per token, with ``logprobs``),
        ``on_logprobs`` (callback for the logprobs of the tokens whose text ``on_text`` receives next), and any other ``generate()`` kwarg (``AnswerOptions.parse`` checks them).
        """
        if not isinstance(prompt, str):
            raise InvalidRequestError("prompt must be a string", param="prompt")
        return self.answer(list(self._canon().encode_text(prompt).token_ids), **options)

    def messages(self, messages: Sequence[dict[str, Any]], *, max_tokens: int, system: Any = None,
                 tools: Sequence[dict[str, Any]] | None = None, tool_choice: dict[str, Any] | None = None,
                 cache_control: dict[str, Any] | None = None, stop_sequences: Sequence[str] | None = None,
                 output_config: dict[str, Any] | None = None, previous_id: str | None = None,
                 record_id: str | None = None, **options: Any) -> GenerationResult:
        """Answer an Anthropic-shaped request, honouring its ``cache_control`` breakpoints.

        ``system`` is a string or text blocks; ``messages`` hold strings or text, ``tool_use`` and
        ``tool_result`` blocks; ``tools`` are ``{name, description, input_schema}``. A block with
        ``cache_control={"type": "ephemeral", "ttl": "5m" | "1h"}`` keeps the prefix up to it for
        that TTL (rules: ``serving/breakpoints.py``); a top-level ``cache_control`` marks the last block
        (automatic caching). ``result.cache`` holds the usage as Anthropic counts it. Cache diagnostics
        (``previous_id``, ``record_id``) and tool calls (``result.tool_calls``; ``tool_choice`` ``any`` or
        ``tool`` forces one) as ``chat``. ``output_config``: Anthropic's; ``{"format": {"type": "json_schema",
        "schema": {...}}}`` holds the answer's text to that JSON schema under Anthropic's rules for it (as
        ``response_format`` does OpenAI's: an answer that does not match when done raises ``OutputFormatError``;
        one cut by ``max_tokens`` ends with the partial JSON), not with a prefilled final assistant turn or a
        forced tool call; ``effort`` only "high", the default. Other options as ``complete``.
        """
        fmt = output_format(output_config, messages, tool_choice)
        if fmt is not None and options.get("response_format") is not None:
            raise InvalidRequestError("send output_config.format or response_format, not both",
                                      param="output_config.format")
        if fmt is not None:
            options["response_format"] = fmt
        prompt = self.encode_messages(messages, system=system, tools=tools, tool_choice=tool_choice,
                                      cache_control=cache_control)
        miss = None
        if previous_id is not None or record_id is not None:
            chat, defs = to_chat(messages, system, tools or [])
            miss = self.diagnose(chat, defs, prompt.token_ids, tenant=options.get("tenant"),
                                 cache_salt=options.get("cache_salt"), tool_choice=tool_choice,
                                 previous_id=previous_id, record_id=record_id)
        reading = anthropic_tool_use(self.tool_family, tools, tool_choice)  # strict tools' schemas checked
        reading = None if fmt is not None else reading  # the answer is the format's JSON: no call to read in it
        forced = None if prefilled(messages) else tool_call_grammar(reading)
        if forced is not None:  # a forced call to strict tools: constrained to their schemas
            options["tool_grammar"] = forced
        result = self.answer_messages(prompt, max_new_tokens=max_tokens, stop=stop_sequences, **options)
        return _with_calls(_noted(result, miss), reading)

    def encode_messages(self, messages: Sequence[dict[str, Any]], *, system: Any = None,
                        tools: Sequence[dict[str, Any]] | None = None,
                        tool_choice: dict[str, Any] | None = None,
                        cache_control: dict[str, Any] | None = None) -> MessagesPrompt:
        """An Anthropic-shaped request's canonical ids and breakpoints (see ``messages``)."""
        return encode_messages(self._canon(), messages, system, tools, tool_choice, cache_control)

    def answer_messages(self, prompt: MessagesPrompt, *, tenant: str | None = None, cache_salt: str | None = None,
                        ttl_seconds: float | None = None, **options: Any) -> GenerationResult:
        """Answer an encoded messages request, then keep its breakpoints' prefixes (options as ``answer``)."""
        scope = self.scope(tenant, cache_salt, ttl_seconds)
        return self.run_messages(prompt, AnswerOptions.parse(**options), scope)

    def run_messages(self, prompt: MessagesPrompt, options: AnswerOptions, scope: Scope) -> GenerationResult:
        """``run`` for an encoded messages request (its marked chunks too), then keep its breakpoints' prefixes."""
        options = dataclasses.replace(options, chunks=prompt.chunks, unplaced=prompt.unplaced)
        held = self.breakpoints.held(scope, prompt.token_ids)
        result = self.run(list(prompt.token_ids), options, scope)
        usage = self.breakpoints.settle(scope, prompt.token_ids, prompt.breakpoints, result.usage.cached_tokens, held)
        return dataclasses.replace(result, cache=usage)

    def encode_chat_breakpoints(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
                                *, mode: str | None = None, ttl: str | None = None,
                                continue_final: bool = False) -> MessagesPrompt:
        """An OpenAI-shaped chat's canonical ids and the prompt-cache breakpoints it writes under OpenAI's rules
        (``prompt_cache_breakpoint`` on parts, ``mode`` and ``ttl`` of ``prompt_cache_options``;
        ``serving/prompt_cache.py``); answer it with ``answer_messages``. ``continue_final``: the answer continues
        the last message, an assistant turn of text."""
        return prompt_cache.encode_chat(self._canon(), _message_list(messages), tools, mode, ttl, continue_final)

    def diagnose(self, chat: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
                 token_ids: Sequence[int], *, tenant: str | None = None, cache_salt: str | None = None,
                 tool_choice: Any = None, previous_id: str | None = None,
                 record_id: str | None = None) -> MissReason | None:
        """Cache diagnostics (``serving/diagnostics.py``): compare an OpenAI-shaped chat that encodes to
        ``token_ids`` with the tenant's call recorded under ``previous_id``, then record it under ``record_id``.
        Returns why it cannot reuse all of that call's prompt (None: it can, or nothing was compared)."""
        tenant = self._tenant(tenant)
        current = fingerprint(self.namespace(tenant, cache_salt), chat, tools, {"tool_choice": tool_choice},
                              token_ids)
        return self.prompt_records.diagnose(tenant, current, previous_id, record_id)

    def encode_chat_prompt(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
                           *, continue_final: bool = False) -> CanonicalPrompt:
        """A chat request's canonical ids with its marked chunks' spans (pass them to ``answer`` as ``chunks``);
        ``continue_final``: the answer continues the last message, an assistant turn of text."""
        return self._canon().encode_chat(_message_list(messages), tools=tools, continue_final_message=continue_final)

    def encode_chat(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        return list(self._canon().encode_chat(_message_list(messages), tools=tools).token_ids)

    def encode_text(self, prompt: str) -> list[int]:
        return list(self._canon().encode_text(prompt).token_ids)

    def encode_prefix(self, prefix: str | Sequence[dict[str, Any]] | Sequence[int],
                      tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """A prefix to warm as ids: chat messages (without the generation prompt, so any later
        conversation that starts with them hits), a text prompt, or token ids (checked)."""
        if isinstance(prefix, str):
            tokens = self.encode_text(prefix)
        elif isinstance(prefix, Sequence) and prefix and all(isinstance(m, dict) for m in prefix):
            tokens = list(self._canon().encode_chat(list(prefix), tools=tools, add_generation_prompt=False).token_ids)
        else:
            tokens = self._as_ids(prefix)[0].tolist()
        if not tokens:
            raise InvalidRequestError("the prefix encodes to zero tokens", param="prefix")
        return tokens

    def answer(self, prompt: list[int], *, tenant: str | None = None, ttl_seconds: float | None = None,
               cache_salt: str | None = None, **options: Any) -> GenerationResult:
        """Answer already-encoded prompt ids (from ``encode_chat``/``encode_text``); options as ``complete``.
        ``cache_salt`` (as vLLM's): reuse and store prefixes only among calls of the tenant with the same salt.
        ``chunks``: token spans ``[start, end)`` of reusable chunks (``CanonicalPrompt.chunks``); ``blend``:
        False = prefill them this time, a number in [0, 1] = the share recomputed (default
        ``config.blend_recompute_share``); ``unplaced``: marked parts the encoding could not locate."""
        scope = self.scope(tenant, cache_salt, ttl_seconds)
        vocab = self.vocab_size
        if isinstance(prompt, (str, bytes)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
            raise InvalidRequestError(f"prompt must be a list of token ids in [0, {vocab})", param="prompt")
        return self.run(list(prompt), AnswerOptions.parse(**options), scope)

    def checked(self, prompt: list[int], options: AnswerOptions) -> AnswerOptions:
        """``options`` for ``prompt``, checked as ``run`` checks them before anything runs, with a response
        format's (or forced call's) grammar bound to the vocabulary: a format the model cannot end (no
        end-of-sequence id) or that needs a fast tokenizer raises ``InvalidRequestError`` here. A server calls it
        before it says a stream has begun, so such a request is refused, not ended by an error event."""
        self._check_open()
        if self.tokenizer is None:
            raise InvalidRequestError("answering needs a tokenizer for the answer's text: PrefixCache(model, "
                                      "tokenizer); generate() takes and returns token ids without one")
        if not prompt:
            raise InvalidRequestError("the prompt encodes to zero tokens", param="prompt")
        # Checked here, not where a batched step would fail on it (every request of that step with it).
        if any(token >= self.vocab_size for token, _ in options.logit_bias):
            raise InvalidRequestError(f"logit_bias keys must be token ids below {self.vocab_size}", param="logit_bias")
        if len(prompt) + options.max_new_tokens > self.max_context:
            raise ContextLengthExceededError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({options.max_new_tokens}) exceeds the model's "
                f"context of {self.max_context} tokens", param="messages")
        if options.constraint is not None:  # bound already
            return options
        if options.response_format is not None:  # bound to the vocabulary here: the engines only apply it
            eos = options.eos_ids(self.serial.effective_config(None, options.extra))
            return dataclasses.replace(options, constraint=self.vocabulary.constraint(options.response_format, eos))
        if options.tool_grammar is not None:
            return self._forced_call(options)
        return options

    def run(self, prompt: list[int], options: AnswerOptions, scope: Scope) -> GenerationResult:
        """Answer prompt ids with checked ``options`` in ``scope`` (what ``answer`` does once it parsed them)."""
        options = self.checked(prompt, options)
        plan, why_not = blend_plan(options.chunks, options.blend, len(prompt), self.config, options.unplaced)
        stream = TextStream(self.tokenizer, options.on_text, options.stop, options.on_logprobs)
        params, _ = self.dispatcher.route_answer(len(prompt), options)
        if params is not None and plan is not None:
            new, stats, reason = self.dispatcher.answer_blended(prompt, plan, params, scope, stream, options.cancel,
                                                                options.timeout_seconds,
                                                                counted=options.counted_cached_tokens)
        elif params is not None:
            new, stats, reason = self.dispatcher.answer_batched(prompt, params, scope, stream, options.cancel,
                                                                options.timeout_seconds,
                                                                counted=options.counted_cached_tokens)
        else:
            pad = self._pad_id(self.dispatcher.serial_engine.effective_config(None, {}))
            new, stats, reason = self.dispatcher.answer_serial(prompt, options, stream, scope,
                                                               next(self.model.parameters()).device, pad, plan)
        stats.blend_reason = stats.blend_reason or why_not
        self._local.last = stats
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        cut, tokens = first_stop(text, options.stop), len(new)
        if cut is not None or stream.stopped:  # OpenAI: the text ends before the stop string
            text, reason = text[:cut], "stop"
            tokens = min(tokens, stream.covering(len(text)))  # logprobs: the tokens of the text returned
        elif options.cancelled and reason != "stop":
            reason = "cancelled"
        elif options.response_format is not None and reason == "stop":  # ended where its grammar did
            options.response_format.check(text)
        logprobs = None if options.logprobs is None else stream.answer_logprobs(tokens)
        return GenerationResult(text, tuple(new), reason, Usage(len(prompt), len(new), stats.cached_tokens), stats,
                                logprobs=logprobs)

    def _forced_call(self, options: AnswerOptions) -> AnswerOptions:
        """``options`` with their forced call's grammar bound to the vocabulary, or without it where it cannot
        be (no end-of-sequence token, ``ignore_eos``, a slow tokenizer): the call is then only checked when done,
        and ``checked`` again (``run`` after a server's worker) neither binds it again nor logs it twice.
        Bound, the answer is the call alone, no text: the stop strings, which end text, do not cut it."""
        eos = options.eos_ids(self.serial.effective_config(None, options.extra))
        try:
            return dataclasses.replace(options, constraint=self.vocabulary.constraint(options.tool_grammar, eos),
                                       stop=())
        except InvalidRequestError as exc:
            log.warning("forced tool call not constrained (only checked when done): %s", exc)
            return dataclasses.replace(options, tool_grammar=None)

    # -- cache management ----------------------------------------------------------
    def warm(self, prefix: str | Sequence[dict[str, Any]] | Sequence[int], *,
             tools: Sequence[dict[str, Any]] | None = None, tenant: str | None = None, pin: bool = False,
             ttl_seconds: float | None = None, privileged: bool = False, cancel: threading.Event | None = None,
             timeout_seconds: float | None = None, cache_salt: str | None = None) -> WarmResult:
        """Prefill and keep a prefix: chat messages, a text prompt, or token ids.

        Messages are encoded without the generation prompt, so any later conversation
        that starts with them hits. ``pin=True`` keeps the prefix until ``unpin``,
        ``flush`` or its TTL. A tenant's pin counts against ``config.pin_quota_bytes``
        (over it: ``PinQuotaExceededError``, nothing stored or evicted) and lapses after
        ``config.pin_ttl_seconds`` without a read whatever TTL the prefix has (it stays, unpinned). ``privileged`` (the
        operator, as the proxy's admin key) lifts both: no quota, and no TTL unless given.
        A pin that cannot fit the budget or quota raises ``CapacityError``; one larger than the
        pin quota is refused before any work. The prefill stops between chunks once ``cancel``
        is set (``RequestCancelledError``) or after ``timeout_seconds`` (``GenerationTimeoutError``);
        then nothing is stored. A prefix over ``max_prewarm_tokens`` (``config.max_prewarm_tokens``, at
        most the model's context) raises ``ContextLengthExceededError`` before any work. With ``cache_salt`` only calls with the same salt read the prefix.
        """
        self._check_open()
        for name, flag in (("pin", pin), ("privileged", privileged)):
            if not isinstance(flag, bool):
                raise InvalidRequestError(f"{name} must be True or False", param=name)
        check_cancel(cancel)
        tokens = self.encode_prefix(prefix, tools)
        limit = self.max_prewarm_tokens
        if len(tokens) > limit:
            raise ContextLengthExceededError(f"the prefix is {len(tokens)} tokens; warm fills at most {limit} "
                                             f"(the model's context is {self.max_context})", param="prefix")
        tenant = self._tenant(tenant)
        ttl = self._pin_ttl(ttl_seconds, privileged) if pin else self._ttl(ttl_seconds)
        scope = self._scope(tenant, cache_salt, ttl)
        timeout = None if timeout_seconds is None else seconds(timeout_seconds, "timeout_seconds")
        need = len(tokens) * self.bytes_per_token
        if pin and not privileged and need > self.config.pin_quota_bytes:
            raise PinQuotaExceededError.of(self.store.snapshot_stats(tenant)["pinned_bytes"],
                                           self.config.pin_quota_bytes, need)
        if pin and not privileged:  # with what the tenant has pinned already: refused before any work or eviction
            self.store.check_pin(scope, tokens, self.bytes_per_token)
        stats = self.serial.prefill(tokens, scope, pin, privileged, cancel, timeout)
        if pin and stats.stored_tokens < len(tokens):
            # The caller's own figures only: other tenants' usage is not theirs to see.
            mine = self.store.snapshot_stats(tenant)
            raise CapacityError(
                f"cannot pin {len(tokens)} tokens ({len(tokens) * self.bytes_per_token} bytes): budget "
                f"{self.config.max_bytes} bytes, tenant quota {self.config.tenant_quota_bytes}; this tenant holds "
                f"{mine['bytes']} bytes, {mine['pinned_bytes']} of them pinned")
        return WarmResult(len(tokens), stats.cached_tokens, stats.stored_tokens, pin)

    def unpin(self, prefix: str | Sequence[dict[str, Any]] | Sequence[int], *,
              tools: Sequence[dict[str, Any]] | None = None, tenant: str | None = None,
              cache_salt: str | None = None, privileged: bool = False) -> bool:
        """Undo one ``warm(..., pin=True)`` of the same prefix (and salt) with the same ``privileged``: the tenant's
        pins and the operator's are counted apart, and each undoes only its own. Returns whether it was pinned so."""
        if not isinstance(privileged, bool):
            raise InvalidRequestError("privileged must be True or False", param="privileged")
        tokens = self.encode_prefix(prefix, tools)
        return self.store.unpin(self.scope(tenant, cache_salt), tokens, privileged) > 0

    @property
    def bytes_per_token(self) -> int:
        return 0 if self.serial.layout is None else self.serial.layout.bytes_per_token

    def can_admit(self, n_tokens: int, tenant: str | None = None) -> bool:
        """Whether the KV of ``n_tokens`` more tokens could be stored now (after evicting what may go)."""
        return self.store.can_admit(n_tokens * self.bytes_per_token, self._tenant(tenant))

    def stats(self, tenant: str | None = None) -> dict[str, Any]:
        """Hit counters and memory figures, for one tenant or (None) all (``report`` as a mapping)."""
        return self.report(tenant).to_dict()

    def report(self, tenant: str | None = None) -> CacheReport:
        """Hit counters and memory figures, for one tenant or (None) all, with the server's figures."""
        if tenant is not None:
            tenant = self._tenant(tenant)  # a non-string or empty tenant is an error, not an empty report
        counts = self.dispatcher.counters.counts(tenant)
        server = None
        if tenant is None:  # not a tenant's: all KV memory, the batching engine's state, the tiers
            reason = self.batching_disabled_reason
            server = ServerFigures(kv_bytes=self.store.ledger.held(), kv_total_bytes=self.store.ledger.total,
                                   batching_enabled=reason is None, batching_disabled_reason=reason,
                                   tiers=None if self.tiers is None else self.tiers.stats())
        return CacheReport.of(counts, self.store.snapshot_stats(tenant), self.breakpoints.stats(tenant), server)

    def flush(self, tenant: str | None = None, *, tiers: bool = True) -> int:
        """Drop cached prefixes (one tenant's, or all) from the device and, with ``tiers``, from every
        lower tier too, so a flushed prefix never comes back from below. Returns device bytes freed.
        Raises ``TierPurgeError`` if a tier could not be reached (the device and the others are flushed)."""
        if not isinstance(tiers, bool):
            raise InvalidRequestError("tiers must be True or False", param="tiers")
        scope = None if tenant is None else self._tenant(tenant)
        freed = self.store.flush(scope)
        if tiers and self.tiers is not None:
            try:
                self.tiers.purge(scope)
            finally:  # what a restore brought back from a tier before the purge reached it (one reading the
                freed += self.store.flush(scope)  # tiers across this flush stores nothing: KVStore.flushes)
        return freed

    def sweep(self) -> int:
        """Free expired prefixes now (the background sweeper does this periodically)."""
        return self.store.sweep()

    def check_integrity(self) -> None:
        self.store.check_integrity()

    def audit(self) -> dict[str, int]:
        """Walk the store (O(entries)): accounted bytes, bytes of live snapshot tensors, refcounts held.
        At idle the first two are equal and refcounts 0."""
        return self.store.audit()

    def persist(self, timeout: float = DRAIN_SECONDS) -> None:
        """Write the device's blocks down to the lower tiers now (write-back keeps them only on eviction),
        and wait for queued writes. A no-op without tiers; ``close`` calls it, and so does the proxy's
        shutdown (a server stopped by a signal may never return to its caller's ``close``)."""
        if self.tiers is None:
            return
        if not self.tiers.write_through:
            self.tiers.drain(self.store.snapshots(), timeout)
        self.tiers.flush_writes(timeout)

    def close(self) -> None:
        """Stop the engines and the sweeper; keep the device's blocks in the lower tiers (``persist``)."""
        already = self._closed.is_set()
        self._closed.set()
        if self.batcher is not None:
            self.batcher.close()
        if self._sweeper is not None:
            self._sweeper.join(timeout=5)
        if self.tiers is not None and not already:
            self.persist()
            self.tiers.close()

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers -------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed.is_set():  # a warm after close would store what no persist writes down any more
            raise CacheClosedError("this PrefixCache is closed")

    def _sweep_loop(self) -> None:
        while not self._closed.wait(self.config.sweep_interval_seconds):
            self.store.sweep()
            if self.tiers is not None:
                self.tiers.sweep()
            self._threads.release()  # an eviction may have copied KV; the sweeper waits again

    def _canon(self) -> Canonicalizer:
        if self.canonicalizer is None:
            raise InvalidRequestError("chat/complete need a tokenizer: PrefixCache(model, tokenizer)")
        return self.canonicalizer

    def _as_ids(self, value: Any) -> torch.Tensor:
        if value is None:
            raise InvalidRequestError("input_ids is required", param="input_ids")
        try:
            ids = value if isinstance(value, torch.Tensor) else _list_ids(value)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidRequestError(f"input_ids must be integer token ids: {exc}", param="input_ids") from exc
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2 or ids.shape[1] == 0 or ids.dtype not in (torch.long, torch.int, torch.int32, torch.int64):
            raise InvalidRequestError(f"input_ids must be a non-empty [batch, seq] integer tensor, got shape "
                                      f"{tuple(ids.shape)} dtype {ids.dtype}", param="input_ids")
        vocab = self.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise InvalidRequestError(f"token ids must be in [0, {vocab})", param="input_ids")
        return ids.to(device=next(self.model.parameters()).device, dtype=torch.long)

    @staticmethod
    def _tenant(tenant: str | None) -> str:
        if tenant is None:
            return DEFAULT_TENANT
        if not isinstance(tenant, str) or not tenant:
            raise InvalidRequestError("tenant must be a non-empty string", param="tenant")
        return tenant

    def _ttl(self, ttl_seconds: float | None) -> float | None:
        if ttl_seconds is None:
            return self.config.ttl_seconds
        return seconds(ttl_seconds, "ttl_seconds", " (math.inf for no expiry)")

    def _pin_ttl(self, ttl_seconds: float | None, privileged: bool) -> float | None:
        """A pin's TTL: as asked for the operator (none by default); at most ``pin_ttl_seconds`` for a tenant."""
        ttl = None if ttl_seconds is None else self._ttl(ttl_seconds)
        cap = self.config.pin_ttl_seconds
        if privileged or cap is None:
            return ttl
        return cap if ttl is None else min(ttl, cap)

    @staticmethod
    def _special_ids(config: GenerationConfig) -> tuple[int | None, list[int]]:
        """The pad id and the EOS ids (in their order) ``generate()`` uses under ``config``, a call's effective
        configuration (``SerialEngine.effective_config``: the call's, else its config's, else the model's)."""
        pad, eos = config.pad_token_id, config.eos_token_id
        if isinstance(eos, torch.Tensor):
            eos = eos.flatten().tolist()
        return (None if pad is None else int(pad)), ([] if eos is None else [int(e) for e in (
            eos if isinstance(eos, (list, tuple)) else [eos])])

    def _inferred_mask(self, ids: torch.Tensor, config: GenerationConfig) -> torch.Tensor | None:
        """The attention mask ``generate()`` builds when given none (``config``: the call's effective one):
        positions holding the pad id masked, if the pad id is set, occurs in ``ids`` and is no EOS id; None
        (every token counts) otherwise."""
        pad, eos = self._special_ids(config)
        if pad is None or pad in eos or not bool((ids == pad).any()):
            return None
        return ids.ne(pad).long()

    def _pad_id(self, config: GenerationConfig) -> int:
        """What ``generate()`` pads finished rows with under ``config`` (a call's effective configuration): the pad
        id, else the first EOS id (else 0)."""
        pad, eos = self._special_ids(config)
        return pad if pad is not None else (eos[0] if eos else 0)


def _noted(result: GenerationResult, miss: MissReason | None) -> GenerationResult:
    """``result`` with a cache diagnosis on its stats (and on ``last_call``, the same object)."""
    if miss is not None:
        result.stats.miss_reason, result.stats.cache_missed_tokens = miss.type, miss.cache_missed_input_tokens
    return result


def _with_calls(result: GenerationResult, reading: ToolUse | None) -> GenerationResult:
    """``result`` with its tool calls parsed out (``reading``: how; None: unchanged)."""
    if reading is None:
        return result
    pieces = reading.read(result.text, result.finish_reason == "length")
    calls = tuple(calls_of(pieces))
    if not calls:
        return dataclasses.replace(result, text=text_of(pieces))
    finish = "length" if cut_short(pieces) else "tool_calls"  # a last call cut by max_tokens is incomplete
    return dataclasses.replace(result, text=text_of(pieces), tool_calls=calls, finish_reason=finish)


def _message_list(messages: Any) -> list[Any]:
    """Chat messages as a list; a string or one bare message is refused as such (``list()`` would make
    them characters or keys, and the error would be about those)."""
    if isinstance(messages, str):
        raise InvalidRequestError("messages must be a list of message objects such as {'role': 'user', "
                                  "'content': '...'}, got a string (complete() continues a text prompt)",
                                  param="messages")
    if isinstance(messages, dict):
        raise InvalidRequestError("messages must be a list of message objects, got one message: put it in a list",
                                  param="messages")
    return list(messages)


def _salt(cache_salt: Any) -> str:
    if not isinstance(cache_salt, str):
        raise InvalidRequestError("cache_salt must be a string", param="cache_salt")
    return cache_salt


def _list_ids(value: Any) -> torch.Tensor:
    """Token ids given as a list (or a list of equally long lists) as a long tensor ``[batch, seq]`` or ``[seq]``.

    Rows of plain ints go through ``array`` (several times faster than ``torch.tensor`` on a long
    prompt, which a hit pays on every call); anything else is left to ``torch.tensor``."""
    if isinstance(value, (list, tuple)) and value:
        rows = value if isinstance(value[0], (list, tuple)) else None
        try:
            if rows is None:
                return long_tensor(value)
            if all(isinstance(r, (list, tuple)) and len(r) == len(rows[0]) for r in rows) and rows[0]:
                return long_tensor(rows[0] if len(rows) == 1 else [t for r in rows for t in r]).view(len(rows), -1)
        except TypeError:
            pass  # not integers (floats, strings, tensors): torch decides, as before
    return torch.tensor(value, dtype=torch.long)


def _check_left_padded(attention_mask: torch.Tensor, inferred: bool) -> None:
    """Refuse right padding (a row whose ``attention_mask`` ends in zeros, ``[batch, seq]``): ``generate()``
    continues every row after its last column, so it would read such a row's first new token off a pad, and
    serving the row by its mask would answer otherwise than ``generate()`` does. Raises ``InvalidRequestError``."""
    right = torch.nonzero(attention_mask[:, -1] == 0).flatten().tolist()
    if right:
        how = " (inferred from the pad id, as generate() infers it; pass attention_mask to count it)" if inferred else ""
        raise InvalidRequestError(
            f"input row(s) {right} are right-padded: the attention_mask{how} ends in zeros. generate() continues each "
            "row after its last column, so a decoder-only model needs the batch padded on the left "
            "(tokenizer.padding_side = 'left')", param="attention_mask")
