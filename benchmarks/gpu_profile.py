"""Where the batching engine's time goes on CUDA: one cold prompt, one hit and one decode-heavy burst,
each under ``torch.profiler``, beside the same work through ``model.generate``.

Run: ``python benchmarks/gpu_profile.py [--tokens 8192] [--clients 64]`` on a machine with CUDA
(prints the top kernels by device time, host time per step and the host/device copies and syncs).
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from prefixcache import CacheConfig, PrefixCache
from prefixcache.bench.gpu import GpuSpec, _concurrently, _generate, _ids, build_model


def summarize(prof, label: str, rows: int = 12) -> None:
    events = prof.key_averages()
    copies = sum(e.count for e in events if "Memcpy" in e.key)
    syncs = sum(e.count for e in events if "Synchronize" in e.key)
    device_us = sum(e.self_device_time_total for e in events)
    print(f"\n== {label}: device {device_us / 1e3:.1f} ms, memcpy calls {copies}, synchronisations {syncs}")
    print(events.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--clients", type=int, default=64)
    args = parser.parse_args()
    spec = GpuSpec()
    device = torch.device("cuda")
    model = build_model(spec, torch.bfloat16, device)
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    with PrefixCache(model, config=CacheConfig(max_bytes=8 << 30), start_sweeper=False) as cache:
        _generate(cache, _ids(gen, 64, vocab), 2)
        prompt = _ids(gen, args.tokens, vocab)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _generate(cache, prompt, 1)
        summarize(prof, f"cold {args.tokens}")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _generate(cache, prompt + _ids(gen, 128, vocab), 1)
        summarize(prof, "hit + 128")
        prefix = _ids(gen, 2048, vocab)
        _generate(cache, prefix, 1)
        prompts = [prefix + _ids(gen, 64, vocab) for _ in range(args.clients)]
        steps = cache.batcher.steps
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _concurrently(lambda i: _generate(cache, prompts[i], 32), args.clients)
        wall = time.perf_counter() - start
        steps = cache.batcher.steps - steps
        summarize(prof, f"{args.clients} clients x 32 tokens: {steps} steps, {wall / steps * 1e3:.1f} ms a step "
                        "(profiled)")
    ids = torch.tensor([prompt], device=device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model.generate(ids, max_new_tokens=1, do_sample=False)
    summarize(prof, f"model.generate cold {args.tokens}")


if __name__ == "__main__":
    main()
