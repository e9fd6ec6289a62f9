"""Serving: the engine behind a bounded, fair queue; the event loop only ever awaits.

At most ``workers + max_queue`` requests are admitted (more get 429), at most
``tenant_max_in_flight`` of one tenant key, and the tenants' queues are served in turn
(``Admission``). A worker encodes the prompt and runs ``PrefixCache.chat``/``complete``.
Text deltas cross into the event loop with ``call_soon_threadsafe``. Every job owns a
``threading.Event``: a client disconnect, a timeout or shutdown sets it, generation
stops at the next token (a job still queued leaves the queue at once and never starts),
and the SDK then releases the job's pins.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import xxhash

from prefixcache import CacheUsage, GenerationResult, PrefixCache, TokenLogprob, WarmResult
from prefixcache.cache.scope import Scope
from prefixcache.errors import ContextLengthExceededError, InvalidRequestError
from prefixcache.planner.request_log import RequestLog
from prefixcache.serving.diagnostics import MissReason
from prefixcache.serving.messages import MessagesPrompt, to_chat
from prefixcache.serving.options import seconds
from prefixcache.serving.prompt_cache import text_breakpoints
from prefixcache.serving.request import CallStats
from prefixcache.serving.stats import CacheReport

from .admission import Admission, Place, Skipped
from .errors import ClientClosedError, RequestTimeoutError, UnavailableError
from .jobs import Job
from .logprobs import TokenText
from .metrics import Metrics
from .settings import LOCAL_TENANT, Settings

T = TypeVar("T")
SERVED, CUT_SHORT = "served", "cut short"  # the two claims on a request's count (``Outcome``)
#: How often a choice waiting for its request's prompt to be prefilled checks its cancel event.
SHARED_POLL_SECONDS = 0.05
Emit = Callable[[str, Any], None]
log = logging.getLogger(__name__)


class Serving:
    """Owns the worker pool and admission for one ``PrefixCache``."""

    def __init__(self, cache: PrefixCache, settings: Settings, metrics: Metrics,
                 clock: Callable[[], float] = time.perf_counter, request_log: RequestLog | None = None):
        self.cache, self.settings, self.metrics = cache, settings, metrics
        self.request_log = request_log
        self._clock = clock
        self.capacity = settings.workers + settings.max_queue
        exempt = {settings.admin_tenant} | ({LOCAL_TENANT} if settings.local_mode else set())
        self.admission = Admission(settings.workers, self.capacity, settings.tenant_places, exempt,
                                   lambda seconds: self.metrics.queue_wait.observe(seconds), clock)
        self._logged: dict[str, str] = {}  # the last detail logged of each health failure
        self.model_name = settings.served_model_name or cache.model_id or "default"
        self.vocab_size = int(cache.model.config.get_text_config(decoder=True).vocab_size)
        self.system_fingerprint = "fp_" + xxhash.xxh64_hexdigest(repr(cache.namespace("")).encode())[:12]
        self.created = int(time.time())
        self.tool_family = cache.tool_family
        #: Token ids to their text and bytes for logprobs, worked out once each for the server's tokenizer.
        self.token_text = TokenText(cache.tokenizer)

    # -- state ---------------------------------------------------------------------
    def queue(self) -> tuple[int, int]:
        """(running, waiting)."""
        return self.admission.counts()

    @property
    def closing(self) -> bool:
        return self.admission.closing

    @closing.setter
    def closing(self, value: bool) -> None:
        self.admission.closing = value

    @property
    def ready(self) -> bool:
        return self.admission.ready

    def check_engine(self) -> None:
        """Raise ``UnavailableError`` (503) if the batching loop stopped: the process needs a restart.

        Calls still run meanwhile, one at a time on the serial engine. The health routes answer anyone, so
        the reason is fixed; what failed goes to the log (and to the admin's stats).
        """
        failure = self.cache.engine_failure
        if failure is not None:
            self._log_once("engine_failed", f"the batching loop stopped: {failure}")
            raise UnavailableError("the batching loop stopped; calls run one at a time until the server is "
                                   "restarted", code="engine_failed")

    def check_steps(self) -> None:
        """Raise ``UnavailableError`` (503) while the batching loop's recent steps all fail (not ready:
        a balancer should send requests elsewhere); it clears after a good step or a quiet window."""
        faulting = self.cache.engine_faulting
        if faulting is not None:
            self._log_once("engine_faulting", f"not ready: {faulting}")
            raise UnavailableError("not ready: the batching engine's recent steps failed", code="engine_faulting")

    def _log_once(self, kind: str, detail: str) -> None:
        """Log a health failure's detail when it changes (a balancer's probes would repeat it every second)."""
        if self._logged.get(kind) != detail:
            self._logged[kind] = detail
            log.error("%s", detail)

    def reported_cached(self, tokens: int) -> int:
        """Cached tokens as answers report them: exact, or rounded down to whole blocks
        (``cached_tokens_granularity``)."""
        if self.settings.cached_tokens_granularity == "block":
            return tokens - tokens % self.cache.config.block_size
        return tokens

    def engine_state(self) -> tuple[CacheReport, int, int]:
        """What /metrics reads at scrape time: the cache report of all tenants, running, waiting."""
        running, waiting = self.queue()
        return self.cache.report(), running, waiting

    # -- generation ----------------------------------------------------------------
    async def run(self, job: Job, disconnected: Callable[[], Awaitable[None]] | None = None,
                  place: Place | None = None) -> GenerationResult:
        """Run ``job`` to the end (in ``place``, if its request reserved one); 504 after the timeout, 499 if
        ``disconnected`` resolves first."""
        start = self._clock()
        counted = Outcome()
        try:
            fut, cancel = self._submit(lambda c: self._execute(job, c, None, counted), job.tenant, place=place)
            return await self._wait(fut, cancel, disconnected, counted)
        finally:
            self.metrics.duration.labels(job.label).observe(self._clock() - start)

    async def run_choices(self, jobs: list[Job], disconnected: Callable[[], Awaitable[None]] | None = None,
                          place: Place | None = None) -> list[GenerationResult]:
        """``run`` of a request's choices (``jobs``), submitted together, each in a place of the key's (``place``
        and ``len(jobs) - 1`` more, reserved first: 429 if the key or the queue has not that many). The first
        failure fails the request and cancels the other choices; a disconnect or the timeout cancels them all
        (499, 504), unless every choice was already counted as served (the answers are then returned)."""
        if len(jobs) == 1:
            return [await self.run(jobs[0], disconnected, place)]
        start = self._clock()
        counted = [Outcome() for _ in jobs]
        places = self._places(jobs[0].tenant, place, len(jobs))
        futs: list[asyncio.Future[GenerationResult]] = []
        cancels: list[threading.Event] = []
        try:
            for job, taken, outcome in zip(jobs, places, counted):
                fut, cancel = self._submit(lambda c, job=job, outcome=outcome: self._execute(job, c, None, outcome),
                                           job.tenant, place=taken)
                futs.append(fut)
                cancels.append(cancel)
            every = asyncio.gather(*futs)  # done when all are, or at the first failure
            every.add_done_callback(lambda f: f.cancelled() or f.exception())
            ended = await _race(every, disconnected, self.settings.request_timeout_seconds)
            if ended == "done":
                for fut in futs:
                    if fut.done() and (fut.cancelled() or fut.exception() is not None):
                        _unwrap(fut)  # raises: the other choices are cancelled below
                return [fut.result() for fut in futs]
            for cancel in cancels:
                cancel.set()
            # Each choice is counted once, served or cut short (``Outcome``).
            if not any([outcome.claim(CUT_SHORT) for outcome in counted]):
                await asyncio.wait(futs)  # all handed over already: the workers are returning them
                return [_unwrap(fut) for fut in futs]
            if ended == "disconnected":
                raise ClientClosedError("the client closed the connection; the generation was cancelled")
            raise RequestTimeoutError(f"the request did not finish within "
                                      f"{self.settings.request_timeout_seconds:g} s and was cancelled")
        except BaseException:
            for cancel in cancels:  # a failure, or the request's task cancelled: no choice goes on
                cancel.set()
            raise
        finally:
            _give_back(places)
            self.metrics.duration.labels(jobs[0].label).observe(self._clock() - start)

    def _places(self, tenant: str, place: Place | None, n: int) -> list[Place | None]:
        """``place`` and ``n - 1`` more of ``tenant``'s, one per choice (no place: None each, as ``submit``
        then checks each). Raises what ``Admission.reserve`` raises, giving back those it took."""
        if place is None:
            return [None] * n
        places: list[Place | None] = [place]
        try:
            for _ in range(n - 1):
                places.append(self.admission.reserve(tenant))
        except BaseException:
            _give_back(places[1:])
            raise
        return places

    async def open_stream(self, job: Job, disconnected: Callable[[], Awaitable[None]] | None = None,
                          place: Place | None = None) -> GenerationStream:
        """Start ``job`` streaming; returns once its prompt is encoded and checked.

        Errors found before generation (bad messages, context length, queue full)
        raise here, so they still get their HTTP status; later ones end the stream.
        A client that leaves while the job waits in the queue cancels it (499).
        """
        stream = self._start(job, place)
        try:
            await _unless_disconnected(stream.wait_started(), disconnected)
        except BaseException:
            stream.close()
            raise
        return stream

    async def open_streams(self, jobs: list[Job], disconnected: Callable[[], Awaitable[None]] | None = None,
                           place: Place | None = None) -> list[GenerationStream]:
        """``open_stream`` of a request's choices (``jobs``, submitted together, each in a place of the key's:
        ``place`` and ``len(jobs) - 1`` more); returns once the first has started (its prompt, the others' too,
        encoded and checked), so a choice still waiting for a worker holds back no other's text. The first
        failing to start, or the client leaving meanwhile, closes them all; a later choice's failure ends the
        stream."""
        if len(jobs) == 1:
            return [await self.open_stream(jobs[0], disconnected, place)]
        places = self._places(jobs[0].tenant, place, len(jobs))
        streams: list[GenerationStream] = []
        try:
            for i, (job, taken) in enumerate(zip(jobs, places)):
                streams.append(self._start(job, taken, timed=i == 0))
            await _unless_disconnected(streams[0].wait_started(), disconnected)
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        finally:
            _give_back(places)
        return streams

    def _start(self, job: Job, place: Place | None, timed: bool = True) -> GenerationStream:
        """Submit ``job`` to stream; ``timed``: its end observes the request's duration."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def emit(kind: str, value: Any) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, (kind, value))
            except RuntimeError:  # the loop closed (shutdown): nobody is listening
                pass

        start = self._clock()
        fut, cancel = self._submit(lambda c: self._execute(job, c, emit), job.tenant, place=place)
        fut.add_done_callback(lambda f: events.put_nowait(("done", f)))
        return GenerationStream(events, cancel, loop.time() + self.settings.request_timeout_seconds,
                                (lambda: self.metrics.duration.labels(job.label).observe(self._clock() - start))
                                if timed else (lambda: None), fut)

    async def prewarm(self, tenant: str, prefix: str | list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      pin: bool, ttl_seconds: float | None, privileged: bool = False,
                      disconnected: Callable[[], Awaitable[None]] | None = None, cache_salt: str | None = None,
                      place: Place | None = None) -> WarmResult:
        """Encode the prefix, refuse it over ``max_prewarm_tokens`` (or the context), then prefill it
        (under ``cache_salt``, if given): a queue place as a generation, and cancelled likewise (timeout 504,
        disconnect 499)."""
        def warm(cancel: threading.Event) -> WarmResult:
            ids = self._prefix_ids(prefix, tools)
            # Cancelled (between prefill chunks) by a disconnect, the timeout or shutdown, as a generation.
            return self.cache.warm(ids, tenant=tenant, pin=pin, ttl_seconds=ttl_seconds, privileged=privileged,
                                   cancel=cancel, timeout_seconds=self.settings.request_timeout_seconds,
                                   cache_salt=cache_salt)

        fut, cancel = self._submit(warm, tenant, exempt=privileged, place=place)
        return await self._wait(fut, cancel, disconnected)

    def _prefix_ids(self, prefix: str | list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """Worker thread: the prefix's ids (``PrefixCache.encode_prefix``), refused over the prewarm limit."""
        cache = self.cache
        ids = cache.encode_prefix(prefix, tools)
        param = "prompt" if isinstance(prefix, str) else "messages"
        # The settings' cap and the cache's own (a cache passed to ``create_app`` has a configuration of its own).
        limit = min(self.settings.max_prewarm_tokens or cache.max_context, cache.max_prewarm_tokens)
        if len(ids) > limit:
            raise ContextLengthExceededError(f"the prefix is {len(ids)} tokens; a prewarm fills at most {limit} "
                                             f"(the model's context is {cache.max_context})", param=param)
        return ids

    # -- calls beside the queue (no model, no queue place: the side threads) ----------
    async def side(self, fn: Callable[[], T], place: Place | None = None) -> T:
        """``fn()`` on the side threads (not the event loop's default pool), in ``place`` if its request
        reserved one (given back when ``fn`` ends)."""
        # Cancelled (the request's task is), the call is too if it has not started (its place is given back).
        return await asyncio.wrap_future(self.admission.run_side(fn, place))

    async def report(self, tenant: str | None, place: Place | None = None) -> CacheReport:
        return await self.side(lambda: self.cache.report(tenant), place)

    async def flush(self, tenant: str | None, place: Place | None = None) -> int:
        """Drop ``tenant``'s prefixes (None: all) from the device and the tiers below (``TierPurgeError``,
        503, if a tier could not be reached)."""
        return await self.side(lambda: self.cache.flush(tenant), place)

    async def aclose(self) -> None:
        """Refuse new work, cancel what runs, and wait for the workers to stop (one token each)."""
        self.admission.close()
        await asyncio.to_thread(self.admission.shutdown)

    # -- internals -----------------------------------------------------------------
    def _submit(self, work: Callable[[threading.Event], T], tenant: str, exempt: bool = False,
                place: Place | None = None) -> tuple[asyncio.Future[T], threading.Event]:
        """``Admission.submit``, awaitable."""
        result, cancel = self.admission.submit(work, tenant, exempt, place)
        fut = asyncio.wrap_future(result)
        # Retrieved here, so an abandoned job never logs "exception never retrieved".
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        return fut, cancel

    async def _wait(self, fut: asyncio.Future[T], cancel: threading.Event,
                    disconnected: Callable[[], Awaitable[None]] | None, counted: Outcome | None = None) -> T:
        """``fut``'s result; 499 if ``disconnected`` resolves first, 504 after the timeout, unless the worker
        already counted its answer as served in ``counted`` (that answer is then returned, counted once)."""
        try:
            outcome = await _race(fut, disconnected, self.settings.request_timeout_seconds)
        except asyncio.CancelledError:
            cancel.set()
            raise
        if outcome == "done":
            return _unwrap(fut)
        cancel.set()
        if counted is not None and not counted.claim(CUT_SHORT):
            await asyncio.wait([fut])  # handed over already: the worker is returning it
            return _unwrap(fut)
        if outcome == "disconnected":
            raise ClientClosedError("the client closed the connection; the generation was cancelled")
        raise RequestTimeoutError(f"the request did not finish within {self.settings.request_timeout_seconds:g} s "
                                  "and was cancelled")

    def _execute(self, job: Job, cancel: threading.Event, emit: Emit | None,
                 counted: Outcome | None = None) -> GenerationResult:
        """Worker thread: encode, check the context, generate, record metrics (an answer as served unless
        ``counted`` says its request's handler counted it cut short first)."""
        cache = self.cache
        prompt = None
        chunks: dict[str, Any] = {}  # a chat prompt's marked parts (``AnswerOptions.chunks``, ``unplaced``)
        try:
            if job.endpoint == "messages":
                prompt = cache.encode_messages(**job.anthropic)
            elif job.breakpoints and job.endpoint == "chat":  # OpenAI's breakpoints, written as Anthropic's are
                prompt = cache.encode_chat_breakpoints(job.messages, job.tools, mode=job.cache_mode, ttl=job.cache_ttl,
                                                       continue_final=job.continue_final)
            elif job.breakpoints:
                text = cache.encode_text(job.prompt)
                prompt = MessagesPrompt(tuple(text), text_breakpoints(text, job.cache_mode, job.cache_ttl))
            if prompt is not None:
                ids = list(prompt.token_ids)
            else:
                encoded = cache.encode_chat_prompt(job.messages, job.tools, continue_final=job.continue_final) \
                    if job.endpoint == "chat" else None
                ids = list(encoded.token_ids) if encoded is not None else cache.encode_text(job.prompt)
                if encoded is not None and (encoded.chunks or encoded.unplaced):
                    chunks = {"chunks": encoded.chunks, "unplaced": encoded.unplaced}
        except UnicodeError as exc:  # protocol validation should have caught it; never a 500
            raise InvalidRequestError(f"the text cannot be encoded: {exc}") from exc
        max_new = job.max_new_tokens(len(ids), cache.max_context, self.settings.default_max_tokens)
        miss = self._diagnose(job, ids) if job.diagnose else None
        scope = cache.scope(job.tenant, job.cache_salt, job.ttl_seconds)
        # The timeout bounds this worker thread too: a generation still running then is cancelled.
        options = dataclasses.replace(job.options, max_new_tokens=max_new, cancel=cancel,
                                      timeout_seconds=seconds(self.settings.request_timeout_seconds, "timeout"),
                                      on_text=None if emit is None else (lambda text: emit("text", text)),
                                      on_logprobs=None if emit is None or job.options.logprobs is None else (
                                          lambda entries: emit("logprobs", entries)), **chunks)
        # Checked (a response format bound to the vocabulary) before a stream says it has begun: what cannot be
        # answered is a 400, not an error event after the 200.
        options = cache.checked(ids, options)
        if emit is not None:  # a messages stream reports its cache usage up front, as Anthropic's does
            predicted = None if prompt is None else cache.breakpoints.predict(scope, ids, prompt.breakpoints)
            emit("started", (len(ids), predicted, miss))
        if job.shared is not None:
            self._share_prompt(job, ids, scope, prompt is None and not chunks, cancel)
            if job.shared.read is not None:  # each choice counted by the one prefill's read, as one choice would be
                options = dataclasses.replace(options, counted_cached_tokens=job.shared.read)
        # The ids encoded above: no second encoding.
        if prompt is None:
            held = cache.breakpoints.held(scope, ids)
            result = cache.run(ids, options, scope)
            # Without breakpoints, what it wrote is what it stored: the prompt tokens held now and not before.
            read = result.usage.cached_tokens
            written = max(0, cache.breakpoints.held(scope, ids) - max(held, read))
            result = dataclasses.replace(result, cache=CacheUsage(len(ids) - read - written, read, written, 0, 0))
        else:
            result = cache.run_messages(prompt, options, scope)
        if miss is not None:
            result.stats.miss_reason, result.stats.cache_missed_tokens = miss.type, miss.cache_missed_input_tokens
        # A generation cut short (timeout, client gone, shutdown) is counted by its error status only, as when
        # the engine's own timer ends it first: the served-generation counters hold answers delivered.
        if result.finish_reason != "cancelled" and (counted is None or counted.claim(SERVED)):
            self._observe(job, result.stats)
        if self.request_log is not None:
            self.request_log.record(job.tenant, ids, result.token_ids, result.stats.cached_tokens,
                                    self._held_tokens(len(ids), result))
        if result.finish_reason == "cancelled" and self.closing:  # cut short by shutdown: not an answer
            raise UnavailableError("the server is shutting down; the generation was cancelled", code="shutting_down")
        return result

    def _observe(self, job: Job, stats: CallStats) -> None:
        """Worker thread: count a served generation in the request counters. A request's choices count as one
        request, once all are served (one cut short leaves it to its error's count, never both): choice 0's
        stats with the prompt, by what its one prefill ahead read (when prefilled ahead: what the request's
        usage reports), and the choices' completion tokens summed."""
        shared = job.shared
        if shared is not None:
            every = shared.served(job.choice, stats)
            if every is None:
                return
            stats = every[0] if shared.read is None else dataclasses.replace(every[0], cached_tokens=shared.read)
            self.metrics.completion_tokens.labels(job.tenant).inc(sum(s.completion_tokens for s in every[1:]))
        self.metrics.observe(job.label, job.tenant, stats)
        self.metrics.observe_cache_hints(job.tenant, job.cache_key, job.retention, stats)

    def _share_prompt(self, job: Job, ids: list[int], scope: Scope, warmable: bool, cancel: threading.Event) -> None:
        """Worker thread, a choice of a request asking for several: the first prefills the prompt once and
        stores it (``PrefixCache.warm``: what it read and wrote is the request's usage), the others wait for it
        (or their cancel) and read it from the cache. A prompt with breakpoints or chunks is not prefilled ahead
        (the batching engine still holds a choice arriving while another prefills it); a prefill that fails
        leaves each choice to compute what the cache lacks."""
        shared = job.shared
        assert shared is not None
        if job.choice > 0:
            while not shared.ready.wait(SHARED_POLL_SECONDS) and not cancel.is_set():
                pass
            return
        try:
            if warmable:
                cache = self.cache
                held = cache.breakpoints.held(scope, ids)
                warm = cache.warm(ids, tenant=job.tenant, ttl_seconds=job.ttl_seconds, cancel=cancel,
                                  timeout_seconds=seconds(self.settings.request_timeout_seconds, "timeout"),
                                  cache_salt=job.cache_salt)
                # The choices recompute the prompt's last token (its logits), as one choice would: never all cached.
                shared.read = min(warm.cached_tokens, len(ids) - 1)
                shared.written = max(0, cache.breakpoints.held(scope, ids) - max(held, warm.cached_tokens))
        except Exception as exc:  # noqa: BLE001 - the choices go on; each computes what the cache lacks
            if not cancel.is_set():
                log.warning("could not prefill the prompt of %s choices ahead: %s", job.label, exc)
        finally:
            shared.ready.set()

    def _diagnose(self, job: Job, ids: list[int]) -> MissReason | None:
        """Worker thread: cache diagnostics of a chat or messages job (its fingerprint kept under its id)."""
        if job.endpoint == "messages":
            p = job.anthropic
            chat, tools = to_chat(p["messages"], p.get("system"), p.get("tools") or [])
            choice = p.get("tool_choice")
        else:
            chat, tools, choice = job.messages or [], job.tools, job.tool_choice
        return self.cache.diagnose(chat, tools, ids, tenant=job.tenant, cache_salt=job.cache_salt,
                                   tool_choice=choice, previous_id=job.previous_id, record_id=job.record_id)

    def _held_tokens(self, prompt_len: int, result: GenerationResult) -> int:
        """Tokens the engine stores for a finished request: the prompt, and the answer but its last token
        (no KV computed for it) when answers are cached; none when the request bypassed the cache."""
        if result.stats.bypass_reason is not None:
            return 0
        if not self.cache.config.cache_generated:
            return prompt_len
        return prompt_len + max(len(result.token_ids) - 1, 0)


class Outcome:
    """How a request that does not stream is counted, decided once: the first of its worker (an answer: served)
    and its handler (its client gone or its time up: an error status) to claim it counts it; the other does not."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by: str | None = None

    def claim(self, by: str) -> bool:
        """Whether ``by`` (``SERVED`` or ``CUT_SHORT``) counts the request: it claimed it first."""
        with self._lock:
            if self._by is None:
                self._by = by
            return self._by == by


class GenerationStream:
    """A streamed generation: ``prompt_tokens`` (and a messages request's ``predicted`` cache usage) once
    started, then text deltas, then ``result``."""

    def __init__(self, events: asyncio.Queue[tuple[str, Any]], cancel: threading.Event, deadline: float,
                 on_close: Callable[[], None], job: asyncio.Future[GenerationResult]):
        self._events, self._cancel, self._deadline, self._on_close = events, cancel, deadline, on_close
        self._job = job
        self._closed = False
        self.prompt_tokens = 0
        self.predicted: CacheUsage | None = None
        self.miss: MissReason | None = None  # cache diagnostics, when the job asked (None: no divergence)
        self.result: GenerationResult | None = None
        self._logprobs: list[TokenLogprob] = []

    def take_logprobs(self) -> list[TokenLogprob]:
        """The logprobs that came since the last call (where the job asks for them): a text delta's tokens' once
        ``texts`` yielded it, the last tokens' (whose text was all sent, or none) once it ended."""
        taken, self._logprobs = self._logprobs, []
        return taken

    async def wait_started(self) -> None:
        kind, value = await self._next()
        if kind == "started":
            self.prompt_tokens, self.predicted, self.miss = value
        else:  # the job ended before it started: it failed
            _unwrap(value)
            raise UnavailableError("the generation ended before it started")

    async def texts(self) -> AsyncIterator[str]:
        """Text deltas until the generation ends; then ``result`` is set. Raises the job's error. (A start not
        waited for, a later choice's, is passed over.)"""
        while True:
            kind, value = await self._next()
            if kind == "text":
                yield value
            elif kind == "logprobs":  # they come before their text
                self._logprobs.extend(value)
            elif kind == "done":
                self.result = _unwrap(value)
                return

    def close(self) -> None:
        """Stop the generation (if it still runs). Idempotent; called when the client goes."""
        self._cancel.set()
        if not self._closed:
            self._closed = True
            self._on_close()

    def when_cut_short(self, action: Callable[[], None]) -> None:
        """Run ``action`` once the generation has ended, if it did not end as an answer (cancelled, never
        started, or failed): ``_execute`` counts the rest as served, so either counts a generation, never both."""
        self.when_ended(lambda cut_short: cut_short and action())

    def when_ended(self, action: Callable[[bool], object]) -> None:
        """Run ``action(cut_short)`` once the generation has ended (``when_cut_short``)."""
        def ended(job: asyncio.Future[GenerationResult]) -> None:
            action(job.cancelled() or job.exception() is not None or job.result().finish_reason == "cancelled")

        self._job.add_done_callback(ended)

    async def _next(self) -> tuple[str, Any]:
        remaining = self._deadline - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(self._events.get(), timeout=max(remaining, 0.0))
        except asyncio.TimeoutError:  # the builtin TimeoutError from 3.11
            self._cancel.set()
            raise RequestTimeoutError("the request did not finish in time and was cancelled") from None


class StreamGroup:
    """The streams of a request's choices as ``tail`` ends them: closed together, and counted cut short once
    (after all have ended) if any did not end as an answer."""

    def __init__(self, streams: list[GenerationStream]):
        self.streams = streams

    def close(self) -> None:
        for stream in self.streams:
            stream.close()

    def when_cut_short(self, action: Callable[[], None]) -> None:
        left, cut = [len(self.streams)], [False]

        def ended(cut_short: bool) -> None:
            cut[0] = cut[0] or cut_short
            left[0] -= 1
            if not left[0] and cut[0]:
                action()

        for stream in self.streams:
            stream.when_ended(ended)


async def _race(task: asyncio.Future, disconnected: Callable[[], Awaitable[None]] | None,
                timeout: float | None) -> str:
    """Wait for ``task`` or the client's disconnect, whichever comes first, within ``timeout``.

    Returns "done", "disconnected" or "timeout"; the disconnect watcher never outlives the call.
    """
    watcher = asyncio.ensure_future(disconnected()) if disconnected is not None else None
    try:
        done, _ = await asyncio.wait([task] if watcher is None else [task, watcher], timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        if watcher is not None:
            watcher.cancel()
    if task in done:
        return "done"
    return "disconnected" if watcher is not None and watcher in done else "timeout"


async def _unless_disconnected(aw: Awaitable[T], disconnected: Callable[[], Awaitable[None]] | None) -> T:
    """Await ``aw``; if ``disconnected`` resolves first, cancel it and raise ``ClientClosedError``."""
    task = asyncio.ensure_future(aw)
    try:
        outcome = await _race(task, disconnected, None)
    except BaseException:
        task.cancel()
        raise
    if outcome == "done":
        return task.result()
    task.cancel()
    raise ClientClosedError("the client closed the connection before the stream started")


def _give_back(places: list[Place | None]) -> None:
    """Release the places no job took (``Place.release`` is a no-op on one a job took)."""
    for place in places:
        if place is not None:
            place.release()


def _unwrap(fut: asyncio.Future[T]) -> T:
    if fut.cancelled():
        raise UnavailableError("the server is shutting down", code="shutting_down")
    exc = fut.exception()
    if isinstance(exc, Skipped):
        raise RequestTimeoutError("the request was cancelled before it started")
    if exc is not None:
        raise exc
    return fut.result()
