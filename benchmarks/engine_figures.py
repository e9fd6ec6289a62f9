"""Figures of the batching engine on its own: decode step time, KV held, throughput.

Run: ``python -m benchmarks.engine_figures [--dtype bfloat16] [--new-tokens 128]``
(loads the embedded default model; prints one JSON object).

- ``step``: median seconds per decode step with N requests on one stored prefix vs 1.
- ``concurrent``: C requests on one stored prefix, all submitted at once to the batching
  engine vs served one at a time by the plain engine. Each path has its own store holding
  only the prefix, so neither reuses the other's questions. Reports output tokens/s of
  both and the peak KV the batching engine held (store + private pools) against the
  ideal ``prefix + C·(question + new tokens)``. The serial requests are served half before
  and half after the batched run, so a steady drift of the machine's speed weighs on both
  alike (this VM's drifts over minutes). With ``--rounds N`` this is repeated N times and
  each round's ratio is reported.
- ``latency``: TTFT of a short request alone and while a long uncached prompt prefills.
- ``turns``: decode step of 3 conversations on one system prompt, each with stored turns
  of its own, with and without copying each one's own history into its private KV.
- ``generate-threads`` (only with ``--only generate-threads``): C threads calling
  ``PrefixCache.generate()`` at once on one stored prefix vs the same calls one after another
  (half before, half after), each way on its own cache holding only the prefix; tokens/s of
  both and whether their tokens are identical.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

from prefixcache.cache.hashing import BlockHasher
from prefixcache.cache.scope import Scope
from prefixcache.cache.store import KVStore
from prefixcache.config import CacheConfig, check_int
from prefixcache.errors import ConfigError
from prefixcache.sdk import PrefixCache
from prefixcache.serving.engine import BatchConfig, BatchEngine
from prefixcache.serving.request import SamplingParams
from prefixcache.serving.serial import SerialEngine

SCOPE = Scope(("bench",), "bench")


def _store(block_size: int) -> KVStore:
    return KVStore(CacheConfig(block_size=block_size, max_bytes=16 << 30, ttl_seconds=None), BlockHasher(0),
                   time.monotonic)


def _prefix(length: int, vocab: int) -> list[int]:
    return [(200 + 13 * i) % vocab for i in range(length)]


def _question(i: int, length: int, vocab: int) -> list[int]:
    return [(300 + 11 * i + 7 * j) % vocab for j in range(length)]


def _vocab(model) -> int:
    return model.config.get_text_config(decoder=True).vocab_size


def steady_step_seconds(engine: BatchEngine, prompts: list[list[int]], new_tokens: int) -> float:
    """Median seconds per decode step once every prompt is decoding (after the last first token).

    Steps are timed from prompt 0's token callback, which runs once per step in the engine's loop.
    """
    stamps: list[float] = []

    def stamp(_token: int) -> None:
        stamps.append(time.monotonic())

    params = SamplingParams(max_new_tokens=new_tokens)
    with engine._cv:  # the loop plans once every prompt waits (a reentrant lock): they start together
        reqs = [engine.submit(p, SCOPE, params, on_token=stamp if i == 0 else None) for i, p in enumerate(prompts)]
    results = [engine.wait(r) for r in reqs]
    last_first = max(r.stats.ttft_seconds for r in results)
    start = reqs[0].arrival + last_first  # the engine's clock is time.monotonic: every request is decoding
    steady = [t for t in stamps if t > start]
    if len(steady) < 2:
        raise ValueError(f"only {len(steady)} decode steps with every request running: raise new_tokens")
    return statistics.median(b - a for a, b in zip(steady, steady[1:]))


def decode_step_seconds(engine: BatchEngine, prefix: list[int], batch: int, new_tokens: int,
                        question: int = 16) -> float:
    """Median seconds per decode step with ``batch`` requests on ``prefix`` (already stored)."""
    vocab = _vocab(engine.model)
    return steady_step_seconds(engine, [prefix + _question(i, question, vocab) for i in range(batch)], new_tokens)


def step_times(model, prefix_len: int = 2048, batch: int = 8, new_tokens: int = 16,
               block_size: int = 64) -> dict[str, float]:
    """Decode step time for ``batch`` requests vs 1 on a shared stored prefix (3 alternating runs each, best kept)."""
    engine = BatchEngine(model, _store(block_size), time.monotonic,
                         BatchConfig(max_batch=batch, token_budget=512, prefill_chunk=256))
    try:
        if engine.disabled_reason is not None:
            raise RuntimeError(f"model not served by the batching engine: {engine.disabled_reason}")
        prefix = _prefix(prefix_len, _vocab(model))
        engine.generate(prefix, SCOPE, SamplingParams(max_new_tokens=1))
        runs = [(decode_step_seconds(engine, prefix, 1, new_tokens),  # alternating: a drift of the
                 decode_step_seconds(engine, prefix, batch, new_tokens))  # machine's speed hits both
                for _ in range(3)]
        single, many = min(r[0] for r in runs), min(r[1] for r in runs)
        return {"single_step_s": single, f"batch{batch}_step_s": many, "ratio": many / single}
    finally:
        engine.close()


def concurrent_vs_serial(model, clients: int = 16, prefix_len: int = 2048, question: int = 128,
                         new_tokens: int = 16, block_size: int = 64, rounds: int = 1) -> dict[str, object]:
    """``clients`` requests on one stored prefix: batched (all at once) vs the one-at-a-time engine.

    Each round serves the first half of the requests one at a time, then all of them
    batched, then the second half one at a time (one serial engine and store for both
    halves; the batched path has its own store; each store starts with only the prefix, so
    neither reuses the other's questions). The serial halves bracket the batched run, so a
    steady drift of the machine's speed cancels out of the ratio. Reported: every round
    (with each half's seconds), and the medians over rounds.
    """
    check_int("rounds", rounds, 1, None)
    prefix = _prefix(prefix_len, _vocab(model))
    prompts = [prefix + _question(i, question, _vocab(model)) for i in range(clients)]
    per_round = []
    half = len(prompts) // 2
    for _ in range(rounds):
        serial = _serial_engine(model, prefix, block_size)
        before = _serial_seconds(serial, prompts[:half], new_tokens)
        batched = _batched_run(model, prefix, prompts, new_tokens, block_size)
        after = _serial_seconds(serial, prompts[half:], new_tokens)
        serial_s = before + after
        batched["serial_halves_s"] = [before, after]
        batched["serial_s"] = serial_s
        batched["serial_tok_s"] = clients * new_tokens / serial_s
        batched["batched_over_serial"] = batched["batched_tok_s"] / batched["serial_tok_s"]
        per_round.append(batched)
    ideal = prefix_len + clients * (question + new_tokens)
    peak = max(r["peak_kv_tokens"] for r in per_round)
    out: dict[str, object] = {"peak_kv_tokens": peak, "ideal_kv_tokens": ideal, "peak_over_ideal": peak / ideal}
    for key in ("batched_s", "serial_s", "batched_tok_s", "serial_tok_s", "batched_over_serial", "ttft_p50_s",
                "ttft_max_s"):
        out[key] = statistics.median(r[key] for r in per_round)
    if rounds > 1:
        out["rounds"] = per_round
    return out


def _batched_run(model, prefix: list[int], prompts: list[list[int]], new_tokens: int,
                 block_size: int) -> dict[str, float]:
    engine = BatchEngine(model, _store(block_size), time.monotonic,
                         BatchConfig(max_batch=len(prompts)))
    try:
        if engine.disabled_reason is not None:
            raise RuntimeError(f"model not served by the batching engine: {engine.disabled_reason}")
        per_token = engine.layout.bytes_per_token
        engine.generate(prefix, SCOPE, SamplingParams(max_new_tokens=1))
        peak = [engine.kv_bytes()]
        params = SamplingParams(max_new_tokens=new_tokens)
        t0 = time.perf_counter()
        reqs = [engine.submit(p, SCOPE, params, on_token=lambda _t: peak.append(engine.kv_bytes()))
                for p in prompts]
        outs = [engine.wait(r) for r in reqs]
        seconds = time.perf_counter() - t0
    finally:
        engine.close()
    ttfts = sorted(o.stats.ttft_seconds for o in outs)
    return {"batched_s": seconds, "batched_tok_s": sum(len(o.tokens) for o in outs) / seconds,
            "peak_kv_tokens": max(peak) / per_token, "ttft_p50_s": ttfts[len(ttfts) // 2], "ttft_max_s": ttfts[-1]}


def generate_threads(model, callers: int = 8, prefix_len: int = 2048, question: int = 64, new_tokens: int = 24,
                     block_size: int = 64) -> dict[str, object]:
    """``callers`` threads calling ``PrefixCache.generate()`` at once vs the same calls one after another.

    Greedy, exactly ``new_tokens`` each (``min_new_tokens``). The one-after-another calls are
    split in halves around the concurrent run, so a drift of the machine's speed weighs on both.
    """
    vocab = _vocab(model)
    prefix = _prefix(prefix_len, vocab)
    prompts = [torch.tensor([prefix + _question(i, question, vocab)]) for i in range(callers)]
    options = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
    config = CacheConfig(block_size=block_size, max_bytes=16 << 30, ttl_seconds=None)
    batching = BatchConfig()
    caches = [PrefixCache(model, None, config, start_sweeper=False, batching=batching) for _ in range(2)]
    try:
        for cache in caches:
            cache.warm(prefix)
        one_by_one, together = caches
        half = callers // 2
        t0 = time.perf_counter()
        seq = [one_by_one.generate(p, **options) for p in prompts[:half]]
        before = time.perf_counter() - t0
        outs: list[object] = [None] * callers
        steps = together.batcher.steps

        def call(i: int) -> None:
            outs[i] = together.generate(prompts[i], **options)

        threads = [threading.Thread(target=call, args=(i,), name=f"prefixcache-bench-caller-{i}")
                   for i in range(callers)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        concurrent_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        seq += [one_by_one.generate(p, **options) for p in prompts[half:]]
        after = time.perf_counter() - t0
        identical = all(o is not None and torch.equal(o, s) for o, s in zip(outs, seq))
        tokens = callers * new_tokens
        return {"callers": callers, "one_by_one_s": before + after, "one_by_one_halves_s": [before, after],
                "concurrent_s": concurrent_s, "one_by_one_tok_s": tokens / (before + after),
                "concurrent_tok_s": tokens / concurrent_s, "speedup": (before + after) / concurrent_s,
                "token_identical": identical, "concurrent_steps": together.batcher.steps - steps}
    finally:
        for cache in caches:
            cache.close()


def _serial_engine(model, prefix: list[int], block_size: int) -> SerialEngine:
    """The one-at-a-time engine with a store holding only ``prefix`` (its code paths warm)."""
    serial = SerialEngine(model, _store(block_size), time.monotonic)
    serial.generate(torch.tensor([prefix]), SCOPE, None, {"max_new_tokens": 1}, False)
    return serial


def _serial_seconds(serial: SerialEngine, prompts: list[list[int]], new_tokens: int) -> float:
    t0 = time.perf_counter()
    for p in prompts:
        serial.generate(torch.tensor([p]), SCOPE, None,
                        {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}, False)
    return time.perf_counter() - t0


def short_behind_long(model, long_tokens: int = 3072, prefix_len: int = 2048, question: int = 16,
                      new_tokens: int = 8, block_size: int = 64) -> dict[str, float]:
    """TTFT of a short request on a stored prefix, alone and while a long uncached prompt prefills.

    Chunked prefill must let the short one in between the long one's chunks, so its TTFT
    should stay near its own cost, far below the long prefill.
    """
    vocab = _vocab(model)
    prefix = _prefix(prefix_len, vocab)
    short = prefix + _question(1, question, vocab)
    long = [(5 + 17 * i) % vocab for i in range(long_tokens)]
    engine = BatchEngine(model, _store(block_size), time.monotonic, BatchConfig())
    try:
        engine.generate(prefix, SCOPE, SamplingParams(max_new_tokens=1))
        alone = engine.generate(short, SCOPE, SamplingParams(max_new_tokens=new_tokens)).stats.ttft_seconds
        engine.store.flush()
        engine.generate(prefix, SCOPE, SamplingParams(max_new_tokens=1))
        big = engine.submit(long, SCOPE, SamplingParams(max_new_tokens=1))
        time.sleep(0.5)  # the long prompt is some chunks in
        during = engine.generate(short, SCOPE, SamplingParams(max_new_tokens=new_tokens)).stats.ttft_seconds
        long_ttft = engine.wait(big).stats.ttft_seconds
    finally:
        engine.close()
    return {"short_alone_ttft_s": alone, "short_during_long_prefill_ttft_s": during, "long_prefill_ttft_s": long_ttft}


def conversation_steps(model, users: int = 3, turns: int = 3, system_len: int = 2048, question: int = 128,
                       answer: int = 32, new_tokens: int = 24, block_size: int = 64) -> dict[str, float]:
    """Decode step of ``users`` conversations on one system prompt, each with ``turns`` stored
    turns of its own (one insert per turn: a chain of runs), the next turn sent at once.

    Measured with the own-history copy at admission (``fold_max_tokens``, default) and
    without it (every stored run read in place each step), and for one conversation alone.
    """
    vocab = _vocab(model)
    system = _prefix(system_len, vocab)
    out: dict[str, float] = {}
    fold_default = BatchConfig().fold_max_tokens
    for label, fold, count in (("folded", fold_default, users), ("in_place", 0, users), ("alone", fold_default, 1)):
        engine = BatchEngine(model, _store(block_size), time.monotonic, BatchConfig(fold_max_tokens=fold))
        try:
            engine.generate(system, SCOPE, SamplingParams(max_new_tokens=1))
            history = [list(system) for _ in range(count)]
            for turn in range(turns):
                for u, h in enumerate(history):
                    h += _question(100 * u + turn, question, vocab)
                    h += engine.generate(h, SCOPE, SamplingParams(max_new_tokens=answer)).tokens
            prompts = [h + _question(100 * u + turns, question, vocab) for u, h in enumerate(history)]
            out[f"{label}_step_s"] = steady_step_seconds(engine, prompts, new_tokens)
        finally:
            engine.close()
    out["in_place_over_folded"] = out["in_place_step_s"] / out["folded_step_s"]
    out["folded_over_alone"] = out["folded_step_s"] / out["alone_step_s"]
    return out


def main(argv: list[str] | None = None) -> None:
    from prefixcache.loading import load_default_model

    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine_figures", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--prefix", type=int, default=2048, help="shared prefix tokens")
    parser.add_argument("--batch", type=int, default=8, help="requests decoding together (step figure)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent requests (throughput figure)")
    parser.add_argument("--question", type=int, default=128, help="tokens after the prefix per request")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1,
                        help="concurrent and generate-threads figures: rounds (medians reported, and each round)")
    parser.add_argument("--only", choices=("step", "concurrent", "latency", "turns", "generate-threads"),
                        default=None)
    parser.add_argument("--callers", type=int, default=8, help="threads calling generate() (generate-threads)")
    args = parser.parse_args(argv)
    try:
        check_int("rounds", args.rounds, 1, None)
    except ConfigError as exc:
        parser.error(str(exc))
    model, _ = load_default_model(dtype=getattr(torch, args.dtype))
    out: dict[str, object] = {"dtype": args.dtype, "threads": torch.get_num_threads()}
    if args.only in (None, "step"):
        out["step"] = step_times(model, args.prefix, args.batch, 16, args.block_size)
    if args.only == "generate-threads":
        runs = [generate_threads(model, args.callers, args.prefix, args.question, args.new_tokens, args.block_size)
                for _ in range(args.rounds)]
        out["generate_threads"] = {"speedup_median": statistics.median(r["speedup"] for r in runs),
                                   "token_identical": all(r["token_identical"] for r in runs), "rounds": runs}
    if args.only in (None, "concurrent"):
        out["concurrent"] = concurrent_vs_serial(model, args.clients, args.prefix, args.question, args.new_tokens,
                                                 args.block_size, args.rounds)
    if args.only in (None, "latency"):
        out["latency"] = short_behind_long(model, prefix_len=args.prefix, block_size=args.block_size)
    if args.only in (None, "turns"):
        out["turns"] = conversation_steps(model, system_len=args.prefix, question=args.question,
                                          block_size=args.block_size)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
