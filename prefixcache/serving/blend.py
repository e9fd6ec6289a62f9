"""Chunk blending: a marked chunk's KV reused anywhere in a prompt, a share of its tokens recomputed.

A marked chunk's KV is computed alone (positions from 0, nothing before it) and stored in
the KV store under the request's namespace plus ``CHUNK_PART``, keyed by the chunk's tokens:
per tenant (and salt), like every prefix, and reused by any prompt of that namespace that
holds the same tokens at any position.

Building a prompt's KV (``Blender.build``), after prefix reuse matched its first ``c`` tokens:

1. each chunk after ``c`` is looked up (a miss is computed alone now and stored) and its KV
   placed at the chunk's position, keys re-rotated (``model/blend.py``);
2. every prompt token after ``c`` runs through the first layers up to ``select_layer`` in
   context (a full prefill of those layers), which gives each reused token's deviation there;
3. the ``share`` of reused tokens that deviate most, and every token outside a chunk, run
   through the whole model in context, attending to the reused KV of the rest.

A prompt none of whose chunks after ``c`` is stored yet is not blended: the serial engine
prefills it exactly and then stores its chunks computed alone (``store_alone``), since a
blend would compute them all alone first. With share 1 every token is recomputed: a full
prefill. The prompt's last token is left to ``generate()``, so its logits come from the
blended KV. Only the KV before the first token still holding reused KV equals a full
prefill's; only that part is stored as a prefix. The blended prompt's KV is kept under
``blended_scope`` (never read as exact KV): a later blending call at the same share that
starts the same way reuses it as its prefix.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from prefixcache.cache.handles import Lease
from prefixcache.cache.scope import Scope
from prefixcache.cache.store import KVStore
from prefixcache.config import CacheConfig
from prefixcache.errors import InvalidRequestError, UnsupportedModelError
from prefixcache.model.blend import kv_deviation, rerotate, select_recompute
from prefixcache.model.hf_cache import (
    BlendCache,
    blend_forward,
    check_rerotation,
    compute_alone,
    enable_cascade_attention,
)
from prefixcache.model.layout import KVLayout
from prefixcache.serving.canonicalize import CHUNK_FIELD

log = logging.getLogger(__name__)

#: Namespace part under which chunks' KV (computed alone) is stored; a NUL: no name or id holds one.
CHUNK_PART = "\x00chunk"
#: Namespace part under which blended prompts' KV is kept, for blending calls of the same share only.
BLENDED_PART = "\x00blended"
#: Marked parts a request may hold: each one not stored yet costs a forward of its own under the model lock.
MAX_CHUNKS = 128
#: Layer whose KV deviation chooses the tokens to recompute (layer 0's KV has no context to deviate by).
SELECT_LAYER = 1
#: ``CallStats.blend_reason`` of a prompt none of whose marked chunks was stored yet (see ``SerialEngine._blend``).
FIRST_SIGHT = "no marked part of the prompt stored yet: prefilled exactly, the parts stored for later prompts"
#: ``CallStats.blend_reason`` of a call whose blended KV was evicted before the batching engine read it.
BLEND_LOST = "the blended KV was evicted (whole or in part) before use: the rest of the prompt was prefilled"
#: ``CallStats.blend_reason`` of a batched call whose blended KV the cache could not hold whole (budget or quota).
BLEND_UNSTORED = "the blended KV did not fit the cache (budget or tenant quota): the prompt was served from exact KV"
#: ``CallStats.blend_reason`` of a call whose model check raised (followed by the error): prefilled, checked again later.
CHECK_FAILED = "the re-rotation check failed, so the prompt was prefilled"
#: ``CallStats.blend_reason`` of a call whose blend raised (followed by the error): prefilled instead.
BLEND_FAILED = "the blend failed, so the prompt was prefilled"


def blended_scope(scope: Scope, share: float) -> Scope:
    """Where blended prompts of ``scope`` at recompute ``share`` are kept: never read as exact KV."""
    return scope.within(BLENDED_PART).within(f"{share:.6g}")


@dataclass(frozen=True, slots=True)
class BlendRequest:
    """Where a prompt's marked chunks lie (token spans ``[start, end)``, in order, disjoint) and the share to recompute."""

    chunks: tuple[tuple[int, int], ...]
    share: float


@dataclass(slots=True)
class BlendOutcome:
    """What ``Blender.build`` did. ``buffer``: the prompt's KV ``[L, 2, H, room, D]``, its first n - 1 tokens
    written (room: at least n - 1, as the caller asked)."""

    buffer: torch.Tensor
    stored: int  # chunk tokens computed alone and stored by this request (chunks not found)
    exact: int  # leading tokens whose KV equals a full prefill's
    reused_at: torch.Tensor  # long: the positions of chunk tokens whose stored KV was used as is (re-rotated), sorted
    recomputed_at: torch.Tensor  # long: the positions of chunk tokens recomputed in context, sorted

    @property
    def reused(self) -> int:
        return int(self.reused_at.numel())

    @property
    def recomputed(self) -> int:
        return int(self.recomputed_at.numel())


@dataclass(frozen=True, slots=True)
class BlendTally:
    """Where a blended prompt's chunk tokens came from, to count what a reader of its leading tokens used:
    ``[earlier_from, earlier_to)`` reused from a prompt blended before (``blended_scope``), then ``outcome``'s
    reused and recomputed positions (None: no chunk after that prefix)."""

    earlier_from: int
    earlier_to: int
    outcome: BlendOutcome | None

    def within(self, upto: int) -> tuple[int, int]:
        """Chunk tokens (reused, recomputed) among the first ``upto`` tokens of the blended KV."""
        reused = max(0, min(upto, self.earlier_to) - self.earlier_from)
        if self.outcome is None:
            return reused, 0
        return (reused + int((self.outcome.reused_at < upto).sum()),
                int((self.outcome.recomputed_at < upto).sum()))


class Blender:
    """Builds prompts' KV from stored chunks, once ``prepare`` found the model able to."""

    def __init__(self, model: torch.nn.Module, layout: KVLayout | None, store: KVStore,
                 select_layer: int = SELECT_LAYER):
        self.model, self.layout, self.store = model, layout, store
        self.select_layer = 0 if layout is None else min(select_layer, layout.num_layers - 1)
        self.shift = None
        self._checked = False
        self.unsupported_reason: str | None = "model not supported" if layout is None else None

    def prepare(self) -> str | None:
        """Why this call cannot blend, as its ``blend_reason`` (None: it can): the model is not supported, or the
        check failed for another reason just now (checked again next time). The first call checks re-rotation on
        a few tokens and switches the model to cascade-capable attention (left alone until a request blends);
        hold the model."""
        if not self._checked and self.layout is not None:
            try:
                self.shift = check_rerotation(self.model, self.layout)
                enable_cascade_attention(self.model)
            except UnsupportedModelError as exc:
                self._checked = True
                self.shift, self.unsupported_reason = None, str(exc)
                log.info("chunk blending off for this model: %s", exc)
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory: this call prefills, a later one checks again
                self.shift = None
                log.warning("the re-rotation check failed (%s): the prompt is prefilled, the check retried later", exc)
                return f"{CHECK_FAILED}: {type(exc).__name__}: {exc}"
            else:
                self._checked = True
        return None if self.unsupported_reason is None else f"model not supported: {self.unsupported_reason}"

    def build(self, prompt: Sequence[int], request: BlendRequest, lease: Lease, scope: Scope,
              room: int = 0) -> BlendOutcome | None:
        """The KV of ``prompt[:-1]`` with ``lease``'s prefix, the chunks placed and blended, in a buffer with room
        for ``room`` tokens (at least the prompt's); None when no chunk lies after the prefix. Holds the model:
        the caller serialises calls (after ``prepare`` returned None)."""
        if self.layout is None or self.shift is None:
            raise RuntimeError("build() before prepare() found the model able to blend")
        end, cached = len(prompt) - 1, lease.cached_tokens
        spans = [(max(s, cached), min(e, end), s, e) for s, e in request.chunks if min(e, end) > max(s, cached)]
        if not spans:
            return None
        layout = self.layout
        buffer = torch.empty((layout.num_layers, 2, layout.num_kv_heads, max(end, room), layout.head_dim), dtype=layout.dtype,
                             device=layout.device)
        pos = 0
        for step in lease.steps:
            buffer[:, :, :, pos : pos + step.used].copy_(step.node.kv[:, :, :, : step.used])
            pos += step.used
        stored = 0
        reused_mask = torch.zeros(end, dtype=torch.bool)
        for lo, hi, start, stop in spans:
            stored += self._place(buffer, list(prompt[start:stop]), start, lo, hi, scope)
            reused_mask[lo:hi] = True
        with torch.no_grad():
            selected = self._select(buffer, prompt, cached, end, reused_mask, request.share)
            compute = ~reused_mask
            compute[:cached] = False
            compute[selected] = True
            rows = torch.nonzero(compute).flatten()
            if rows.numel():
                ids = torch.tensor([prompt[i] for i in rows.tolist()], device=layout.device)
                blend_forward(self.model, ids, BlendCache(buffer, rows.to(layout.device)))
        approximate = torch.nonzero(reused_mask & ~compute).flatten()
        exact = int(approximate[0]) if approximate.numel() else end
        return BlendOutcome(buffer, stored, exact, approximate, selected)

    def stored(self, prompt: Sequence[int], request: BlendRequest, cached: int, scope: Scope) -> int:
        """Tokens of the chunks ending after ``cached`` already stored under ``scope`` (a look: nothing pinned)."""
        chunks = scope.within(CHUNK_PART)
        return sum(self.store.peek(chunks, prompt[s:e], e - s) for s, e in request.chunks if e > cached)

    def store_alone(self, prompt: Sequence[int], request: BlendRequest, cached: int, scope: Scope) -> int:
        """Compute alone and store the chunks ending after ``cached`` that are not stored yet, for later prompts
        (after a prompt was prefilled instead of blended); returns the tokens stored. Holds the model."""
        assert self.layout is not None
        stored = 0
        for s, e in request.chunks:
            if e > cached:
                stored += self._alone(list(prompt[s:e]), scope.within(CHUNK_PART), lambda segments: None)
        return stored

    def _alone(self, tokens: list[int], chunks: Scope, use: Callable[[list[tuple[torch.Tensor, int]]], None]) -> int:
        """Hand ``use`` the KV of the chunk ``tokens`` computed alone (snapshots, tokens used), computing and storing
        what is not stored yet; returns how many of its tokens were computed now."""
        lease = self.store.acquire(chunks, tokens, len(tokens), restore=True)
        try:
            segments = lease.segments
            stored = 0
            if lease.cached_tokens < len(tokens):
                cache = compute_alone(self.model, self.layout, tokens, segments)
                stored = len(tokens) - lease.cached_tokens
                self.store.insert(chunks, tokens, cache.slice)
                segments = [(cache.view(0, len(tokens)), len(tokens))]
            use(segments)
            return stored
        finally:
            self.store.release(lease)

    def _place(self, buffer: torch.Tensor, tokens: list[int], start: int, lo: int, hi: int, scope: Scope) -> int:
        """Write the chunk ``tokens`` (at ``start`` in the prompt) into ``buffer[..., lo:hi]``, re-rotated; returns
        how many of its tokens were computed alone and stored now."""

        def place(segments: list[tuple[torch.Tensor, int]]) -> None:
            offset = 0  # the segment's first token, in the chunk
            for snap, used in segments:
                a, b = max(offset, lo - start), min(offset + used, hi - start)
                if a < b:
                    rerotate(snap[:, :, :, a - offset : b - offset], start, self.shift,
                             out=buffer[:, :, :, start + a : start + b])
                offset += used

        return self._alone(tokens, scope.within(CHUNK_PART), place)

    def _select(self, buffer: torch.Tensor, prompt: Sequence[int], cached: int, end: int, reused: torch.Tensor,
                share: float) -> torch.Tensor:
        """Reused positions to recompute: run the prompt after ``cached`` through the layers up to the selection
        layer (their KV is then a full prefill's for every token) and keep the ``share`` deviating most there."""
        positions = torch.nonzero(reused).flatten()
        if share >= 1 or share <= 0:
            return positions if share >= 1 else positions[:0]
        rows = torch.arange(cached, end, device=self.layout.device)
        ids = torch.tensor(list(prompt[cached:end]), device=self.layout.device)
        cache = BlendCache(buffer, rows, stop_layer=self.select_layer)
        blend_forward(self.model, ids, cache)
        assert cache.previous is not None
        deviation = kv_deviation(cache.previous, buffer[self.select_layer, :, :, rows]).cpu()
        return select_recompute(deviation[reused[cached:end]], positions, share)


def blend_plan(chunks: Sequence[tuple[int, int]] | None, blend: bool | float | None, prompt_len: int,
               config: CacheConfig, unplaced: int = 0) -> tuple[BlendRequest | None, str | None]:
    """A call's ``BlendRequest`` (None: its chunks, if any, are prefilled) and why marked chunks are not blended.

    ``blend``: None or True = the server's share, False = off for this call, a number in [0, 1] = the
    share. Raises ``InvalidRequestError`` for a bad ``blend`` or spans outside the prompt, overlapping or
    out of order."""
    if blend is not None and not isinstance(blend, bool) and not (
            isinstance(blend, (int, float)) and 0 <= blend <= 1):
        raise InvalidRequestError("blend must be true, false or a recompute share in [0, 1]", param="blend")
    lost = f"{unplaced} marked part(s) not rendered verbatim by the chat template" if unplaced else None
    if not chunks:
        return None, lost
    if len(chunks) > MAX_CHUNKS:  # each is computed alone, one forward each, while the model is held
        raise InvalidRequestError(f"at most {MAX_CHUNKS} marked parts (documents) in one request; got {len(chunks)}",
                                  param="chunks")
    spans, end = [], 0
    for span in chunks:
        ok = isinstance(span, (tuple, list)) and len(span) == 2 and all(
            isinstance(x, int) and not isinstance(x, bool) for x in span)
        if not ok or not end <= span[0] < span[1] <= prompt_len:
            raise InvalidRequestError(f"chunks must be increasing, disjoint [start, end) token spans inside the "
                                      f"prompt of {prompt_len} tokens; got {span!r}", param="chunks")
        spans.append((span[0], span[1]))
        end = span[1]
    if blend is False:
        return None, "blending turned off for this request"
    if not config.blend:
        return None, "blending turned off on this server"
    share = config.blend_recompute_share if blend is None or blend is True else float(blend)
    return BlendRequest(tuple(spans), share), lost


def with_documents(messages: list[Any], documents: Sequence[str] | None) -> list[Any]:
    """``messages`` with ``documents`` as marked text parts, in order, at the start of the last user message."""
    if documents is None:
        return messages
    if isinstance(documents, str) or not isinstance(documents, Sequence) or not all(
            isinstance(d, str) and d for d in documents):
        raise InvalidRequestError("documents must be a list of non-empty strings", param="documents")
    last = next((i for i in range(len(messages) - 1, -1, -1)
                 if isinstance(messages[i], dict) and messages[i].get("role") == "user"), None)
    if last is None:
        raise InvalidRequestError("documents go into the last user message, and there is none", param="documents")
    content = messages[last].get("content")
    rest = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
    parts = [{"type": "text", "text": d, CHUNK_FIELD: True} for d in documents]
    return [*messages[:last], {**messages[last], "content": parts + rest}, *messages[last + 1:]]
