"""What idle threads' CPU workers cost the batching engine: releasing them (``model/threads.py``) against keeping them.

Run: ``python -m benchmarks.worker_threads [--rounds 2]`` (embedded default model, float32, CPU; ~2 min
a round). Each round runs both ways, in turn: "kept" with ``WorkerThreads.release`` a no-op (torch's
default: the thread that built the cache, and the batching loop between requests, keep their OpenMP
team while they live), "released" as shipped. Per way, on a fresh cache with the batching engine:

- the ``rag`` workload's 16 timed prompts, one after another: TTFT p50 with prefix reuse only, and
  blended at the default share (each on its own cache; the serial engine blends, the loop answers);
- eight threads calling ``generate()`` at once on a stored 2,048-token prompt (64-token questions,
  24 new tokens each, greedy): wall time and tokens/s.

Answers are compared between the two ways (they must be identical: only threads change).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import threading
import time
from unittest import mock

import torch

from prefixcache import CacheConfig, PrefixCache
from prefixcache.bench.rag import RagSpec, documents, prompts
from prefixcache.loading import load_default_model
from prefixcache.model.threads import WorkerThreads

CALLERS, PREFIX, QUESTION, NEW = 8, 2048, 64, 24


def rag(model, tokenizer) -> tuple[float, float, list[list[int]]]:
    spec = RagSpec()
    with PrefixCache(model, tokenizer, CacheConfig(ttl_seconds=None), start_sweeper=False) as plain, \
            PrefixCache(model, tokenizer, CacheConfig(ttl_seconds=None), start_sweeper=False) as blended:
        timed = prompts(plain, documents(tokenizer, spec, 0)[: spec.documents], spec.requests, spec, "timed")
        first, second, answers = [], [], []
        for p in timed:  # as the rag workload's timed table: documents stored at their first sight
            a = plain.answer(p.ids, max_new_tokens=spec.output_tokens, ignore_eos=True)
            b = blended.answer(p.ids, chunks=p.chunks, max_new_tokens=spec.output_tokens, ignore_eos=True)
            first.append(a.stats.ttft_seconds)
            second.append(b.stats.ttft_seconds)
            answers += [list(a.token_ids), list(b.token_ids)]
        return statistics.median(first), statistics.median(second), answers


def callers(model, tokenizer) -> tuple[float, list[list[int]]]:
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(100, 40_000, (PREFIX,), generator=gen).tolist()
    questions = [torch.randint(100, 40_000, (QUESTION,), generator=gen).tolist() for _ in range(CALLERS)]
    out: list[list[int]] = [[] for _ in range(CALLERS)]
    with PrefixCache(model, tokenizer, CacheConfig(ttl_seconds=None), start_sweeper=False) as cache:
        cache.warm(system)

        def call(i: int) -> None:
            res = cache.answer(system + questions[i], max_new_tokens=NEW, ignore_eos=True)
            out[i] = list(res.token_ids)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(CALLERS)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0, out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    model, tokenizer = load_default_model(dtype=torch.float32)
    if not WorkerThreads.of_torch().active:
        raise SystemExit("torch here does not run CPU operators on libgomp: nothing is released either way")
    print("| round | way | rag TTFT p50, prefix reuse only (s) | rag TTFT p50, blended (s) | 8 callers wall (s) | tokens/s |")
    print("|---|---|---|---|---|---|")
    reference: list | None = None
    for r in range(args.rounds):
        for way in ("kept", "released"):
            keep = mock.patch.object(WorkerThreads, "release", lambda self: None) if way == "kept" else \
                contextlib.nullcontext()
            with keep:
                prefix_only, blend, rag_answers = rag(model, tokenizer)
                wall, answers = callers(model, tokenizer)
            if reference is None:
                reference = [rag_answers, answers]
            same = [rag_answers, answers] == reference
            print(f"| {r + 1} | {way} | {prefix_only:.3f} | {blend:.3f} | {wall:.2f} | {CALLERS * NEW / wall:.1f} |"
                  + ("" if same else " answers differ |"), flush=True)


if __name__ == "__main__":
    main()
