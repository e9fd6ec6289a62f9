"""The generation engine: lookup → pin → build past_key_values → prefill suffix → decode → insert → unpin.

One request at a time holds the model (a lock); lookups and inserts go through the
store's own lock. Anything the cache cannot serve exactly (beam search, attention
outputs, a sequence longer than a sliding window…) runs as plain ``generate()`` and
is counted as a bypass, so the answer is always the uncached answer.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria

from prefixcache.cache.handles import Lease
from prefixcache.cache.ledger import Reservation
from prefixcache.cache.scope import Scope
from prefixcache.cache.store import KVStore
from prefixcache.errors import GenerationTimeoutError, RequestCancelledError, UnsupportedModelError
from prefixcache.model.hf_cache import Probe, WorkingCache, hand_out, probe
from prefixcache.model.threads import WorkerThreads
from prefixcache.serving.blend import (
    BLEND_FAILED,
    BLEND_UNSTORED,
    FIRST_SIGHT,
    Blender,
    BlendRequest,
    BlendTally,
    blended_scope,
)
from prefixcache.serving.logprobs import RawLogits, token_logprobs
from prefixcache.serving.options import bypass_reason
from prefixcache.serving.request import CallStats
from prefixcache.serving.sampling import fresh_seed

log = logging.getLogger(__name__)

#: Tokens a prewarm computes per forward; it checks for cancellation and its deadline between them.
PREWARM_CHUNK_TOKENS = 256

class StreamCriteria(StoppingCriteria):
    """Hands each new token to ``stream`` (a ``TextStream``), then stops once ``halt.is_set()`` (a stop string the
    stream saw, or a cancel). generate() asks its stopping criteria before it feeds a streamer, so a stop string
    found through a streamer would end generation one token late; here the stream sees the token first.
    With ``raw`` (the forwards' raw logits, ``logprobs.RawLogits``), the token's ``TokenLogprob`` with ``top``
    alternatives goes to ``stream.logprobs`` before the token goes to the stream."""

    def __init__(self, stream: Any, halt: Any, raw: RawLogits | None = None, top: int | None = None):
        self.stream, self.halt, self.raw, self.top = stream, halt, raw, top

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        token = input_ids[0, -1:].cpu()
        if self.raw is not None:
            self.stream.logprobs.extend(token_logprobs(self.raw.last[None], token.tolist(), [self.top or 0]))
        self.stream.put(token)
        return torch.full((input_ids.shape[0],), self.halt.is_set(), dtype=torch.bool, device=input_ids.device)


class _FirstTokenClock(LogitsProcessor):
    """Records when the first logits are ready (prefill done) without touching them."""

    def __init__(self, clock: Callable[[], float]):
        self._clock, self.at = clock, None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.at is None:
            self.at = self._clock()
        return scores


@contextlib.contextmanager
def isolated_rng(device: torch.device, seed: int) -> Iterator[None]:
    """Run the block with the RNG seeded to ``seed``, then restore the process's RNG state.

    ``generate()`` samples from the global RNG (it takes no generator), which other tenants
    and the host application also draw from: seeding it for one call would make their draws
    predictable, and drawing from it would shift theirs. The CPU state and every device of
    ``device``'s type are saved and put back (``torch.manual_seed`` seeds all of them).
    """
    kind = device.type
    module = None if kind in ("cpu", "meta") else torch.get_device_module(kind)
    devices = [] if module is None else list(range(module.device_count()))
    with torch.random.fork_rng(devices=devices, device_type="cpu" if module is None else kind):
        torch.manual_seed(seed)
        yield


class SerialEngine:
    """The serial engine: one call at a time holds the model. ``entropy`` seeds calls that give no
    ``seed`` (their RNG is isolated too). It counts nothing: its caller (``Dispatcher``) does."""

    def __init__(self, model: torch.nn.Module, store: KVStore, clock: Callable[[], float],
                 entropy: Callable[[], int] = fresh_seed, support: Probe | None = None,
                 threads: WorkerThreads | None = None):
        self.model = model
        self.store = store
        self._clock = clock
        self._entropy = entropy
        self._model_lock = threading.Lock()
        # The calling thread's CPU workers go back after each call (``model/threads.py``).
        self._threads = threads if threads is not None else WorkerThreads.of_torch()
        self.prewarm_chunk = PREWARM_CHUNK_TOKENS
        support = support if support is not None else probe(model)  # ``support``: probed by the caller
        self.layout, self.unsupported_reason = support.layout, support.unsupported_reason
        self.blender = Blender(model, self.layout, store)

    # -- public --------------------------------------------------------------------
    def generate(self, input_ids: torch.Tensor, scope: Scope, generation_config: GenerationConfig | None,
                 kwargs: dict[str, Any], cache_generated: bool,
                 blend: BlendRequest | None = None) -> tuple[Any, CallStats]:
        """Run ``model.generate`` for one prompt ``input_ids: [1, n]``, reusing cached KV of ``scope``; with
        ``blend``, the stored KV of its marked chunks too (``serving/blend.py``)."""
        start = self._clock()
        n = int(input_ids.shape[1])
        stats = CallStats(prompt_tokens=n, executor="serial")
        timer = _FirstTokenClock(self._clock)
        kwargs = dict(kwargs)
        seed = kwargs.pop("seed", None)
        kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []), timer])
        effective = self.effective_config(generation_config, kwargs)
        max_new = effective.max_new_tokens if effective.max_new_tokens is not None else max(
            int(effective.max_length or 20) - n, 1)
        stats.bypass_reason = self._bypass_reason(effective, kwargs, n + int(max_new))
        if blend is not None and stats.bypass_reason:
            stats.blend_reason, blend = stats.bypass_reason, None
        device = next(self.model.parameters()).device
        # Its working cache (or generate()'s own) holds the whole sequence: reserved against the KV
        # total first (bounded wait, or ``KVMemoryError``). Seeded inside the model lock, so
        # concurrent calls cannot interleave their draws.
        # A blended call's KV is built in that buffer; a document not stored yet is computed alone beside it.
        need = self._bytes(n + int(max_new) + _alone_room(blend))
        with self.store.ledger.reserve("serial", need) as held, self._holding_model(), \
                isolated_rng(device, seed if seed is not None else self._entropy()):
            if stats.bypass_reason is not None:
                # The row is unpadded already: every token counts (generate() would otherwise mask a pad id in it).
                out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                          generation_config=generation_config, **kwargs)
            else:
                out = self._cached_generate(input_ids, scope, generation_config, kwargs, cache_generated, max_new,
                                            stats, start, blend, held)
        seq = out.sequences if hasattr(out, "sequences") else out
        stats.completion_tokens = int(seq.shape[1]) - n
        stats.ttft_seconds = None if timer.at is None else timer.at - start
        stats.total_seconds = self._clock() - start
        return out, stats

    def blend_ahead(self, prompt: list[int], blend: BlendRequest, scope: Scope,
                    stats: CallStats) -> tuple[Scope, bool, int, BlendTally | None]:
        """For a blending call the batching engine serves: blend the prompt's KV now and store it where that
        engine finds it. Returns the scope to serve the call in, whether it is a first sight (its documents
        are then stored afterwards: ``store_documents``), how many leading tokens the engine should find
        stored there and, when that is the blended scope, where its chunk tokens came from (to count what
        the engine read of it, should part of it be evicted first); ``stats`` gets what was done here.

        The blended KV of ``prompt[:-1]`` goes to the prompt's blended scope (``blended_scope``: read only
        by blending calls at the same share, never as exact KV) and the call is served there; its exact
        leading part also goes to ``scope``. Nothing blended (no chunk after the cached prefix, a first
        sight, a model unable to move keys): served in ``scope`` itself, a plain prefill."""
        assert self.layout is not None
        start, n = self._clock(), len(prompt)
        with self.store.ledger.reserve("serial", self._bytes(n + _alone_room(blend))), self._holding_model():
            lease = self.store.acquire(scope, prompt, n - 1, restore=True)
            leases = [lease]
            try:
                stats.cached_tokens = lease.cached_tokens
                unable = self.blender.prepare()
                if unable is not None:
                    stats.blend_reason = unable
                    return scope, False, lease.cached_tokens, None
                cache, exact, first_sight, tally = self._blend(prompt, blend, leases, scope, n, stats)
                if first_sight or exact >= n - 1:
                    return scope, first_sight, lease.cached_tokens, None
                if exact > lease.cached_tokens:
                    stats.stored_tokens = self.store.insert(scope, prompt[:exact], cache.slice).stored_tokens
                blended = blended_scope(scope, blend.share)  # all the KV there is: the engine computes the rest
                upto = min(n - 1, cache.length)
                if self.store.insert(blended, prompt[:upto], cache.slice).stored_tokens < upto:
                    # The budget or the tenant's quota kept only part of it: the engine would read a blended head
                    # and prefill the rest. Served from the exact KV instead, and said so.
                    stats.chunk_reused_tokens = stats.chunk_recomputed_tokens = 0
                    stats.blend_reason = BLEND_UNSTORED
                    return scope, False, lease.cached_tokens, None
                return blended, False, upto, tally
            finally:
                for held in leases:
                    self.store.release(held)
                stats.lookup_seconds = self._clock() - start

    def store_documents(self, prompt: list[int], blend: BlendRequest, cached: int, scope: Scope) -> int:
        """After a first sight served elsewhere: its documents computed alone and stored (``Blender.store_alone``);
        returns the tokens stored. A failure is logged: it concerns later calls only."""
        with self._holding_model():
            return self._store_documents(prompt, blend, cached, scope)

    def prefill(self, tokens: list[int], scope: Scope, pin: bool, privileged: bool = False,
                cancel: threading.Event | None = None, timeout: float | None = None) -> CallStats:
        """Compute and store the KV of ``tokens`` without generating (cache warming).

        The suffix after the cached prefix is computed ``PREWARM_CHUNK_TOKENS`` at a time; between
        chunks a set ``cancel`` raises ``RequestCancelledError`` and ``timeout`` seconds (real time)
        ``GenerationTimeoutError``. Either way nothing is stored and the lease is released.
        ``privileged`` exempts a pin from the tenant pin quota (``KVStore.insert``).
        """
        if self.layout is None:
            raise UnsupportedModelError(self.unsupported_reason or "model not supported")
        deadline = None if timeout is None else time.monotonic() + timeout
        stats = CallStats(prompt_tokens=len(tokens), executor="serial")
        with self.store.ledger.reserve("prewarm", self._bytes(len(tokens)), cancel) as held, self._holding_model():
            lease = self.store.acquire(scope, tokens, len(tokens), restore=True)
            try:
                stats.cached_tokens = lease.cached_tokens
                cache = WorkingCache(self.layout, lease.segments, len(tokens))
                for start in range(lease.cached_tokens, len(tokens), self.prewarm_chunk):
                    _check_stop(cancel, deadline, timeout)
                    ids = torch.tensor([tokens[start : start + self.prewarm_chunk]], device=self.layout.device)
                    with torch.no_grad():  # positions follow from the cache's length
                        self.model(input_ids=ids, past_key_values=cache, use_cache=True)
                _check_stop(cancel, deadline, timeout)
                # The last use of its buffer: the prefix takes over the buffer's reservation as it is stored.
                result = self.store.insert(scope, tokens, cache.slice, pin=pin, privileged=privileged, own=held)
                stats.stored_tokens = result.stored_tokens
            finally:
                self.store.release(lease)
        return stats

    @contextlib.contextmanager
    def _holding_model(self) -> Iterator[None]:
        """Hold the model (one call at a time); afterwards the calling thread's CPU workers go back."""
        try:
            with self._model_lock:
                yield
        finally:
            self._threads.release()

    def _bytes(self, tokens: int) -> int:
        """KV bytes of ``tokens`` tokens (0 for a model whose layout is unknown)."""
        return 0 if self.layout is None else tokens * self.layout.bytes_per_token

    # -- internals -----------------------------------------------------------------
    def _cached_generate(self, input_ids, scope: Scope, generation_config, kwargs, cache_generated, max_new,
                         stats: CallStats, start: float, blend: BlendRequest | None = None,
                         held: Reservation | None = None) -> Any:
        assert self.layout is not None
        prompt = input_ids[0].tolist()
        n = len(prompt)
        # At least the last prompt token is recomputed, so its logits exist.
        lease = self.store.acquire(scope, prompt, n - 1, restore=True)
        leases = [lease]
        try:
            stats.cached_tokens = lease.cached_tokens
            stats.lookup_seconds = self._clock() - start
            unable = None if blend is None else self.blender.prepare()
            if unable is not None:
                stats.blend_reason = unable
            first_sight = False
            own = None  # the reservation the stored sequence takes over, where storing it is its buffer's last use
            if blend is None or unable:
                cache, exact, own = WorkingCache(self.layout, lease.segments, n + max_new), n, held
            else:
                cache, exact, first_sight, _ = self._blend(prompt, blend, leases, scope, n + max_new, stats)
            mask = torch.ones_like(input_ids)
            out = self.model.generate(input_ids, attention_mask=mask, past_key_values=cache,
                                      generation_config=generation_config, **kwargs)
            if not isinstance(out, torch.Tensor):  # copied before the store takes over the buffer's reservation
                hand_out(out, cache, self.model.config)
            seq = out.sequences if hasattr(out, "sequences") else out
            # Reused chunk KV is close to a full prefill's, not equal: never a prefix of the exact namespace.
            keep = (cache.length if cache_generated else n) if exact >= n - 1 else exact
            tokens = seq[0, :keep].tolist()
            if tokens:
                stats.stored_tokens = self.store.insert(scope, tokens, cache.slice, own=own).stored_tokens
            if exact < n - 1:  # the blended prompt (and answer, as the batching engine keeps it), for blending
                upto = cache.length if cache_generated else n - 1  # calls of the same share only
                self.store.insert(blended_scope(scope, blend.share), seq[0, :upto].tolist(), cache.slice)
            if first_sight:  # after the answer: the prompt's documents, computed alone, for later prompts to blend
                stats.chunk_stored_tokens = self._store_documents(prompt, blend, lease.cached_tokens, scope)
            return out
        finally:
            for held in leases:
                self.store.release(held)

    def _store_documents(self, prompt: list[int], blend: BlendRequest, cached: int, scope: Scope) -> int:
        """``store_documents`` with the model held already."""
        try:
            return self.blender.store_alone(prompt, blend, cached, scope)
        except Exception as exc:  # noqa: BLE001 - for later calls only: the answer stands
            log.warning("could not store a prompt's documents for blending: %s", exc)
            return 0

    def _blend(self, prompt: list[int], blend: BlendRequest, leases: list[Lease], scope: Scope, capacity: int,
               stats: CallStats) -> tuple[WorkingCache, int, bool, BlendTally | None]:
        """A blending call's working cache, how many leading tokens of it are exact, whether it is a first
        sight (prefilled: the caller stores its documents afterwards) and where its chunk tokens came from
        (None: nothing blended). Its prefix is the longer of the exact
        match (``leases[0]``) and the prompt blended before at the same share (a lease added to ``leases``);
        the chunks after it are placed and blended (``Blender.build``).

        When none of the chunks after the exact match is stored, the prompt is prefilled exactly instead:
        a blend would first compute every one of them alone, as many tokens as the prefill itself, and
        then recompute a share; the answer then is a full prefill's, and its first token comes sooner."""
        exact_lease, n = leases[0], len(prompt)
        earlier = self.store.acquire(blended_scope(scope, blend.share), prompt, n - 1)
        leases.append(earlier)
        prefix = earlier if earlier.cached_tokens > exact_lease.cached_tokens else exact_lease
        if prefix is exact_lease and self.blender.stored(prompt, blend, exact_lease.cached_tokens, scope) == 0 and any(
                e > exact_lease.cached_tokens for _, e in blend.chunks):
            stats.blend_reason = FIRST_SIGHT
            return WorkingCache(self.layout, exact_lease.segments, capacity), n, True, None
        try:
            built = self.blender.build(prompt, blend, prefix, scope, room=capacity)
        except Exception as exc:  # noqa: BLE001 - a cache problem: prefill instead, never a wrong answer
            log.warning("blending a prompt failed, prefilling it instead: %s", exc)
            stats.blend_reason = f"{BLEND_FAILED}: {exc}"
            return WorkingCache(self.layout, exact_lease.segments, capacity), n, False, None
        tally = BlendTally(exact_lease.cached_tokens, prefix.cached_tokens if prefix is earlier else 0, built)
        stats.chunk_reused_tokens, stats.chunk_recomputed_tokens = tally.within(n)
        if built is None:
            exact = exact_lease.cached_tokens if prefix is earlier else n
            return WorkingCache(self.layout, prefix.segments, capacity), exact, False, tally
        stats.chunk_stored_tokens = built.stored
        exact = exact_lease.cached_tokens if prefix is earlier else built.exact
        return WorkingCache.adopt(self.layout, built.buffer, n - 1), exact, False, tally

    def effective_config(self, generation_config: GenerationConfig | None, kwargs: dict[str, Any]) -> GenerationConfig:
        """What ``generate()`` will use: the caller's config (else the model's) with each field it leaves unset
        taken from the model's, then ``kwargs`` on top, as transformers' ``_prepare_generation_config`` does
        (less its global defaults: a field nobody sets stays None here)."""
        config = copy.deepcopy(generation_config or self.model.generation_config)
        if generation_config is not None:
            config.update(**self.model.generation_config.to_dict(), defaults_only=True, allow_custom_entries=True)
        config.update(**{k: v for k, v in kwargs.items() if hasattr(config, k)})
        return config

    def _bypass_reason(self, config: GenerationConfig, kwargs: dict[str, Any], total_len: int) -> str | None:
        if self.layout is None:
            return f"model not supported: {self.unsupported_reason}"
        return bypass_reason(config, kwargs) or self.layout.window_reason(total_len)


def _alone_room(blend: BlendRequest | None) -> int:
    """Tokens of working KV a blend needs beside its prompt's: the largest document computed alone (one at a time)."""
    return 0 if blend is None else max((e - s + 1 for s, e in blend.chunks), default=0)


def _check_stop(cancel: threading.Event | None, deadline: float | None, timeout: float | None) -> None:
    if cancel is not None and cancel.is_set():
        raise RequestCancelledError("the prewarm was cancelled; nothing was stored")
    if deadline is not None and time.monotonic() >= deadline:
        raise GenerationTimeoutError(f"the prewarm did not finish within {timeout:g} s and was cancelled; nothing "
                                     "was stored")
