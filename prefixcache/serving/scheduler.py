"""Request state and cache-aware admission for the batching engine (no model code here).

One ``BatchRequest`` carries a prompt through every stage: waiting (its prefix lease
already pinned, so its cached length is known) → prefill in chunks → decode → done.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from prefixcache.cache.store import Lease
from prefixcache.model.private_kv import PrivateKV
from prefixcache.serving.serial import CallStats


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Decoding settings of one request. ``temperature`` None or 0 = greedy."""

    max_new_tokens: int = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    eos_token_ids: frozenset[int] = frozenset()

    @property
    def greedy(self) -> bool:
        return not self.temperature


@dataclass(slots=True, eq=False)
class BatchRequest:
    prompt: list[int]
    namespace: tuple[str, ...]
    tenant: str
    params: SamplingParams
    ttl_seconds: float | None
    arrival: float
    on_token: Callable[[int], None] | None = None
    cancel: threading.Event | None = None
    lease: Lease | None = None
    private: PrivateKV | None = None
    generator: torch.Generator | None = None
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    fallback_reason: str | None = None  # why the plain engine served it (None = batched)
    error: BaseException | None = None
    stats: CallStats = field(default_factory=CallStats)
    done: threading.Event = field(default_factory=threading.Event)
    #: Lease steps read in place at every step; the cached tokens after them were copied
    #: into the private KV at admission (None: every step is read in place).
    read_steps: int | None = None

    @property
    def cached(self) -> int:
        return 0 if self.lease is None else self.lease.cached_tokens

    @property
    def base(self) -> int:
        """Tokens read in place from stored snapshots; the private KV holds the tokens from here on."""
        if self.lease is None or self.read_steps is None:
            return self.cached
        return sum(s.used for s in self.lease.steps[: self.read_steps])

    @property
    def held(self) -> int:
        """Tokens whose KV exists (prefix snapshots + private)."""
        return self.base + (0 if self.private is None else self.private.length)

    @property
    def prefilling(self) -> bool:
        return self.held < len(self.prompt)

    @property
    def segments(self) -> list[tuple[torch.Tensor, int]]:
        """Snapshots read in place: (tensor [L, 2, H, n, D], tokens used), in order."""
        if self.lease is None:
            return []
        return [(s.node.kv, s.used) for s in self.lease.steps[: self.read_steps]]

    @property
    def copied(self) -> list[tuple[torch.Tensor, int]]:
        """Cached snapshots after ``read_steps``: copied into the private KV at admission."""
        if self.lease is None or self.read_steps is None:
            return []
        return [(s.node.kv, s.used) for s in self.lease.steps[self.read_steps :]]

    @property
    def group(self) -> int:
        """Identity of the deepest shared snapshot: requests on the same prefix sort together."""
        return 0 if self.lease is None or not self.lease.steps else id(self.lease.steps[-1].node)

    def kv_slicer(self) -> Callable[[int, int], torch.Tensor]:
        """A ``KVSlicer``: fresh [L, 2, H, end-start, D] from the prefix snapshots and the private KV."""
        pieces: list[tuple[int, int, Callable[[int, int], torch.Tensor]]] = []
        pos = 0
        for snap, used in self.segments:
            pieces.append((pos, pos + used, lambda a, b, s=snap: s[:, :, :, a:b]))
            pos += used
        pieces.append((pos, self.held, self.private.window))  # pos == base

        def slice_kv(start: int, end: int) -> torch.Tensor:
            parts = [fn(max(start, lo) - lo, min(end, hi) - lo) for lo, hi, fn in pieces if start < hi and end > lo]
            return parts[0].clone() if len(parts) == 1 else torch.cat(parts, dim=3)
        return slice_kv

    @property
    def private_need(self) -> int:
        """Private tokens this request may hold at most (copied cached tail + suffix + answer)."""
        return len(self.prompt) - self.base + self.params.max_new_tokens


def admission_order(waiting: Sequence[BatchRequest], now: float, max_wait: float) -> list[BatchRequest]:
    """Starved requests first (waited > ``max_wait``, oldest first), then longest cached
    prefix first, requests on the same prefix together, then arrival order."""
    def key(r: BatchRequest):
        starved = now - r.arrival > max_wait
        return (0, r.arrival, 0, 0) if starved else (1, -r.cached, r.group, r.arrival)
    return sorted(waiting, key=key)


def plan_step(active: Sequence[BatchRequest], token_budget: int, prefill_chunk: int,
              idle_chunk: int) -> list[tuple[BatchRequest, int]]:
    """How many new tokens each request feeds this step: every decode 1, then prefill
    chunks (oldest first) within ``token_budget``, so a long prompt cannot stall decodes.

    Chunks are ``prefill_chunk`` tokens while the step makes someone's token: a decode, or a
    prompt that ends within its chunk. A step that makes nobody's token (only long prompts
    part-way through) keeps nobody waiting on its length, so each may feed up to ``idle_chunk``
    (``idle_chunk = prefill_chunk``: never more), the budget split evenly among them (a lone
    cold 2,176-token prompt fed 512 tokens a step instead of 128 prefilled ~1.4x faster on CPU).
    """
    plan = [(r, 1) for r in active if not r.prefilling]
    prefilling = sorted((r for r in active if r.prefilling), key=lambda r: r.arrival)
    chunk = prefill_chunk
    if prefilling and not plan and all(len(r.prompt) - r.held > prefill_chunk for r in prefilling):
        chunk = max(prefill_chunk, min(idle_chunk, token_budget // len(prefilling)))  # shared: none waits
    budget = token_budget - len(plan)
    for r in prefilling:
        n = min(chunk, len(r.prompt) - r.held, budget)
        if n <= 0:
            break
        plan.append((r, n))
        budget -= n
    return plan
