"""Dispatch: which of the two engines serves a call, the call on it, and the hit counters it feeds.

Every call the batching engine reproduces exactly (``options.batch_params``: greedy or
sampled with temperature/top-p/top-k, penalties, logit bias, min/max new tokens, EOS ids,
stop strings, a streamer, seeds) runs there, so concurrent callers share its steps. The
rest (beam search, a caller's logits processors or stopping criteria, scores, attentions,
assistant models, a caller's ``past_key_values``, a model or sequence batching cannot
serve) runs on the serial engine; the reason is logged.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import GenerationConfig, StoppingCriteriaList

from prefixcache.cache.scope import Scope
from prefixcache.serving.blend import BLEND_LOST, BlendRequest
from prefixcache.serving.engine import BatchEngine, BatchResult
from prefixcache.serving.logprobs import RawLogits
from prefixcache.serving.options import AnswerOptions, batch_params
from prefixcache.serving.request import CallStats, Request, SamplingParams, finish_reason
from prefixcache.serving.sampling import OpenAIPenalties, stop_string_check
from prefixcache.serving.serial import SerialEngine, StreamCriteria
from prefixcache.serving.stats import HitCounters
from prefixcache.serving.text_stream import Halt, TextStream

log = logging.getLogger(__name__)


class Dispatcher:
    """Sends each call to the batching engine (``batcher``, None = off) or the ``serial`` engine, and
    counts every finished call in ``counters``."""

    def __init__(self, serial: SerialEngine, batcher: BatchEngine | None, cache_generated: bool):
        self.serial_engine, self.batcher, self.cache_generated = serial, batcher, cache_generated
        self.counters = HitCounters()

    def route(self, prompt_len: int, config: GenerationConfig,
              kwargs: dict[str, Any]) -> tuple[SamplingParams | None, str | None]:
        """A ``generate()`` call's ``SamplingParams`` when the batching engine serves it, else (None, why not);
        ``config``: the call's effective configuration (``SerialEngine.effective_config``)."""
        if self.batcher is None:
            return None, "batching is off"
        return self._servable(prompt_len, *batch_params(config, kwargs, prompt_len))

    def route_answer(self, prompt_len: int, options: AnswerOptions) -> tuple[SamplingParams | None, str | None]:
        """An OpenAI-shaped call's ``SamplingParams`` when the batching engine serves it, else (None, why not)."""
        if self.batcher is None:
            return None, "batching is off"
        config = self.serial_engine.effective_config(None, options.extra)
        return self._servable(prompt_len, *options.batch_params(config, prompt_len))

    def _servable(self, prompt_len: int, params: SamplingParams | None,
                  reason: str | None) -> tuple[SamplingParams | None, str | None]:
        if params is not None:
            reason = self.batcher.unservable(prompt_len, params)
        if reason is not None:
            log.debug("served by the serial engine: %s", reason)
            return None, reason
        return params, None

    def generate_batched(self, rows: Sequence[torch.Tensor], params: Sequence[SamplingParams],
                         scope: Scope, kwargs: dict[str, Any],
                         timeout: float | None = None) -> tuple[list[torch.Tensor], CallStats]:
        """New tokens of each row (``rows[i]``: [n_i]) and the last row's stats. The rows share the
        engine's steps; with a streamer they run one after another, as ``generate()`` streams one.
        ``timeout`` bounds each row's wait; a row that fails cancels the rows still running."""
        streamer = kwargs.get("streamer")
        stop = stop_string_check(params[0].stop_strings, kwargs["tokenizer"]) if params[0].stop_strings else None

        def submit(row: torch.Tensor, p: SamplingParams):
            on_token = None
            if streamer is not None:
                streamer.put(row.unsqueeze(0).cpu())  # generate() hands the prompt over first
                on_token = lambda t: streamer.put(torch.tensor([t]))  # noqa: E731
            return self.batcher.submit(row.tolist(), scope, p, on_token, None, stop)

        def result(req, row: torch.Tensor) -> tuple[torch.Tensor, CallStats]:
            res = self.wait(req, timeout)
            if streamer is not None:
                streamer.end()
            return torch.tensor(res.tokens, dtype=row.dtype, device=row.device), res.stats

        if streamer is not None:
            done = [result(submit(r, p), r) for r, p in zip(rows, params)]
        else:
            reqs = [submit(r, p) for r, p in zip(rows, params)]
            try:
                done = [result(req, r) for req, r in zip(reqs, rows)]
            except BaseException:
                for req in reqs:  # nobody will read them: they leave at the next step
                    req.abandoned.set()
                raise
        return [tokens for tokens, _ in done], done[-1][1]

    def answer_batched(self, prompt: list[int], params: SamplingParams, scope: Scope, stream: TextStream,
                       cancel: threading.Event | None, timeout: float | None = None,
                       adjust: Callable[[CallStats], None] | None = None,
                       counted: int | None = None) -> tuple[list[int], CallStats, str]:
        """(new tokens, stats, finish reason); a stop string seen by ``stream`` halts the request. ``adjust``
        completes the stats before they are counted; ``counted``: the cached tokens counted (``wait``)."""
        stream.put(torch.tensor(prompt))  # the stream skips the prompt, as with generate()
        req = self.batcher.submit(prompt, scope, params, lambda t: stream.put(torch.tensor([t])), Halt(cancel, stream),
                                  logprobs=stream.logprobs)
        res = self.wait(req, timeout, adjust, counted)
        stream.end()
        return res.tokens, res.stats, res.finish_reason

    def answer_blended(self, prompt: list[int], blend: BlendRequest, params: SamplingParams, scope: Scope,
                       stream: TextStream, cancel: threading.Event | None, timeout: float | None = None,
                       counted: int | None = None) -> tuple[list[int], CallStats, str]:
        """A blending call on the batching engine: the serial engine blends the prompt's KV and stores it in
        the prompt's blended scope (``SerialEngine.blend_ahead``), the batching engine answers from there in
        its shared steps. Stats as the serial engine reports a blended call (cached = exact tokens reused)."""
        ahead = CallStats()
        served_in, first_sight, stored, tally = self.serial_engine.blend_ahead(prompt, blend, scope, ahead)

        def adjust(stats: CallStats) -> None:
            if first_sight:  # its answer is out: now its documents, for later calls
                ahead.chunk_stored_tokens = self.serial_engine.store_documents(prompt, blend, ahead.cached_tokens,
                                                                               scope)
            if served_in is not scope:  # the engine's hit was the blended KV: the exact part is what was cached
                if stats.cached_tokens < stored:  # partly evicted before the engine read it: the rest prefilled
                    assert tally is not None  # the blended scope serves a call only once something was blended
                    read = stats.cached_tokens  # the head the engine read: what of the blend the answer used
                    ahead.chunk_reused_tokens, ahead.chunk_recomputed_tokens = tally.within(read)
                    ahead.cached_tokens = min(ahead.cached_tokens, read)
                    ahead.blend_reason = BLEND_LOST
                stats.cached_tokens, stats.stored_tokens = ahead.cached_tokens, ahead.stored_tokens
            stats.lookup_seconds += ahead.lookup_seconds  # the blend's time counts in the call's first token
            if stats.ttft_seconds is not None:
                stats.ttft_seconds += ahead.lookup_seconds
            stats.total_seconds += ahead.lookup_seconds
            stats.chunk_reused_tokens, stats.chunk_recomputed_tokens = ahead.chunk_reused_tokens, \
                ahead.chunk_recomputed_tokens
            stats.chunk_stored_tokens, stats.blend_reason = ahead.chunk_stored_tokens, ahead.blend_reason

        return self.answer_batched(prompt, params, served_in, stream, cancel, timeout, adjust, counted)

    def answer_serial(self, prompt: list[int], options: AnswerOptions, stream: TextStream, scope: Scope,
                      device: torch.device, pad_id: int,
                      blend: BlendRequest | None = None) -> tuple[list[int], CallStats, str]:
        """(new tokens, stats, finish reason) from the serial engine; ``stream`` is the call's streamer
        (which also ends the call at a stop string); ``blend``: the prompt's marked chunks, reused
        (``serving/blend.py``)."""
        gen = options.generate_kwargs()
        gen.setdefault("pad_token_id", pad_id)
        penalties = options.penalties()
        if penalties:
            processor = OpenAIPenalties(SamplingParams(**penalties), len(prompt))
            gen["logits_processor"] = [*(gen.get("logits_processor") or []), processor]
        if options.constraint is not None:  # after the penalties, before the warpers, as in ``Sampler``
            gen["logits_processor"] = [*(gen.get("logits_processor") or []), options.constraint.processor(len(prompt))]
        # The text stream sees each token in a stopping criterion, before that criterion answers, so a stop
        # string it finds ends generation at that token, as on the batching engine (no per-request tables
        # for the stop strings, as ``stop_strings`` would build).
        criteria = StoppingCriteriaList(gen.pop("stopping_criteria", None) or [])
        stream.put(torch.tensor(prompt))  # the stream skips the prompt, as with generate()
        with contextlib.ExitStack() as held:
            raw = None if options.logprobs is None else held.enter_context(RawLogits(self.serial_engine.model))
            criteria.append(StreamCriteria(stream, Halt(options.cancel, stream), raw, options.logprobs))
            gen["stopping_criteria"] = criteria
            out, stats = self.serial(torch.tensor([prompt], device=device), scope, None, gen, blend,
                                     options.counted_cached_tokens)
        stream.end()
        new = out[0, len(prompt):].tolist()
        eos = options.eos_ids(self.serial_engine.effective_config(None, options.extra))
        params = SamplingParams(max_new_tokens=options.max_new_tokens, eos_token_ids=eos)
        return new, stats, finish_reason(new, params, False, options.cancelled)

    def serial(self, ids: torch.Tensor, scope: Scope, generation_config: GenerationConfig | None,
               kwargs: dict[str, Any], blend: BlendRequest | None = None,
               counted: int | None = None) -> tuple[Any, CallStats]:
        """``generate()`` on the serial engine for one prompt ``ids``: [1, n] (with ``blend``, its marked chunks
        reused); ``counted``: the cached tokens counted (``wait``)."""
        out, stats = self.serial_engine.generate(ids, scope, generation_config, kwargs, self.cache_generated, blend)
        self.counters.record(scope.tenant, stats, counted)
        return out, stats

    def wait(self, req: Request, timeout: float | None,
             adjust: Callable[[CallStats], None] | None = None, counted: int | None = None) -> BatchResult:
        """The batched request's result (``BatchEngine.wait``: a timeout or fault raises, typed); ``adjust``
        completes its stats before they are counted; ``counted``: the cached tokens the counters record
        instead of those it read (``AnswerOptions.counted_cached_tokens``), its stats left as they are."""
        res = self.batcher.wait(req, timeout)
        if adjust is not None:
            adjust(res.stats)
        self.counters.record(req.scope.tenant, res.stats, counted)
        return res
