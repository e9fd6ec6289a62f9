"""Time to first token from each tier, side by side in one run: device hit, disk restore, Redis
restore, recompute, and what configured tiers add to a plain miss.

Run: ``python -m benchmarks.tiers [--rounds 3] [--prefix 2048] [--question 128]``
(loads the embedded default model in float32; starts its own ``redis-server`` on a free
loopback port with a temporary directory and stops it; prints one JSON object).

Every round uses a new random prefix (so nothing carries over between rounds) and runs,
on four ``PrefixCache`` instances over the one model:

- ``recompute``: no tiers, prefix + question A, nothing cached (a plain miss);
- ``tiered_miss``: disk and Redis tiers configured, write-through, the same prompt, nothing
  cached anywhere (the order of these two alternates between rounds; the writer thread's
  work after it is waited for before the next timing and reported apart);
- ``device_hit``: no tiers, prefix + question B (the prefix is on the device);
- ``disk_restore``: a disk tier only, started after the tiered instance wrote its blocks (a
  restart: a disk tier indexes its directory at start-up), prefix + question B, its device empty;
- ``redis_restore``: a Redis tier only, the same.

TTFT is the wall time of ``generate(max_new_tokens=1)``; the tiered miss must answer as the
recompute, and both restores as the device hit. Reported: the median of the rounds and the ratios of the medians.

What the tiers add to a miss is far smaller than the round-to-round spread of a 2,176-token
prefill on a CPU, so each call's time is also split into the model's forward passes (timed by
hooks on the model) and the rest: the tiers' lookup, the store's insert and the queueing of
writes all lie outside the forward passes, and no tier work runs during them (the writes of
one call are waited for before the next). ``miss_overhead`` is the median, over the rounds,
of the tiered miss's time outside the model minus the recompute's, over the recompute's
median TTFT; ``model_time_ratio`` (the forward passes' median, tiered over plain) shows that
the part left out is the same work in both. ``miss_overhead_ttft`` is the plain ratio of
the TTFT medians, noise included.
"""
from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from prefixcache.config import CacheConfig
from prefixcache.sdk import PrefixCache

SECRET = "bench-secret-of-at-least-32-bytes"
SYSTEMS = ("recompute", "tiered_miss", "device_hit", "disk_restore", "redis_restore")


class ModelClock:
    """Seconds spent inside ``model``'s forward passes (hooks on its outermost module)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.seconds, self._clock, self._started = 0.0, clock, None

    def before(self, *_: object) -> None:
        self._started = self._clock()

    def after(self, *_: object) -> None:
        if self._started is not None:
            self.seconds += self._clock() - self._started
            self._started = None

    @contextmanager
    def watching(self, model: torch.nn.Module) -> Iterator[ModelClock]:
        hooks = (model.register_forward_pre_hook(self.before), model.register_forward_hook(self.after))
        try:
            yield self
        finally:
            for hook in hooks:
                hook.remove()


def timed(cache: PrefixCache, ids: torch.Tensor, model_clock: ModelClock) -> tuple[float, int, int, float]:
    """(seconds to the first token, that token, cached tokens, seconds of it inside the model)."""
    inside = model_clock.seconds
    start = time.perf_counter()
    out = cache.generate(ids, max_new_tokens=1, do_sample=False)
    return (time.perf_counter() - start, int(out[0, -1]), cache.last_call.cached_tokens,
            model_clock.seconds - inside)


def run(rounds: int, prefix_len: int, question_len: int, block_size: int, model: torch.nn.Module | None = None,
        tokenizer: Any = None) -> dict:
    """The benchmark on ``model`` and ``tokenizer`` (default: the embedded default model in float32)."""
    from prefixcache.loading import load_default_model
    from tests.support.redis_server import RedisServer

    if model is None:
        model, tokenizer = load_default_model(dtype="float32")
    vocab = model.get_input_embeddings().num_embeddings
    with tempfile.TemporaryDirectory(prefix="prefixcache-bench-tiers-") as tmp:
        redis = RedisServer(Path(tmp) / "redis")
        (Path(tmp) / "redis").mkdir()
        redis.start()
        try:
            disk = str(Path(tmp) / "disk")

            def make(**tiers) -> PrefixCache:
                cfg = CacheConfig(block_size=block_size, max_bytes=8 << 30, hash_secret=SECRET, **tiers)
                return PrefixCache(model, tokenizer, cfg, start_sweeper=False)

            caches = {"recompute": make(),
                      "tiered_miss": make(tier_disk=disk, tier_redis=redis.url, tier_write_policy="write-through",
                                          tier_redis_bytes=8 << 30),
                      "redis_restore": make(tier_redis=redis.url, tier_redis_bytes=8 << 30)}
            caches["device_hit"] = caches["recompute"]
            restarts = itertools.count()

            def restarted() -> PrefixCache:
                # A disk tier serves one process at a time (it locks its directory): a restarted server
                # is a new tier on a copy of the files the running one wrote.
                copy = Path(tmp) / f"disk-after-restart-{next(restarts)}"
                shutil.copytree(disk, copy)
                return make(tier_disk=str(copy))

            try:
                with ModelClock().watching(model) as clock:
                    summary = _rounds(caches, restarted, rounds, prefix_len, question_len, vocab, clock)
                params = sum(p.numel() for p in model.parameters())
                dtype = next(model.parameters()).dtype
                return {"model": f"{type(model).__name__}, {params / 1e6:.1f}M parameters, {dtype}", **summary}
            finally:
                for cache in {id(c): c for c in caches.values()}.values():
                    cache.close()
        finally:
            redis.stop()


def _rounds(caches: dict[str, PrefixCache], restarted_disk: Callable[[], PrefixCache], rounds: int, prefix_len: int,
            question_len: int, vocab: int, clock: ModelClock) -> dict:
    g = torch.Generator().manual_seed(0)

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(10, vocab, (1, n), generator=g)

    warm = tokens(64)
    for cache in caches.values():  # first-call costs (threads, allocations) out of the figures
        cache.generate(warm, max_new_tokens=1, do_sample=False)
    times: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    writes: list[float] = []
    cached: dict[str, list[int]] = {s: [] for s in SYSTEMS}
    model: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    for r in range(rounds):
        prefix = tokens(prefix_len)
        first = torch.cat([prefix, tokens(question_len)], dim=1)
        second = torch.cat([prefix, tokens(question_len)], dim=1)
        order = ("recompute", "tiered_miss") if r % 2 == 0 else ("tiered_miss", "recompute")
        answers: dict[str, int] = {}
        for name in order:
            _record(name, timed(caches[name], first, clock), times, cached, model, answers)
            if name == "tiered_miss":  # its blocks go down in the background: not during the next timing
                start = time.perf_counter()
                caches[name].tiers.flush_writes(300)
                writes.append(time.perf_counter() - start)
        disk = restarted_disk()
        disk.generate(warm, max_new_tokens=1, do_sample=False)
        try:
            for name, cache in (("device_hit", caches["device_hit"]), ("disk_restore", disk),
                                ("redis_restore", caches["redis_restore"])):
                _record(name, timed(cache, second, clock), times, cached, model, answers)
        finally:
            disk.close()
        if answers["tiered_miss"] != answers["recompute"] or len({answers[n] for n in SYSTEMS[2:]}) != 1:
            raise AssertionError(f"round {r}: a tier's answer differs from the device's: {answers}")
    summary = summarize(times, cached, model, rounds, prefix_len, question_len)
    summary["background_write_seconds"] = writes  # after each tiered miss: its blocks to disk and Redis
    return summary


def _record(name: str, result: tuple[float, int, int, float], times: dict, cached: dict, model: dict,
            answers: dict) -> None:
    seconds, token, hit, inside = result
    times[name].append(seconds)
    cached[name].append(hit)
    model[name].append(inside)
    answers[name] = token


def summarize(times: dict[str, list[float]], cached: dict[str, list[int]], model: dict[str, list[float]],
              rounds: int, prefix_len: int, question_len: int) -> dict:
    """The report of ``rounds`` rounds: per system its TTFTs and the seconds of them inside the model."""
    med = {name: statistics.median(v) for name, v in times.items()}
    rec = med["recompute"]
    outside = {name: [t - m for t, m in zip(times[name], model[name])] for name in SYSTEMS}
    extra = [t - p for t, p in zip(outside["tiered_miss"], outside["recompute"])]  # paired: same prompt
    return {
        "rounds": rounds,
        "prompt": f"{prefix_len}-token prefix + {question_len}-token question",
        "ttft_median_seconds": med, "ttft_seconds": times, "cached_tokens": cached,
        "model_seconds": model, "outside_model_seconds": outside,
        "ratio_to_recompute": {name: med[name] / rec for name in SYSTEMS},
        "miss_overhead": statistics.median(extra) / rec,
        "miss_overhead_each_round": [e / rec for e in extra],
        "model_time_ratio": statistics.median(model["tiered_miss"]) / statistics.median(model["recompute"]),
        "miss_overhead_ttft": med["tiered_miss"] / rec - 1.0,
    }


def main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tiers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefix", type=int, default=2048, help="prefix tokens")
    parser.add_argument("--question", type=int, default=128, help="question tokens")
    parser.add_argument("--block-size", type=int, default=64)
    args = parser.parse_args(argv)
    out(json.dumps(run(args.rounds, args.prefix, args.question, args.block_size), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
