"""The systems compared, one request at a time: what a user would write instead of prefixcache.

Each takes the full prompt of one request and returns its greedy output with timings.
Time to first token (TTFT) is taken the same way everywhere: a logits processor stamps
the clock when the first logits exist (prefill done), measured from just before the call.
"""
from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from prefixcache.bench.workloads import Request, Workload
from prefixcache.config import CacheConfig
from prefixcache.sdk import PrefixCache

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Served:
    output: tuple[int, ...]  # generated token ids (empty for the bare-forward limit)
    ttft: float  # seconds from the call to the first token's logits
    total: float  # seconds for the whole request
    cached_tokens: int | None  # prompt tokens reused; None when the system cannot tell


class FirstTokenTimer(LogitsProcessor):
    """Stamps ``clock()`` when the first logits are ready; leaves the scores alone."""

    def __init__(self, clock: Clock):
        self._clock, self.at = clock, None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.at is None:
            self.at = self._clock()
        return scores


def greedy_kwargs(model: torch.nn.Module, output_tokens: int) -> dict[str, Any]:
    """generate() options shared by every system: greedy, exactly ``output_tokens`` new tokens."""
    pad = model.generation_config.pad_token_id
    return {"max_new_tokens": output_tokens, "do_sample": False, "eos_token_id": None,  # EOS ignored
            "pad_token_id": 0 if pad is None else pad}


def cache_bytes(cache: Any) -> int:
    """Bytes of the key/value tensors a transformers cache holds."""
    total = 0
    for layer in getattr(cache, "layers", ()):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Measured, not derived from the config: one token through the model into a DynamicCache."""
    cache = DynamicCache()
    device = next(model.parameters()).device
    with torch.no_grad():
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), past_key_values=cache, use_cache=True)
    return cache_bytes(cache)


class _Sequential:
    name = ""

    def __init__(self, model: torch.nn.Module, output_tokens: int, clock: Clock = time.perf_counter):
        self.model, self.clock = model, clock
        self.gen = greedy_kwargs(model, output_tokens)
        self.device = next(model.parameters()).device

    def applies(self, workload: Workload) -> bool:
        return True

    def start(self, workload: Workload) -> None:
        """Fresh state for a workload: nothing carries over from the previous one."""

    def retained_bytes(self) -> int:
        """KV bytes kept between requests right now."""
        return 0

    def finish(self) -> None:
        pass

    def _ids(self, tokens: list[int]) -> torch.Tensor:
        return torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, n]

    def _prefill(self, tokens: tuple[int, ...]) -> DynamicCache:
        cache = DynamicCache(config=self.model.config)
        with torch.no_grad():
            self.model(input_ids=self._ids(list(tokens)), past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache


class PlainGenerate(_Sequential):
    """``model.generate()`` with no reuse: the baseline every ratio is taken against."""

    name = "generate"

    def serve(self, request: Request, prompt: list[int]) -> Served:
        ids, timer = self._ids(prompt), FirstTokenTimer(self.clock)
        t0 = self.clock()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                  logits_processor=LogitsProcessorList([timer]), **self.gen)
        t1 = self.clock()
        return Served(tuple(out[0, len(prompt):].tolist()), timer.at - t0, t1 - t0, 0)


class PrefixCacheSystem(_Sequential):
    """The prefixcache SDK's drop-in: ``PrefixCache(model).generate(...)``, default config
    without TTL. ``batching=False``: generate() never uses the batch loop, and this way the
    model's attention implementation stays as the other systems see it."""

    name = "prefixcache"

    def start(self, workload: Workload) -> None:
        self.cache = PrefixCache(self.model, None, CacheConfig(ttl_seconds=None), start_sweeper=False,
                                 batching=False)

    def serve(self, request: Request, prompt: list[int]) -> Served:
        ids, timer = self._ids(prompt), FirstTokenTimer(self.clock)
        t0 = self.clock()
        out = self.cache.generate(ids, logits_processor=LogitsProcessorList([timer]), **self.gen)
        t1 = self.clock()
        stats = self.cache.last_call
        return Served(tuple(out[0, len(prompt):].tolist()), timer.at - t0, t1 - t0, stats.cached_tokens)

    def retained_bytes(self) -> int:
        return int(self.cache.report().bytes)

    def finish(self) -> None:
        self.cache.check_integrity()
        self.cache.close()


class ManualReuse(_Sequential):
    """Reuse as the transformers docs teach it: prefill a known prefix once into a
    ``DynamicCache`` and ``copy.deepcopy`` it per request; a conversation passes the
    cache returned by its previous turn. The first request of a group pays the prefill."""

    name = "manual-reuse"

    def start(self, workload: Workload) -> None:
        self.workload = workload
        self.prefixes: dict[str, DynamicCache] = {}
        self.sessions: dict[str, DynamicCache] = {}

    def serve(self, request: Request, prompt: list[int]) -> Served:
        ids, timer = self._ids(prompt), FirstTokenTimer(self.clock)
        t0 = self.clock()
        cache = self.sessions.pop(request.session, None)
        reused = 0 if cache is None else cache.get_seq_length()
        if cache is None and request.group is not None:
            base = self.prefixes.get(request.group)
            if base is None:
                base = self.prefixes[request.group] = self._prefill(self.workload.prefixes[request.group])
            else:
                reused = base.get_seq_length()
            cache = copy.deepcopy(base)
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                  return_dict_in_generate=True, logits_processor=LogitsProcessorList([timer]),
                                  **self.gen)
        t1 = self.clock()
        if not request.last_in_session:
            self.sessions[request.session] = out.past_key_values
        return Served(tuple(out.sequences[0, len(prompt):].tolist()), timer.at - t0, t1 - t0, reused)

    def retained_bytes(self) -> int:
        return sum(cache_bytes(c) for c in (*self.prefixes.values(), *self.sessions.values()))


class PhysicalLimit(_Sequential):
    """The floor for a hit: a bare ``model(...)`` forward of the prompt's suffix against
    its group prefix, already prefilled. Prefill and ``deepcopy`` happen outside the timer;
    only the last position's logits are computed, as in ``generate()``'s prefill."""

    name = "limit"

    def applies(self, workload: Workload) -> bool:
        return workload.name == "shared-prefix"

    def start(self, workload: Workload) -> None:
        self.workload = workload
        self.prefixes: dict[str, DynamicCache] = {}

    def serve(self, request: Request, prompt: list[int]) -> Served:
        prefix = self.workload.prefixes[request.group]
        if request.group not in self.prefixes:
            self.prefixes[request.group] = self._prefill(prefix)
        cache = copy.deepcopy(self.prefixes[request.group])
        ids = self._ids(prompt[len(prefix):])
        with torch.no_grad():
            t0 = self.clock()
            self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            t1 = self.clock()
        return Served((), t1 - t0, t1 - t0, len(prefix))


SEQUENTIAL = {cls.name: cls for cls in (PlainGenerate, PrefixCacheSystem, ManualReuse, PhysicalLimit)}
