"""Per-step decode time of the batching engine: N requests on one shared prefix vs one request.

Run: ``python -c "from prefixcache.batch_bench import main; main()"`` (loads the default model).
"""
from __future__ import annotations

import statistics
import time

import torch

from prefixcache.batching import BatchConfig, BatchEngine
from prefixcache.config import CacheConfig
from prefixcache.hashing import BlockHasher
from prefixcache.scheduler import SamplingParams
from prefixcache.store import KVStore


def decode_step_seconds(engine: BatchEngine, prefix: list[int], batch: int, new_tokens: int,
                        question: int = 16) -> dict[str, float]:
    """Median seconds per decode step with ``batch`` requests on ``prefix`` (already stored)."""
    stamps: list[float] = []
    reqs = []
    for i in range(batch):
        prompt = prefix + [100 + (7 * i + j) % 500 for j in range(question)]
        on_token = (lambda _t: stamps.append(time.perf_counter())) if i == 0 else None
        reqs.append(engine.submit(prompt, ("bench",), "bench", SamplingParams(max_new_tokens=new_tokens),
                                  on_token=on_token))
    held = engine.kv_bytes()
    for r in reqs:
        engine.wait(r)
    steps = [b - a for a, b in zip(stamps[2:], stamps[3:])]  # skip the prefill steps
    return {"median_step_s": statistics.median(steps), "min_step_s": min(steps), "kv_bytes_at_submit": held}


def benchmark(model, prefix_len: int = 2048, batch: int = 8, new_tokens: int = 12,
              block_size: int = 256) -> dict[str, dict[str, float]]:
    """Decode step time for ``batch`` requests vs 1 on a shared ``prefix_len``-token prefix."""
    store = KVStore(CacheConfig(block_size=block_size, max_bytes=8 << 30), BlockHasher(0), time.monotonic)
    engine = BatchEngine(model, store, time.monotonic, BatchConfig(max_batch=batch, token_budget=512,
                                                                   prefill_chunk=256))
    try:
        if engine.fallback_reason is not None:
            raise RuntimeError(f"model not served by the batching engine: {engine.fallback_reason}")
        prefix = [200 + (13 * i) % 20000 for i in range(prefix_len)]
        t0 = time.perf_counter()
        engine.generate(prefix, ("bench",), "bench", SamplingParams(max_new_tokens=1))
        warm_s = time.perf_counter() - t0
        single = decode_step_seconds(engine, prefix, 1, new_tokens)
        many = decode_step_seconds(engine, prefix, batch, new_tokens)
        return {"warm_prefix": {"seconds": warm_s}, "single": single, f"batch{batch}": many}
    finally:
        engine.close()


def concurrent_vs_serial(model, clients: int = 16, prefix_len: int = 2048, question: int = 128,
                         new_tokens: int = 16, block_size: int = 64) -> dict[str, float]:
    """``clients`` requests on one stored prefix: batched (all submitted at once) vs one at a time.

    Reports peak KV held by the batching engine (store + private buffers, in tokens) against
    the ideal ``prefix + clients * (question + new_tokens)``, and output tokens/s of both paths.
    """
    from prefixcache.engine import Engine

    store = KVStore(CacheConfig(block_size=block_size, max_bytes=8 << 30), BlockHasher(0), time.monotonic)
    serial = Engine(model, store, time.monotonic)
    engine = BatchEngine(model, store, time.monotonic, BatchConfig(max_batch=clients), fallback=serial)
    try:
        per_token = engine.layout.bytes_per_token
        prefix = [200 + (13 * i) % 20000 for i in range(prefix_len)]
        engine.generate(prefix, ("bench",), "bench", SamplingParams(max_new_tokens=1))
        prompts = [prefix + [300 + (11 * i + j) % 9000 for j in range(question)] for i in range(clients)]
        params = SamplingParams(max_new_tokens=new_tokens)
        peak = [engine.kv_bytes()]
        t0 = time.perf_counter()
        reqs = [engine.submit(p, ("bench",), "bench", params, on_token=lambda _t: peak.append(engine.kv_bytes()))
                for p in prompts]
        outs = [engine.wait(r) for r in reqs]
        batched_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for p in prompts:  # the one-at-a-time engine on the same (now partly stored) prefix
            serial.generate(torch.tensor([p]), ("bench",), "bench", None,
                            {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}, None, False)
        serial_s = time.perf_counter() - t0
        produced = sum(len(o.tokens) for o in outs)
        ideal = prefix_len + clients * (question + new_tokens)
        return {"peak_kv_tokens": max(peak) / per_token, "ideal_kv_tokens": ideal,
                "peak_over_ideal": max(peak) / per_token / ideal,
                "batched_tok_s": produced / batched_s, "serial_tok_s": clients * new_tokens / serial_s,
                "batched_over_serial": (produced / batched_s) / (clients * new_tokens / serial_s)}
    finally:
        engine.close()


def main() -> None:
    from prefixcache import load_default_model

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, _tok = load_default_model()
    for name, row in benchmark(model).items():
        print(name, {k: round(v, 4) for k, v in row.items()})


if __name__ == "__main__":
    main()
