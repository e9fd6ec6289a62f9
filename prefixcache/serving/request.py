"""One request's state, carried through every stage of the batching engine.

``Request`` goes waiting (its prefix lease already pinned, so its cached length is known)
→ prefilling in chunks → decoding → finished. Each stage writes its own fields: the
scheduler ``lease``, ``read_steps`` and ``private``; the engine ``output``, ``status``,
``finish_reason`` and ``error``. Token counts: ``cached_len`` (stored prefix it matched),
``base_len`` (read in place from snapshots), ``held_len`` (KV that exists), ``prompt``
and ``output`` lengths.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from prefixcache.cache.handles import Lease
from prefixcache.cache.scope import Scope
from prefixcache.model.private_kv import PrivateKV


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request chooses its tokens and when it stops.

    ``temperature`` None or 0 = greedy. ``repetition_penalty`` as transformers defines it
    (over prompt and output); ``presence_penalty``, ``frequency_penalty`` and ``logit_bias``
    as OpenAI defines them (penalties over generated tokens only). ``min_new_tokens``: the
    end-of-sequence tokens are masked until that many tokens exist. ``stop_strings``: stop
    once the text ends in one of them, as ``generate(stop_strings=...)`` does (kept in the output).
    ``constraint``: the answer's grammar (``structured.Constraint``; None: any text). ``logprobs``:
    report each token's log-probability and that many alternatives (``serving/logprobs.py``; None: none).
    """

    max_new_tokens: int = 16
    min_new_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    constraint: Any = None
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return not self.temperature


@dataclass(slots=True)
class CallStats:
    """What one call did. ``cached_tokens`` is the reused-token count the SDK reports."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    stored_tokens: int = 0
    lookup_seconds: float = 0.0
    ttft_seconds: float | None = None
    total_seconds: float = 0.0
    bypass_reason: str | None = None  # why the cache was not used at all
    executor: str = "batched"  # "batched" or "serial": which engine served the call
    #: Marked chunks (``serving/blend.py``): prompt tokens whose stored chunk KV was used (re-rotated), chunk
    #: tokens recomputed in context, chunk tokens computed alone and stored by this call, and why marked
    #: chunks were prefilled instead (None: blended, or none marked).
    chunk_reused_tokens: int = 0
    chunk_recomputed_tokens: int = 0
    chunk_stored_tokens: int = 0
    blend_reason: str | None = None
    #: Cache diagnostics, when the call asked (``previous_id``): why it could not reuse all of that call's
    #: prompt (a ``diagnostics.REASONS`` type; None: it could) and the previous prompt's tokens it missed.
    miss_reason: str | None = None
    cache_missed_tokens: int | None = None

    @property
    def outcome(self) -> str:
        """hit (all reusable tokens came from cache), partial, or miss."""
        if self.cached_tokens == 0:
            return "miss"
        return "hit" if self.cached_tokens >= self.prompt_tokens - 1 else "partial"


def finish_reason(output: Sequence[int], params: SamplingParams, stopped: bool, cancelled: bool) -> str:
    """Why generation ended: "stop" (an end-of-sequence token or a stop string), "length" or "cancelled"."""
    if stopped or (output and output[-1] in params.eos_token_ids):
        return "stop"
    if cancelled and len(output) < params.max_new_tokens:
        return "cancelled"
    return "length"


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"  # prefilling or decoding
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    prompt: list[int]
    scope: Scope  # where its prefix is looked up and its KV stored, for how long
    params: SamplingParams
    arrival: float
    on_token: Callable[[int], None] | None = None
    cancel: threading.Event | None = None
    #: Stop check after each token (prompt + output so far) -> stop now; built from ``stop_strings``.
    stop: Callable[[list[int]], bool] | None = None
    status: Status = Status.WAITING
    lease: Lease | None = None
    private: PrivateKV | None = None
    generator: torch.Generator | None = None
    #: A seeded request drawn where its logits are (``sampling.draw_seeded``): its generator there.
    device_generator: torch.Generator | None = None
    sampler: object | None = None  # the request's logits processors (``sampling.Sampler``), None: argmax
    output: list[int] = field(default_factory=list)
    #: With ``params.logprobs``: each output token's ``TokenLogprob``, appended before ``on_token`` sees it.
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    error: BaseException | None = None
    stats: CallStats = field(default_factory=CallStats)
    done: threading.Event = field(default_factory=threading.Event)
    #: Set when the waiter gives up (timeout, or its thread interrupted): the engine then
    #: cancels the request at its next step, as if ``cancel`` were set.
    abandoned: threading.Event = field(default_factory=threading.Event)
    #: Lease steps read in place at every step; the cached tokens after them were copied
    #: into the private KV at admission (None: every step is read in place).
    read_steps: int | None = None
    #: When admission first found no KV memory for it (it fails after ``kv_wait_seconds``).
    memory_wait_since: float | None = None

    @property
    def cached_len(self) -> int:
        return 0 if self.lease is None else self.lease.cached_tokens

    @property
    def base_len(self) -> int:
        """Tokens read in place from stored snapshots; the private KV holds the tokens from here on."""
        if self.lease is None or self.read_steps is None:
            return self.cached_len
        return sum(s.used for s in self.lease.steps[: self.read_steps])

    @property
    def held_len(self) -> int:
        """Tokens whose KV exists (prefix snapshots + private)."""
        return self.base_len + (0 if self.private is None else self.private.length)

    @property
    def prefilling(self) -> bool:
        return self.held_len < len(self.prompt)

    @property
    def prompt_left(self) -> int:
        """Prompt tokens whose KV does not exist yet."""
        return len(self.prompt) - self.held_len

    @property
    def cancelled(self) -> bool:
        return self.abandoned.is_set() or (self.cancel is not None and self.cancel.is_set())

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

    @property
    def private_need(self) -> int:
        """Private tokens this request may hold at most (copied cached tail + suffix + answer)."""
        return len(self.prompt) - self.base_len + self.params.max_new_tokens

    def kv_slicer(self) -> Callable[[int, int], torch.Tensor]:
        """A ``KVSlicer``: fresh [L, 2, H, end-start, D] from the prefix snapshots and the private KV."""
        pieces: list[tuple[int, int, Callable[[int, int], torch.Tensor]]] = []
        pos = 0
        for snap, used in self.segments:
            pieces.append((pos, pos + used, lambda a, b, s=snap: s[:, :, :, a:b]))
            pos += used
        pieces.append((pos, self.held_len, self.private.window))  # pos == base_len

        def slice_kv(start: int, end: int) -> torch.Tensor:
            parts = [fn(max(start, lo) - lo, min(end, hi) - lo) for lo, hi, fn in pieces if start < hi and end > lo]
            return parts[0].clone() if len(parts) == 1 else torch.cat(parts, dim=3)
        return slice_kv
