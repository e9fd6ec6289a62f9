"""Where a hit's first token goes: the phases of one ``PrefixCache.generate`` call on a cached prefix,
beside the bare forward of the same new tokens on a ready cache.

Run: ``python benchmarks/hit_breakdown.py [--tokens 8192] [--new 128] [--shape llama-1b]`` (CUDA, bfloat16;
on a CPU, float32). Phases, in milliseconds, median of the runs: ``submit`` (the call up to the request
queued), ``queued`` (until the loop plans it), ``plan`` (admission and step plan), ``step`` (the step's
tensors and its forward, kernel by kernel or replayed as a captured graph, device drained), ``sample``
(logits to token), ``return`` (from the token to the call's return). ``--series`` also prints each run's
figures, in order. On CUDA the hits of one size on one prefix are captured once seen twice (staged prompt
steps): the two warm-up runs see and capture it, the timed ones replay it; ``--eager`` times them kernel
by kernel instead (``captured_prompt_tokens=0``).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from prefixcache import CacheConfig, PrefixCache
from prefixcache.bench.gpu import GpuSpec, _ids, build_model
from prefixcache.serving import engine as engine_module
from prefixcache.serving import model_runner


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--shape", default="llama-1b")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--series", action="store_true", help="also print every run's first token and step")
    parser.add_argument("--eager", action="store_true", help="no staged prompt steps: every hit kernel by kernel")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = build_model(GpuSpec(shape=args.shape), torch.bfloat16 if cuda else torch.float32, device)

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    marks: dict[str, float] = {}
    run, schedule = model_runner.ModelRunner.run, engine_module.Scheduler.schedule
    submit = engine_module.BatchEngine.submit

    def timed_submit(self, *a, **k):
        req = submit(self, *a, **k)
        marks["submitted"] = time.perf_counter()
        return req

    def timed_schedule(self):
        marks["plan0"] = time.perf_counter()
        plan = schedule(self)
        marks["plan1"] = time.perf_counter()
        return plan

    def timed_run(self, plan):
        marks["step0"] = time.perf_counter()
        out = run(self, plan)
        marks["step1"] = now()
        return out

    class First:
        def __init__(self):
            self.puts = 0

        def put(self, value):
            self.puts += 1
            if self.puts == 2:
                marks["token"] = time.perf_counter()

        def end(self):
            pass

    engine_module.BatchEngine.submit, engine_module.Scheduler.schedule = timed_submit, timed_schedule
    model_runner.ModelRunner.run = timed_run
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prefix = _ids(gen, args.tokens, vocab)
    phases: dict[str, list[float]] = {}
    bare: list[float] = []

    batching = {"captured_prompt_tokens": 0} if args.eager else True
    with PrefixCache(model, config=CacheConfig(max_bytes=8 << 30), start_sweeper=False, batching=batching) as cache:
        cache.generate([prefix], max_new_tokens=1, do_sample=False)
        with torch.inference_mode():  # the model's own cache of the prefix, as a plain forward leaves it
            ready = model(input_ids=torch.tensor([prefix], device=device), use_cache=True).past_key_values
        for i in range(args.runs + 2):
            suffix = _ids(gen, args.new, vocab)
            marks.clear()
            start = now()
            cache.generate([prefix + suffix], max_new_tokens=1, do_sample=False, streamer=First())
            end = time.perf_counter()
            kv, ids = copy.deepcopy(ready), torch.tensor([suffix], device=device)
            t0 = now()
            with torch.inference_mode():
                int(model(input_ids=ids, past_key_values=kv, use_cache=True).logits[0, -1].argmax())
            t1 = now()
            if i < 2:
                continue  # warm-up
            bare.append(t1 - t0)
            m = marks
            for name, a, b in (("submit", start, m["submitted"]), ("queued", m["submitted"], m["plan0"]),
                               ("plan", m["plan0"], m["plan1"]), ("step", m["step0"], m["step1"]),
                               ("sample", m["step1"], m["token"]),
                               ("return", m["token"], end), ("first token", start, m["token"])):
                phases.setdefault(name, []).append(b - a)
    for name, values in phases.items():
        print(f"{name:12s} {statistics.median(values) * 1e3:8.2f} ms")
    graphs = cache.batcher.runner.graphs
    if graphs is not None:
        print(f"staged prompt steps replayed: {graphs.staged_replays}"
              + (f" (capturing off: {graphs.prefill_disabled})" if graphs.prefill_disabled else ""))
    print(f"{'bare forward':12s} {statistics.median(bare) * 1e3:8.2f} ms")
    if args.series:
        for name, values in (("first token", phases["first token"]), ("step", phases["step"]),
                             ("bare forward", bare)):
            print(f"{name:12s} " + " ".join(f"{v * 1e3:.1f}" for v in values))


if __name__ == "__main__":
    main()
