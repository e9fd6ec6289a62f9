"""prefixcache's own batch loop (continuous batching, cascade attention over cached prefixes),
fed by ``concurrency`` clients in a closed loop: each sends its next request when its
previous answer is complete. A request pins the longest cached prefix when it is
submitted, so requests sent before their prefix was first stored miss.
"""
from __future__ import annotations

import threading
import time

import torch

from prefixcache.bench.batch import BatchCall
from prefixcache.bench.systems import Served
from prefixcache.cache.scope import Scope
from prefixcache.config import CacheConfig
from prefixcache.sdk import DEFAULT_TENANT, PrefixCache
from prefixcache.serving.request import SamplingParams


class PrefixCacheBatched:
    name = "prefixcache-batched"

    def __init__(self, model: torch.nn.Module, output_tokens: int, concurrency: int):
        self.model, self.concurrency = model, concurrency
        # Greedy, exactly output_tokens tokens: no EOS ids.
        self.params = SamplingParams(max_new_tokens=output_tokens)
        self.notes: list[str] = []

    def start(self) -> None:
        self._attn = self.model.config._attn_implementation  # the batch loop switches it; restored in finish()
        self.cache = PrefixCache(self.model, None, CacheConfig(ttl_seconds=None), start_sweeper=False)
        if self.cache.batcher is None or self.cache.batcher.disabled_reason is not None:
            reason = None if self.cache.batcher is None else self.cache.batcher.disabled_reason
            self.notes.append(f"batching unavailable, served one at a time: {reason}")

    def finish(self) -> None:
        self.cache.check_integrity()
        self.cache.close()
        if self.model.config._attn_implementation != self._attn:
            self.model.set_attn_implementation(self._attn)

    def call(self, prompts: list[list[int]]) -> BatchCall:
        served: list[Served | None] = [None] * len(prompts)
        errors: list[BaseException] = []
        peak = [0]
        queue = iter(range(len(prompts)))
        lock = threading.Lock()

        def client() -> None:
            while True:
                with lock:
                    i = next(queue, None)
                if i is None or errors:
                    return
                try:
                    served[i] = self._one(prompts[i])
                    kv = self.cache.batcher.kv_bytes() if self.cache.batcher is not None else 0
                    with lock:
                        peak[0] = max(peak[0], kv)
                except BaseException as exc:  # reported by the caller's thread
                    errors.append(exc)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, name=f"prefixcache-bench-client-{k}", daemon=True)
                   for k in range(min(self.concurrency, len(prompts)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        if errors:
            raise RuntimeError(f"prefixcache-batched: {errors[0]!r}") from errors[0]
        return BatchCall([s for s in served if s is not None], wall, max(peak[0], self.cache.report().bytes))

    def _one(self, prompt: list[int]) -> Served:
        first: list[float] = []
        batcher = self.cache.batcher
        t0 = time.perf_counter()
        req = batcher.submit(prompt, Scope(self.cache.namespace(DEFAULT_TENANT), DEFAULT_TENANT), self.params,
                             on_token=lambda _t: first.append(time.perf_counter()) if not first else None)
        res = batcher.wait(req)
        t1 = time.perf_counter()
        return Served(tuple(res.tokens), (first[0] if first else t1) - t0, t1 - t0, res.stats.cached_tokens)
