"""Continuous batching with shared-prefix (cascade) attention: the loop.

A background thread runs ``schedule() → run() → postprocess()``: the scheduler admits
waiting requests and plans the step, the model runner computes one packed forward for
every running request (decodes feed 1 token, prefills a chunk), and postprocessing
samples, streams and finishes. Requests join between steps and leave when done; on
leaving, their prompt + answer KV is inserted into the store and their prefix lease
released (also on error or cancel). Stored prefix snapshots are read in place; each
request's own KV lives in a slot of a ``PrivatePool``.

Faults never leave a caller waiting: an exception in a step fails that step's requests
with ``EngineFaultError`` and the loop goes on; a failure to cache or free a finished
request's KV is logged and costs the cache, not the answer; if the loop thread itself
stops (a ``BaseException``), every pending request fails at once, ``failure`` says why,
and ``unservable`` sends later calls to the serial engine.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from prefixcache.cache.scope import Scope
from prefixcache.cache.store import KVStore
from prefixcache.config import check_int, check_positive
from prefixcache.errors import (
    CacheClosedError,
    ConfigError,
    EngineFaultError,
    GenerationTimeoutError,
    UnsupportedModelError,
)
from prefixcache.model.hf_cache import Probe, check_cascade, enable_cascade_attention, probe
from prefixcache.model.layout import KVLayout
from prefixcache.model.step_graphs import Capture, device_capture
from prefixcache.model.threads import WorkerThreads
from prefixcache.serving.logprobs import TokenLogprob, pack, token_logprobs, top_width, unpack
from prefixcache.serving.model_runner import ModelRunner
from prefixcache.serving.request import CallStats, Request, SamplingParams, Status, finish_reason
from prefixcache.serving.sampling import Sampler, draw_rows, draw_seeded, fresh_seed
from prefixcache.serving.scheduler import Scheduler, release_private

log = logging.getLogger(__name__)

#: How often a waiter checks that the loop thread is alive: the bound on how long a caller
#: can wait on a loop that died without failing its requests.
LIVENESS_POLL_SECONDS = 0.25


def _attempt(what: str, action: Callable[[], object]) -> bool:
    """Run one clean-up ``action``; log (never raise) an ``Exception``. Whether it succeeded."""
    try:
        action()
        return True
    except Exception:  # noqa: BLE001 - clean-up must go on, and the caller must be woken
        log.exception("could not %s", what)
        return False


@dataclass(frozen=True, slots=True)
class BatchConfig:
    max_batch: int = 16  # running requests per step
    #: Packed tokens per forward: decodes first, then prompt tokens, the prompts closest to their
    #: first token first (so a burst of prompts gets first tokens one after another, and a short
    #: question is not held behind a long document). It bounds a step's time, hence TPOT.
    token_budget: int = 512
    #: Prompt tokens the oldest prompt feeds in every step at least, however many shorter prompts
    #: arrive after it: none starves.
    prefill_chunk: int = 128
    private_chunk: int = 32  # private KV grows by this many tokens at a time
    #: Requests that may hold more private tokens get a pool of their own. The shared pool's slots
    #: are sized at admission for the most any of its requests may hold (so at most this many).
    pool_max_tokens: int = 512
    max_wait_seconds: float = 2.0  # a request waiting longer is admitted first
    max_private_tokens: int = 1 << 16  # admission budget: private KV tokens reserved by running requests
    #: Most cached tokens a request copies into its private KV at admission: the tail of
    #: its prefix no other request reads (its own conversation), so a chain of stored runs
    #: costs one private read per layer instead of one call per run. The copy is counted.
    fold_max_tokens: int = 1024
    #: Consecutive failed steps (no successful step between them) after which the engine reports
    #: itself faulting (``faulting``; the proxy's /readyz then says not ready) ...
    fault_streak: int = 3
    #: ... until a step succeeds or this many seconds pass without another fault.
    fault_window_seconds: float = 30.0
    #: On CUDA, capture steps of decodes whose shape repeats as CUDA graphs and replay them (one
    #: launch instead of about a thousand); off, every step runs kernel by kernel.
    step_graphs: bool = True
    #: Captured step shapes kept, the most recently used, of decode steps and as many of staged prompt
    #: steps: each holds one step's activations.
    captured_steps: int = 8
    #: With ``step_graphs`` on CUDA: a request's prompt tokens past its stored prefix, when all of them,
    #: at most this many, are prefilled in one step alone (a hit's new tokens, or a short prompt; not a
    #: long prompt's last chunk), run padded to the next power of two (at least 16) over a staging slab
    #: of that size, and are captured once the same stored prefix and size repeat; 0: prompt steps run
    #: kernel by kernel. A hit whose cached tail is copied into its private KV at admission
    #: (``fold_max_tokens``: a prefix of several stored runs, as a conversation's earlier turns) is not staged.
    captured_prompt_tokens: int = 512
    #: Draw a step's sampled rows that only warp their logits (temperature, top-k, top-p) where the
    #: logits are: unseeded ones together (a few kernels for all rows instead of a copy to the host and a
    #: dozen host operations each), seeded ones each from a generator of its own there, as ``generate()``
    #: draws on that device. None: on an accelerator, not on a CPU.
    draw_together: bool | None = None

    def __post_init__(self) -> None:
        for name in ("max_batch", "token_budget", "prefill_chunk", "private_chunk",
                     "max_private_tokens", "captured_steps"):
            check_int(name, getattr(self, name), 1, None)
        check_int("fault_streak", self.fault_streak, 1, None)
        check_positive("fault_window_seconds", self.fault_window_seconds)
        check_int("pool_max_tokens", self.pool_max_tokens, 0, None)
        check_int("fold_max_tokens", self.fold_max_tokens, 0, None)
        check_int("captured_prompt_tokens", self.captured_prompt_tokens, 0, None)
        check_positive("max_wait_seconds", self.max_wait_seconds)
        if not isinstance(self.step_graphs, bool):
            raise ConfigError("step_graphs", self.step_graphs, "true or false")
        if self.draw_together is not None and not isinstance(self.draw_together, bool):
            raise ConfigError("draw_together", self.draw_together, "true, false or unset")

    @classmethod
    def for_device(cls, layout: KVLayout, **overrides: object) -> BatchConfig:
        """Defaults sized for ``layout``'s device (``device_defaults``), then ``overrides``."""
        device = layout.device
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            sized = device_defaults("cuda", props.total_memory, props.multi_processor_count, layout.bytes_per_token)
        else:
            sized = {}
        return cls(**{**sized, **overrides})


def device_defaults(kind: str, memory_bytes: int, processors: int, kv_bytes_per_token: int) -> dict[str, int]:
    """``BatchConfig`` fields sized for a device; {} keeps the class defaults (sized for a few CPU cores).

    On CUDA a step is cheap next to Python and launch overhead, so batches are wide: as many running
    requests as the next power of two below the multiprocessor count (32-256), a token budget of 64
    tokens per multiprocessor (2,048-16,384) so a long prompt is prefilled in a few large chunks, a
    quarter of it as every prompt's minimum chunk, and private KV admitted up to a quarter of the
    device's memory.
    """
    if kind != "cuda":
        return {}
    max_batch = min(256, max(32, 1 << (max(processors, 1).bit_length() - 1)))
    budget = min(16384, max(2048, 1 << ((64 * max(processors, 1)).bit_length() - 1)))
    return {"max_batch": max_batch, "token_budget": budget, "prefill_chunk": budget // 4, "private_chunk": 64,
            "pool_max_tokens": 4096, "max_private_tokens": max(1 << 16, memory_bytes // 4 // kv_bytes_per_token)}


@dataclass(frozen=True, slots=True)
class BatchResult:
    tokens: list[int]  # generated tokens only
    finish_reason: str  # "stop", "length" or "cancelled"
    stats: CallStats
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, where ``SamplingParams.logprobs`` asked


class BatchEngine:
    """Serves ``generate`` calls from many threads through one batched model loop.

    ``disabled_reason`` says why the model cannot be served here (then ``submit`` raises
    ``UnsupportedModelError``); ``failure`` why the loop thread stopped (then ``submit`` raises
    ``EngineFaultError``); ``unservable`` why one request cannot be. ``entropy`` seeds sampled
    requests that carry no seed (each gets a generator of its own). ``step_capture``: how steps of
    decodes are captured (default: the device's, CUDA graphs on CUDA, when ``step_graphs`` is on).
    ``support``: the model's probed layout (``hf_cache.probe``), when the caller probed it already.
    """

    def __init__(self, model: torch.nn.Module, store: KVStore, clock: Callable[[], float],
                 config: BatchConfig | dict[str, Any] | None = None, cache_generated: bool = True,
                 entropy: Callable[[], int] = fresh_seed, step_capture: Capture | None = None,
                 support: Probe | None = None, threads: WorkerThreads | None = None):
        self.model, self.store, self._clock = model, store, clock
        # CPU workers of a thread about to wait go back (``model/threads.py``): the loop's when it idles,
        # a caller's as it submits, the constructing thread's after the self-check below.
        self._threads = threads if threads is not None else WorkerThreads.of_torch()
        # None or a mapping of fields: sized for the device once its layout is known, the mapping over it.
        overrides = None if isinstance(config, BatchConfig) else dict(config or {})
        for name in set(overrides or ()) - {f.name for f in dataclasses.fields(BatchConfig)}:
            raise ConfigError(name, overrides[name], "a BatchConfig field")
        self.config = BatchConfig(**overrides) if overrides is not None else config
        self.cache_generated = cache_generated
        self.layout: KVLayout | None = None
        self.disabled_reason: str | None = None
        self.failure: str | None = None  # why the loop thread stopped; set once, under ``_cv``
        self._faults: list[tuple[float, str]] = []  # (when, what) of the failed steps since the last good one
        self.runner: ModelRunner | None = None
        self.scheduler: Scheduler | None = None
        support = support if support is not None else probe(model)  # ``support``: probed by the caller
        try:
            layout = support.layout
            if layout is None:
                raise UnsupportedModelError(support.unsupported_reason or "model not supported")
            previous = model.config._attn_implementation
            enable_cascade_attention(model)  # one-time, idempotent registration
            try:
                check_cascade(model, layout)
            except UnsupportedModelError:
                model.set_attn_implementation(previous)
                raise
            self.layout = layout
            if overrides is not None:
                self.config = BatchConfig.for_device(layout, **overrides)
            capture = step_capture or (device_capture(layout.device) if self.config.step_graphs else None)
            self.runner = ModelRunner(model, layout, capture, self.config.captured_steps,
                                      self.config.captured_prompt_tokens, room=self._staging_room)
            graphs = self.runner.graphs
            self.scheduler = Scheduler(store, layout, self.config, clock, self._finish, entropy,
                                       beside=lambda: 0 if graphs is None else graphs.staging_bytes,
                                       shed=lambda: None if graphs is None else graphs.shed())
        except UnsupportedModelError as exc:
            self.disabled_reason = str(exc)
            log.warning("batching disabled: %s", exc)
        finally:
            self._threads.release()
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="prefixcache-batching", daemon=True)
        if self.layout is not None:
            self._thread.start()
            # A caller that never closes: the loop stops before the interpreter finalizes, not inside a step.
            atexit.register(self.close)

    # -- public --------------------------------------------------------------------
    @property
    def steps(self) -> int:
        return 0 if self.runner is None else self.runner.steps

    @property
    def faulting(self) -> str | None:
        """Why the engine counts as faulting while its loop lives, or None: ``fault_streak`` steps in a
        row failed, the last within ``fault_window_seconds``. A good step ends it; so does a quiet window."""
        faults, cfg = list(self._faults), self.config
        if len(faults) < cfg.fault_streak or self._clock() - faults[-1][0] > cfg.fault_window_seconds:
            return None
        return f"the last {len(faults)} batched steps failed (last: {faults[-1][1]})"

    def _step_failed(self, exc: BaseException) -> None:
        """Count a failed step (only the last ``fault_streak`` are kept: ``faulting`` needs no more)."""
        self._faults = [*self._faults, (self._clock(), f"{type(exc).__name__}: {exc}")][-self.config.fault_streak:]

    def unservable(self, prompt_len: int, params: SamplingParams) -> str | None:
        """Why a request of ``prompt_len`` tokens with ``params`` cannot be served here, or None."""
        if self.layout is None:
            return f"batching disabled: {self.disabled_reason}"
        if self.failure is not None:
            return f"the batching loop stopped: {self.failure}"
        return self.layout.window_reason(prompt_len + params.max_new_tokens)

    def generate(self, prompt: Sequence[int], scope: Scope, params: SamplingParams,
                 on_token: Callable[[int], None] | None = None,
                 cancel: threading.Event | None = None, timeout: float | None = None) -> BatchResult:
        """Generate for one prompt (token ids); blocks until done (see ``wait``). Thread-safe."""
        return self.wait(self.submit(prompt, scope, params, on_token, cancel), timeout)

    def submit(self, prompt: Sequence[int], scope: Scope, params: SamplingParams,
               on_token: Callable[[int], None] | None = None,
               cancel: threading.Event | None = None, stop: Callable[[list[int]], bool] | None = None,
               logprobs: list[TokenLogprob] | None = None) -> Request:
        """Queue one request; ``wait`` for its result. ``on_token`` and ``stop`` run on the loop's thread.
        ``logprobs``: the list each token's ``TokenLogprob`` is appended to, before ``on_token`` sees the token
        (where ``params.logprobs`` asks; default: a list of the request's own)."""
        if self.failure is not None:  # a fault (503, retry), not a request batching cannot serve
            raise self._stopped()
        reason = self.unservable(len(prompt), params)
        if reason is not None:
            raise UnsupportedModelError(reason)
        self._threads.release()  # the caller waits from here on; the loop's thread computes
        req = Request(list(prompt), scope, params, self._clock(), on_token, cancel, stop)
        if logprobs is not None:
            req.logprobs = logprobs
        sampler = Sampler(params, len(req.prompt))
        req.sampler = None if sampler.argmax_only else sampler  # None: the step's one batched argmax
        # Pin the longest cached prefix now: admission order needs its length. The last
        # prompt token is always recomputed, so its logits exist.
        looked = self._clock()
        req.lease = self.store.acquire(scope, req.prompt, len(req.prompt) - 1, restore=True)
        req.stats.lookup_seconds = self._clock() - looked  # a restore from the tiers below included
        req.stats.prompt_tokens, req.stats.cached_tokens = len(req.prompt), req.cached_len
        with self._cv:
            if self._closed or self.failure is not None:
                self.store.release(req.lease)
                if self.failure is not None:
                    raise self._stopped()
                raise CacheClosedError("the batching engine is closed")
            self.scheduler.add(req)
            self._cv.notify()
        return req

    def wait(self, req: Request, timeout: float | None = None) -> BatchResult:
        """``req``'s result once it leaves the engine, or its error.

        Raises ``EngineFaultError`` (the engine failed; also at once if the loop thread is
        gone) or ``GenerationTimeoutError`` after ``timeout`` seconds of real time. A waiter
        that gives up (timeout, or its thread interrupted) cancels the request: it leaves at
        the next step, releasing what it holds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not req.done.wait(LIVENESS_POLL_SECONDS if deadline is None else
                                    max(0.0, min(LIVENESS_POLL_SECONDS, deadline - time.monotonic()))):
                if not self._thread.is_alive() and not req.done.is_set():
                    raise self._stopped()
                if deadline is not None and time.monotonic() >= deadline:
                    raise GenerationTimeoutError(f"the generation did not finish within {timeout:g} s and was "
                                                 "cancelled")
        except BaseException:
            req.abandoned.set()
            raise
        if req.error is not None:
            raise req.error
        return BatchResult(list(req.output), req.finish_reason or "length", req.stats, tuple(req.logprobs))

    def _stopped(self) -> EngineFaultError:
        return EngineFaultError(f"the batching loop stopped ({self.failure or 'no reason recorded'}); retry")

    def kv_bytes(self) -> int:
        """Bytes of KV held: store snapshots plus every running request's private buffer."""
        if self.scheduler is None:
            return self.store.bytes
        with self._cv:
            held = [r.private for r in self.scheduler.running]  # read once: the loop may clear it meanwhile
        pools = {id(p.pool): p.pool for p in held if p is not None}
        return self.store.bytes + sum(pool.nbytes for pool in pools.values())

    def close(self) -> None:
        atexit.unregister(self.close)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    # -- loop: schedule → run → postprocess ------------------------------------------
    def _run(self) -> None:
        """The loop thread: the loop, and if it stops on an error, every pending caller failed at once."""
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - the thread ends here; nobody may be left waiting
            log.critical("the batching loop stopped; calls go to the serial engine from now on", exc_info=exc)
            fault = EngineFaultError.wrapping(exc, "and its loop stopped")
            with self._cv:  # under the lock: ``submit`` either queued before this or sees ``failure``
                self.failure = f"{type(exc).__name__}: {exc}"
                pending = [*self.scheduler.running, *self.scheduler.waiting]
            for req in pending:
                try:
                    self._finish(req, None, fault)
                except BaseException:  # noqa: BLE001 - ``_finish`` woke the caller before re-raising
                    log.exception("could not fail a request of the stopped loop")

    def _loop(self) -> None:
        sched = self.scheduler
        while True:
            with self._cv:
                while not self._closed and not sched.waiting and not sched.running:
                    self._threads.release()
                    self._cv.wait()
                if self._closed:
                    break
                try:
                    plan = sched.schedule()
                except Exception as exc:  # noqa: BLE001 - a dead loop would leave every caller waiting
                    log.exception("planning a step failed")
                    self._step_failed(exc)
                    fault = EngineFaultError.wrapping(exc, "planning a step")
                    for req in [*sched.running, *sched.waiting]:  # the state that failed to plan: nobody is safe
                        self._finish(req, None, fault)
                    continue
            try:
                if plan:
                    self._postprocess(plan, self.runner.run(plan))
                    self._faults = []
                elif sched.waiting:  # nothing runs and the head waits for KV memory: poll, do not spin
                    with self._cv:
                        self._cv.wait(0.01)
            except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving
                log.exception("batched step failed")
                self._step_failed(exc)
                fault = EngineFaultError.wrapping(exc, "in a batched step")
                for req, _ in plan:
                    self._finish(req, None, fault)
            if plan:
                self._account_private()  # pools change shape within a step (a leader rebased onto its prompt)
        with self._cv:
            for req in [*sched.running, *sched.waiting]:
                self._finish(req, "cancelled", None)
        if self.runner.graphs is not None:  # closed: the staging slabs go, and their bytes from the ledger
            self.runner.graphs.shed()
            self._account_private()

    def _postprocess(self, plan: list[tuple[Request, int]], logits: torch.Tensor) -> None:
        """logits: [K, V], one row per request of ``plan`` whose prompt is complete (in plan order)."""
        for req, n in plan:  # all first: a request leaving below may repack the pool to these lengths
            req.private.length += n
        rows = [r for r, _ in plan if not r.prefilling]
        # Rows that ask for logprobs: their raw logits' log_softmax (``logprobs``), in one batched computation.
        asking = [k for k, req in enumerate(rows) if req.params.logprobs is not None]
        tops = [rows[k].params.logprobs for k in asking]
        best, entries = _argmax(rows, logits, asking, tops)
        # Sampled rows that only warp their logits drawn where the logits are (``BatchConfig.draw_together``):
        # unseeded ones together (``draw_rows``), seeded ones each from its generator there, as ``generate()``
        # draws (``draw_seeded``); the others' float32 scores to the host in one copy (one synchronisation on
        # a device), where each row's sampler draws.
        together = self.config.draw_together
        together = logits.device.type != "cpu" if together is None else together
        warped = [k for k, r in enumerate(rows) if together and r.sampler is not None and r.sampler.warp is not None]
        seeded = [k for k, r in enumerate(rows) if together and r.sampler is not None
                  and r.sampler.seeded_warps is not None]
        taken = set(warped) | set(seeded)
        hosted = [k for k, r in enumerate(rows) if r.sampler is not None and k not in taken]
        drawn = dict(zip(warped, draw_rows(logits[warped].float(), [rows[k].sampler.warp for k in warped],
                                           [rows[k].sampler.uniform(rows[k].generator) for k in warped]),
                         strict=True)) if warped else {}
        if seeded:
            drawn.update(zip(seeded, draw_seeded(logits[seeded].float(), [rows[k].sampler for k in seeded],
                                                 [self._device_generator(rows[k], logits.device) for k in seeded]),
                             strict=True))
        scores = iter(logits[hosted].float().cpu()) if hosted else iter(())
        tokens = []
        for k, req in enumerate(rows):
            if req.sampler is None:
                tokens.append(best[k])
            elif k in drawn:
                tokens.append(drawn[k])
            else:
                tokens.append(req.sampler.next_token(next(scores), req.prompt, req.output, req.generator))
        if asking:
            if entries is None:  # sampled rows among them: their tokens are known on the host only now
                entries = token_logprobs(logits[asking], [tokens[k] for k in asking], tops)
            for k, entry in zip(asking, entries, strict=True):
                rows[k].logprobs.append(entry)
        k = 0
        for req, _ in plan:
            if req.prefilling:
                if req.cancelled:
                    self._finish(req, "cancelled", None)
                continue
            token = tokens[k]
            k += 1
            if not req.output:
                self._publish_for_followers(req)
            req.output.append(token)
            if req.stats.ttft_seconds is None:
                req.stats.ttft_seconds = self._clock() - req.arrival
            try:
                if req.on_token is not None:
                    req.on_token(token)
                stopped = req.stop is not None and req.stop(req.prompt + req.output)
            except BaseException as exc:  # noqa: BLE001 - a broken callback ends only its request
                self._finish(req, None, exc)
                continue
            reason = finish_reason(req.output, req.params, stopped, req.cancelled)
            if stopped or reason == "stop" or len(req.output) >= req.params.max_new_tokens or req.cancelled:
                self._finish(req, reason, None)

    def _publish_for_followers(self, req: Request) -> None:
        """At a request's first token: store its prompt now if waiting requests follow it, so they hit
        it, and read it in place with them."""
        with self._cv:
            followers = self.scheduler.followers(req)
        if not followers:
            return
        try:
            self.store.insert(req.scope, req.prompt, req.kv_slicer())
        except Exception as exc:  # noqa: BLE001 - caching is an optimisation; the answer goes on
            log.warning("could not store a prompt's KV early: %s", exc)
            return
        self.scheduler.rebase(req, followers)

    # -- leaving -------------------------------------------------------------------
    @staticmethod
    def _device_generator(req: Request, device: torch.device) -> torch.Generator:
        """The generator a seeded request draws from on ``device``, seeded with its seed at its first draw there."""
        if req.device_generator is None:
            req.device_generator = torch.Generator(device=device).manual_seed(req.params.seed)
        return req.device_generator

    def _finish(self, req: Request, reason: str | None, error: BaseException | None) -> None:
        """Insert prompt + answer KV, release the lease and private KV, wake the caller. Idempotent.

        An ``Exception`` here never escapes (it would stop the loop): failing to cache or to free
        a finished request's KV is logged and costs the cache, never the answer, which is complete
        by now. The caller is woken whatever happens, even on a ``BaseException``.
        """
        if req.done.is_set():
            return
        try:
            keep = req.held_len if self.cache_generated else min(req.held_len, len(req.prompt))
            if error is None and req.private is not None and keep > 0:
                tokens = (req.prompt + req.output)[:keep]
                res = self.store.insert(req.scope, tokens, req.kv_slicer())
                req.stats.stored_tokens = res.stored_tokens
        except Exception as exc:  # noqa: BLE001 - the answer stands even if caching it failed
            log.warning("could not store KV of a finished request: %s", exc)
        finally:
            try:
                self._release(req)
            finally:
                req.status, req.finish_reason, req.error = Status.FINISHED, reason, error
                req.stats.completion_tokens = len(req.output)
                req.stats.total_seconds = self._clock() - req.arrival
                req.private = None
                req.done.set()

    def _release(self, req: Request) -> None:
        """Unpin ``req``'s prefix, take it out of the scheduler and free its private KV slot."""
        lease = req.lease
        if lease is not None:  # a lease left pinned could never be evicted: one more try (releasing is idempotent)
            if not _attempt("release a finished request's prefix lease", lambda: self.store.release(lease)):
                _attempt("release a finished request's prefix lease (again)", lambda: self.store.release(lease))
        with self._cv:
            self.scheduler.remove(req)
            reuse = bool(self.scheduler.waiting) and not self._closed
        if req.private is not None:  # free its slot now; keep it only for a request about to reuse it
            release_private(req.private, trim=not reuse)
        self._account_private()

    def _staging_room(self, nbytes: int) -> bool:
        """Whether a new staging slab of ``nbytes`` fits the KV total beside the running requests' pools:
        reserved as private KV if so (evicting snapshots that may go), as admission reserves a request's."""
        with self._cv:
            return self.store.ledger.try_set("private", self.scheduler.private_bound() + nbytes)

    def _account_private(self) -> None:
        """Bring the KV ledger's private reservation in line with the running requests' pools."""
        with self._cv:
            _attempt("account private KV", lambda: self.store.ledger.force("private", self.scheduler.private_bound()))


def _argmax(rows: list[Request], logits: torch.Tensor, asking: list[int],
            tops: list[int]) -> tuple[list[int] | None, list[TokenLogprob] | None]:
    """Plain greedy rows' tokens: one argmax over the step's logits ([K, V]; first maximum, as ``torch.argmax``),
    None where no row is plain greedy. The rows ``asking`` for logprobs (``tops`` alternatives each) get theirs
    in the same copy to the host when all of them are plain greedy (no second synchronisation), else None."""
    if not any(r.sampler is None for r in rows):
        return None, None
    argmax = logits.argmax(dim=-1)  # [K]
    if not asking or any(rows[k].sampler is not None for k in asking):
        return argmax.tolist(), None
    width = top_width(logits, tops)
    host = torch.cat([argmax.double(), pack(logits[asking], argmax[asking], width).flatten()]).cpu().tolist()
    best, cols = [int(t) for t in host[: len(rows)]], 1 + 2 * width
    packed = [host[len(rows) + i * cols : len(rows) + (i + 1) * cols] for i in range(len(asking))]
    return best, unpack(packed, [best[k] for k in asking], tops, width)
