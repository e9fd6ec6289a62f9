"""Continuous-batching engine with shared-prefix (cascade) attention.

A background loop runs ``schedule() → run() → postprocess()``: one packed forward per
step for every active request (decodes feed 1 token, prefills a chunk). Requests join
between steps and leave when done; on leaving, their prompt + answer KV is inserted
into the store and their prefix lease released (also on error or cancel). Stored
prefix snapshots are read in place; each request's own KV lives in a slot of a ``PrivatePool``.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from prefixcache.cache.runs import coalesce
from prefixcache.cache.store import KVStore
from prefixcache.cache.trie import common_prefix
from prefixcache.config import check_int, check_positive
from prefixcache.errors import ConfigError, UnsupportedModelError
from prefixcache.model.cpu.llama_forward import FusedLlama
from prefixcache.model.cpu.packed_linear import PackedLinears
from prefixcache.model.hf_cache import (
    CASCADE_KWARG,
    CascadeCache,
    CascadeRow,
    check_cascade,
    enable_cascade_attention,
    private_pool,
    probe_layout,
)
from prefixcache.model.layout import KVLayout
from prefixcache.model.private_kv import PrivateKV
from prefixcache.serving.sampling import fallback_generate, sample_next
from prefixcache.serving.scheduler import BatchRequest, SamplingParams, admission_order, plan_step
from prefixcache.serving.serial import CallStats, Engine

log = logging.getLogger(__name__)

#: Tokens after its cached prefix that a waiting request must share with a running prefill
#: to wait for it instead of computing them again.
HOLD_PROBE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class BatchConfig:
    max_batch: int = 16  # active requests per step
    #: Packed tokens per forward: decodes first, then prefill chunks (each request at most
    #: ``prefill_chunk``). 512 lets 4 questions of a burst prefill per step: 16 requests on a
    #: 2,048-token prefix finished in 0.70-0.92x the time of 256 (4 interleaved pairs, fp32 CPU).
    token_budget: int = 512
    prefill_chunk: int = 128  # most prompt tokens one request feeds per step
    #: Most prompt tokens one request feeds in a step that makes nobody's token (no decode, no
    #: prompt ending in it), e.g. a lone cold prompt: with 512 a 2,176-token one prefilled ~1.4x
    #: faster than with 128. A request arriving meanwhile waits at most one such step. ``prefill_chunk`` disables.
    idle_prefill_chunk: int = 512
    private_chunk: int = 32  # private KV grows by this many tokens at a time
    #: Requests that may hold more private tokens get a pool of their own. The shared pool's slots
    #: are sized at admission for the most any of its requests may hold (so at most this many).
    pool_max_tokens: int = 512
    max_wait_seconds: float = 2.0  # a request waiting longer is admitted first
    max_private_tokens: int = 1 << 16  # admission budget: private KV tokens reserved by active requests
    #: Most cached tokens a request copies into its private KV at admission: the tail of
    #: its prefix no other request reads (its own conversation), so a chain of stored runs
    #: costs one private read per layer instead of one call per run. The copy is counted.
    fold_max_tokens: int = 1024
    #: On CPU in fp32, keep an MKL-packed copy of every linear weight for ``max_batch`` rows
    #: (memory: about one more copy of those weights) so a step of max_batch/2..max_batch
    #: requests does not repack each weight on every call. For transformers' Llama models the
    #: step then runs ``FusedLlama`` (q/k/v and gate/up packed as one product each). Ignored
    #: where it cannot serve (logged), and when those weights take more than ``pack_max_bytes``.
    pack_weights: bool = True
    pack_max_bytes: int = 2 << 30

    def __post_init__(self) -> None:
        for name in ("max_batch", "token_budget", "prefill_chunk", "idle_prefill_chunk", "private_chunk",
                     "max_private_tokens"):
            check_int(name, getattr(self, name), 1, None)
        check_int("pool_max_tokens", self.pool_max_tokens, 0, None)
        check_int("fold_max_tokens", self.fold_max_tokens, 0, None)
        check_int("pack_max_bytes", self.pack_max_bytes, 0, None)
        check_positive("max_wait_seconds", self.max_wait_seconds)
        if not isinstance(self.pack_weights, bool):
            raise ConfigError("pack_weights", self.pack_weights, "True or False")


@dataclass(frozen=True, slots=True)
class BatchResult:
    tokens: list[int]  # generated tokens only
    finish_reason: str  # "stop", "length" or "cancelled"
    stats: CallStats
    fallback_reason: str | None = None  # set when the plain engine served the request


class BatchEngine:
    """Serves ``generate`` calls from many threads through one batched model loop.

    Falls back to ``fallback`` (the one-at-a-time ``Engine``) for models or requests the
    cascade path cannot serve exactly; the reason is logged and kept in ``fallback_reason``.
    """

    def __init__(self, model: torch.nn.Module, store: KVStore, clock: Callable[[], float],
                 config: BatchConfig | None = None, fallback: Engine | None = None):
        self.model, self.store, self._clock = model, store, clock
        self.config = config or BatchConfig()
        self.fallback = fallback
        self.layout: KVLayout | None = None
        self.fallback_reason: str | None = None
        self.packed: PackedLinears | None = None  # MKL-packed linear weights (CPU fp32), if any
        self.fused: FusedLlama | None = None  # the packed fused forward (Llama, CPU fp32), if any
        self.fused_steps = 0  # steps it ran
        try:
            layout = probe_layout(model)
            previous = model.config._attn_implementation
            enable_cascade_attention(model)  # one-time, idempotent registration
            try:
                check_cascade(model, layout)
            except UnsupportedModelError:
                model.set_attn_implementation(previous)
                raise
            self.layout = layout
            self._pool = private_pool(layout, self.config.private_chunk, plan_ahead=True)
            if self.config.pack_weights:
                self._pack_weights(model, layout)
        except UnsupportedModelError as exc:
            self.fallback_reason = str(exc)
            log.warning("batching disabled, serving through the plain engine: %s", exc)
        self._cv = threading.Condition()
        self._waiting: list[BatchRequest] = []
        self._active: list[BatchRequest] = []
        self._closed = False
        self.steps = 0
        self._thread = threading.Thread(target=self._loop, name="prefixcache-batching", daemon=True)
        if self.layout is not None:
            self._thread.start()

    def _pack_weights(self, model: torch.nn.Module, layout: KVLayout) -> None:
        """The fused forward where it serves and agrees with the model's own, else packed modules."""
        rows, limit = self.config.max_batch, self.config.pack_max_bytes
        fused, reason = FusedLlama.build(model, rows, limit)
        if fused is not None:
            try:
                check_cascade(model, layout, fused, rows=rows)  # a step of ``rows`` rows: packed products
                self.fused = fused
                return
            except UnsupportedModelError as exc:
                reason = f"it differs from the model's own forward: {exc}"
        log.info("fused forward not used: %s", reason)
        self.packed, reason = PackedLinears.build(model, rows, limit)
        if reason is not None:
            log.info("linear weights not packed: %s", reason)

    # -- public --------------------------------------------------------------------
    def generate(self, prompt: Sequence[int], namespace: tuple[str, ...], tenant: str, params: SamplingParams,
                 ttl_seconds: float | None = None, on_token: Callable[[int], None] | None = None,
                 cancel: threading.Event | None = None) -> BatchResult:
        """Generate for one prompt (token ids); blocks until done. Thread-safe."""
        return self.wait(self.submit(prompt, namespace, tenant, params, ttl_seconds, on_token, cancel))

    def submit(self, prompt, namespace, tenant, params, ttl_seconds=None, on_token=None, cancel=None) -> BatchRequest:
        req = BatchRequest(list(prompt), namespace, tenant, params, ttl_seconds, self._clock(), on_token, cancel)
        reason = self._unservable(req)
        if reason is not None:
            req.fallback_reason = reason
            self._run_fallback(req)
            return req
        # Pin the longest cached prefix now: admission order needs its length. The last
        # prompt token is always recomputed, so its logits exist.
        req.lease = self.store.acquire(namespace, tenant, req.prompt, len(req.prompt) - 1, ttl_seconds)
        req.stats.prompt_tokens, req.stats.cached_tokens = len(req.prompt), req.cached
        with self._cv:
            self._waiting.append(req)
            self._cv.notify()
        return req

    def wait(self, req: BatchRequest, timeout: float | None = None) -> BatchResult:
        if not req.done.wait(timeout):
            raise TimeoutError("request still running")
        if req.error is not None:
            raise req.error
        return BatchResult(list(req.output), req.finish_reason or "length", req.stats, req.fallback_reason)

    @property
    def packed_weight_bytes(self) -> int:
        """Bytes of the linear weights that have an MKL-packed copy (0 without one; not KV)."""
        packed = self.fused if self.fused is not None else self.packed
        return packed.weight_bytes if packed is not None else 0

    def kv_bytes(self) -> int:
        """Bytes of KV held: store snapshots plus every active request's private buffer."""
        with self._cv:
            held = [r.private for r in self._active]  # read once: the loop may clear it meanwhile
        pools = {id(p.pool): p.pool for p in held if p is not None}
        return self.store.bytes + sum(pool.nbytes for pool in pools.values())

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    # -- loop: schedule → run → postprocess ------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self._waiting and not self._active:
                    self._cv.wait()
                if self._closed:
                    break
                self._admit()
                try:
                    plan = plan_step(self._active, self.config.token_budget, self.config.prefill_chunk,
                                     self.config.idle_prefill_chunk)
                except Exception as exc:  # noqa: BLE001 - a dead loop would leave every caller waiting
                    log.exception("planning a step failed")
                    for req in list(self._active):
                        self._finish(req, None, exc)
                    continue
            try:
                if plan:
                    self._postprocess(plan, self._run(plan))
            except BaseException as exc:  # noqa: BLE001 - fail this step's requests, keep serving
                log.exception("batched step failed")
                for req, _ in plan:
                    self._finish(req, None, exc)
        with self._cv:
            for req in [*self._active, *self._waiting]:
                self._finish(req, "cancelled", None)

    def _admit(self) -> None:
        """Move waiting requests into the batch, cache-aware, within the batch and memory budgets."""
        cfg = self.config
        reserved = sum(r.private_need for r in self._active)
        joining: list[BatchRequest] = []  # active from now on (others' admission sees them); KV given below
        for req in admission_order(self._waiting, self._clock(), cfg.max_wait_seconds):
            if len(self._active) >= cfg.max_batch:
                break
            if req.cancel is not None and req.cancel.is_set():
                self._waiting.remove(req)
                self._finish(req, "cancelled", None)
                continue
            try:
                # Re-match first: a request sent before its prefix was stored must not wait for
                # prefills of tokens already stored since (a burst on a new system prompt would
                # otherwise admit its followers one per step, each held by the previous one's question).
                self._refresh_lease(req)
                if self._follows_a_prefill(req):
                    continue  # its prefix is being computed right now: wait for it to be stored
                req.read_steps = self._read_in_place(req)
                if self._active and reserved + req.private_need > cfg.max_private_tokens:
                    break  # keep order: the head of the queue is never overtaken for memory
                self._waiting.remove(req)
            except Exception as exc:  # noqa: BLE001 - fail this request only; the loop keeps serving
                self._fail_admission(req, exc)
                continue
            reserved += req.private_need
            self._active.append(req)
            joining.append(req)
        self._join(joining)

    def _join(self, joining: list[BatchRequest]) -> None:
        """Give just admitted (active) requests their private KV; one that cannot have it fails.

        Short requests share the pool (decoded together; it grows once for all of them); a long
        one gets a pool of its own, so it does not pad every slot.
        """
        cfg = self.config
        short = [r for r in joining if r.private_need <= cfg.pool_max_tokens]
        try:
            shared = dict(zip(map(id, short), self._pool.acquire_all([r.private_need for r in short])))
        except Exception as exc:  # noqa: BLE001 - fail these requests only
            for req in short:
                self._fail_admission(req, exc)
            joining, shared = [r for r in joining if r not in short], {}
        for req in joining:
            try:
                if id(req) in shared:
                    req.private = shared[id(req)]
                else:
                    req.private = self._acquire_private(req.private_need)
                    # Its whole prompt at once: a long prefill would otherwise regrow (and copy) the
                    # pool at every chunk. The answer still grows it by chunks (max_new_tokens may be large).
                    req.private.reserve(len(req.prompt) - req.base)
                for snap, used in coalesce(req.copied):
                    req.private.load(snap[:, :, :, :used])
                if req.params.seed is not None:
                    req.generator = torch.Generator(device=self.layout.device).manual_seed(req.params.seed)
            except Exception as exc:  # noqa: BLE001 - fail this request only; the loop keeps serving
                self._fail_admission(req, exc)

    def _acquire_private(self, need: int) -> PrivateKV:
        """Private KV for a request that may hold ``need`` tokens: a slot of the shared pool when they
        fit ``pool_max_tokens``, else a pool of its own (so it never pads the others' slots)."""
        if need <= self.config.pool_max_tokens:
            return self._pool.acquire(need)
        return private_pool(self.layout, self.config.private_chunk).acquire(need)

    def _fail_admission(self, req: BatchRequest, exc: Exception) -> None:
        log.exception("could not admit a request", exc_info=exc)
        if req in self._waiting:
            self._waiting.remove(req)
        self._finish(req, None, exc)

    def _read_in_place(self, req: BatchRequest) -> int | None:
        """How many of ``req``'s cached steps to read in place each step (None: all).

        The tail after them is copied into its private KV once: the longest run of final
        steps that no other active or waiting request holds, up to ``fold_max_tokens``,
        when that saves calls (it spans more than one stored run, or is the one run of its own
        history after a prefix others read). A whole prefix that is one run is read in place:
        nobody else may read it yet, but requests arriving next (a burst's followers) will,
        and a copy would pad every slot of the shared pool to its length while it runs.
        """
        steps = [] if req.lease is None else req.lease.steps
        others = {id(st.node) for r in (*self._active, *self._waiting) if r is not req and r.lease is not None
                  for st in r.lease.steps}
        k, tail = len(steps), 0
        while k > 0 and id(steps[k - 1].node) not in others and tail + steps[k - 1].used <= self.config.fold_max_tokens:
            k -= 1
            tail += steps[k].used
        if tail == 0:
            return None
        after_shared = k > 0 and id(steps[k - 1].node) in others
        if not after_shared and len(coalesce([(st.node.kv, st.used) for st in steps[k:]])) < 2:
            return None
        return k

    def _follows_a_prefill(self, req: BatchRequest) -> bool:
        """Whether an active request is still prefilling the tokens right after ``req``'s cached prefix.

        Computing them twice would waste the step; once that prefill ends its prompt is
        stored and ``req`` finds it (``_refresh_lease``). The leader always progresses, so
        the wait is bounded by its prefill.
        """
        start, probe = req.cached, HOLD_PROBE_TOKENS
        want = req.prompt[start : start + probe]
        if len(want) < probe:
            return False
        return any(a.prefilling and a.namespace == req.namespace and a.prompt[start : start + probe] == want
                   for a in self._active)

    def _followers(self, leader: BatchRequest) -> list[BatchRequest]:
        """Waiting requests held for ``leader``'s prefill (see ``_follows_a_prefill``).

        Only for them is the prompt stored before the request finishes: storing it early
        for nobody would hold its suffix twice (stored and private) while it decodes.
        """
        probe = HOLD_PROBE_TOKENS
        with self._cv:
            return [w for w in self._waiting
                    if w.namespace == leader.namespace and len(w.prompt) >= w.cached + probe
                    and w.prompt[w.cached : w.cached + probe] == leader.prompt[w.cached : w.cached + probe]]

    def _rebase(self, req: BatchRequest, followers: Sequence[BatchRequest]) -> None:
        """After ``req``'s prompt was stored for ``followers``: read the part they share in place.

        Its private KV then holds only the tokens after that part, in the shared pool when they
        fit, so the leader decodes in one step group with its followers instead of dragging its
        own copy of their prefix (the snapshot is a clone of the same KV: the answer is unchanged).
        Anything failing leaves the request as it was.
        """
        shared = min(common_prefix(req.prompt, w.prompt) for w in followers)
        if shared <= req.base:
            return
        lease = self.store.acquire(req.namespace, req.tenant, req.prompt, shared, req.ttl_seconds)
        old, base = req.private, req.base
        if lease.cached_tokens <= base:
            self.store.release(lease)
            return
        private = None
        try:
            tail = old.window(lease.cached_tokens - base, req.held - base).clone()
            private = self._acquire_private(len(req.prompt) - lease.cached_tokens + req.params.max_new_tokens)
            private.load(tail)
        except Exception as exc:  # noqa: BLE001 - an optimisation: the request goes on as it was
            if private is not None:
                private.release()
            self.store.release(lease)
            log.warning("could not read a stored prompt in place: %s", exc)
            return
        self.store.release(req.lease)
        req.lease, req.read_steps, req.private = lease, None, private
        old.release(trim=old.pool is not self._pool)  # its own pool: freed now

    def _refresh_lease(self, req: BatchRequest) -> None:
        """Re-match at admission: prefixes stored since ``submit`` (by finished or prefilled requests) count."""
        lease = self.store.acquire(req.namespace, req.tenant, req.prompt, len(req.prompt) - 1, req.ttl_seconds)
        if lease.cached_tokens > req.cached:
            self.store.release(req.lease)
            req.lease = lease
            req.stats.cached_tokens = lease.cached_tokens
        else:
            self.store.release(lease)

    def _run(self, plan: list[tuple[BatchRequest, int]]) -> torch.Tensor:
        """One packed forward; returns logits [K, V] for the requests that sample this step."""
        ids, pos, rows, keep, at = [], [], [], [], 0
        for req, n in plan:
            start = req.held
            new = req.prompt[start : start + n] if req.prefilling else [req.output[-1]]
            req.private.reserve(req.private.length + n)
            rows.append(CascadeRow(req.segments, req.private, req.private.length, n))
            ids.extend(new)
            pos.extend(range(start, start + n))
            at += n
            if start + n >= len(req.prompt):
                keep.append(at - 1)
        cache = CascadeCache(rows, self.layout.num_layers)
        device = self.layout.device
        ids_t, pos_t = torch.tensor(ids, device=device), torch.tensor(pos, device=device)  # [T] packed
        keep_t = torch.tensor(keep, dtype=torch.long, device=device)
        # Inference mode skips autograd bookkeeping on every op of the step (measured ~5 % of a
        # 16-request decode step). Everything that outlives the step is a normal tensor: the
        # private KV slab is written in place (allowed), the logits are cloned out below; packed
        # weights are refreshed before it is entered (``ready`` for the fused forward).
        if self.fused is not None and self.fused.ready():
            with torch.inference_mode():
                logits = self.fused(ids_t, pos_t, cache, keep_t)
            self.fused_steps += 1
        else:
            with (self.packed.installed() if self.packed is not None else nullcontext()), torch.inference_mode():
                logits = self.model(input_ids=ids_t.unsqueeze(0), position_ids=pos_t.unsqueeze(0),
                                    past_key_values=cache, use_cache=True, logits_to_keep=keep_t,
                                    **{CASCADE_KWARG: cache}).logits[0]
        if cache.calls != self.layout.num_layers:
            raise UnsupportedModelError(f"cascade attention ran in {cache.calls} of {self.layout.num_layers} layers")
        self.steps += 1
        return logits.clone()  # [K, V], a normal tensor for the samplers

    def _postprocess(self, plan: list[tuple[BatchRequest, int]], logits: torch.Tensor) -> None:
        for req, n in plan:  # all first: a request leaving below may repack the pool to these lengths
            req.private.length += n
        # Greedy rows: one argmax over the step's logits (first maximum, as ``torch.argmax``), not one per request.
        best = logits.argmax(dim=-1).tolist() if any(r.params.greedy and not r.prefilling for r, _ in plan) else None
        k = 0
        for req, n in plan:
            if req.prefilling:
                if req.cancel is not None and req.cancel.is_set():
                    self._finish(req, "cancelled", None)
                continue
            if req.params.greedy:
                token = best[k]
            else:
                token = sample_next(logits[k], req.params, req.prompt + req.output, req.generator)
            k += 1
            if not req.output:
                followers = self._followers(req)
                if followers:  # publish the prompt now, so they hit it, and read it in place with them
                    self._store_prompt(req)
                    self._rebase(req, followers)
            req.output.append(token)
            if req.stats.ttft_seconds is None:
                req.stats.ttft_seconds = self._clock() - req.arrival
            try:
                if req.on_token is not None:
                    req.on_token(token)
            except BaseException as exc:  # noqa: BLE001 - a broken callback ends only its request
                self._finish(req, None, exc)
                continue
            if token in req.params.eos_token_ids:
                self._finish(req, "stop", None)
            elif len(req.output) >= req.params.max_new_tokens:
                self._finish(req, "length", None)
            elif req.cancel is not None and req.cancel.is_set():
                self._finish(req, "cancelled", None)

    def _store_prompt(self, req: BatchRequest) -> None:
        try:
            self.store.insert(req.namespace, req.tenant, req.prompt, req.kv_slicer(), req.ttl_seconds)
        except Exception as exc:  # noqa: BLE001 - caching is an optimisation; the answer goes on
            log.warning("could not store a prompt's KV early: %s", exc)

    # -- leaving -------------------------------------------------------------------
    def _finish(self, req: BatchRequest, reason: str | None, error: BaseException | None) -> None:
        """Insert prompt + answer KV, release the lease, wake the caller. Idempotent."""
        if req.done.is_set():
            return
        try:
            if error is None and req.private is not None and req.held > 0:
                tokens = (req.prompt + req.output)[: req.held]
                res = self.store.insert(req.namespace, req.tenant, tokens, req.kv_slicer(), req.ttl_seconds)
                req.stats.stored_tokens = res.stored_tokens
        except BaseException as exc:  # noqa: BLE001 - the answer stands even if caching it failed
            log.warning("could not store KV of a finished request: %s", exc)
        finally:
            if req.lease is not None:
                self.store.release(req.lease)
            with self._cv:
                if req in self._active:
                    self._active.remove(req)
            req.finish_reason, req.error = reason, error
            req.stats.completion_tokens = len(req.output)
            req.stats.total_seconds = self._clock() - req.arrival
            if req.private is not None:  # free its slot now; keep it only for a request about to reuse it
                with self._cv:
                    reuse = bool(self._waiting) and not self._closed
                req.private.release(trim=not reuse)
            req.private = None
            req.done.set()

    # -- fallback ------------------------------------------------------------------
    def _unservable(self, req: BatchRequest) -> str | None:
        if self.layout is None:
            return f"model not supported by batching: {self.fallback_reason}"
        limit = self.layout.full_attention_limit
        total = len(req.prompt) + req.params.max_new_tokens
        if limit is not None and total > limit:
            return f"sequence of up to {total} tokens exceeds the sliding window ({limit})"
        return None

    def _run_fallback(self, req: BatchRequest) -> None:
        log.info("request served by the plain engine: %s", req.fallback_reason)
        try:
            if self.fallback is None:
                raise UnsupportedModelError(req.fallback_reason)
            fallback_generate(self.fallback, req)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller by wait()
            req.error = exc
        req.done.set()
