"""What sampling costs the batching engine: concurrent callers answered greedily against the same callers
sampling, with and without a seed (a seeded draw is ``generate()``'s ``torch.multinomial``, an unseeded one
inverts the distribution), and the host time of one sampled row's token.

Run: ``python -m benchmarks.sampling_cost [--callers 16] [--new 48] [--rounds 2]`` (embedded default model,
float32, CPU; ~2 min a round). ``--shape llama-1b`` takes a random-weight model of that shape instead
(``prefixcache.bench.gpu``; bfloat16 on CUDA where there is one); ``--no-rows`` skips the per-row table. Each round runs every way in turn on a fresh cache: ``callers`` threads call
``answer()`` (``generate()`` for a random model, which has no end-of-sequence token) at once on a stored 1,024-token system prompt with 32-token questions of their own, ``new``
tokens each (the end-of-sequence token ignored, so every way generates the same number of tokens). Ways:
greedy; sampled at temperature 0.8, unseeded and seeded; sampled at temperature 0.8 and top-p 0.95,
unseeded. ``answer()`` takes OpenAI's options (no top-k), ``generate()`` transformers' (top-k 50 by default).

Then, per sampled way, the host time of ``Sampler.next_token`` for one row of the model's vocabulary after
a 1,056-token context (median of 200), and a step's ``callers`` unseeded rows one by one against
``draw_rows`` on all of them at once.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from prefixcache import CacheConfig, PrefixCache
from prefixcache.bench.gpu import GpuSpec, _concurrently, build_model
from prefixcache.loading import load_default_model
from prefixcache.serving.request import SamplingParams
from prefixcache.serving.sampling import Sampler, draw_rows

SYSTEM, QUESTION = 1024, 32
WAYS: dict[str, dict] = {
    "greedy": {},
    "sampled, unseeded": {"do_sample": True, "temperature": 0.8},
    "sampled, seeded": {"do_sample": True, "temperature": 0.8, "seed": 0},
    "sampled top-p 0.95, unseeded": {"do_sample": True, "temperature": 0.8, "top_p": 0.95},
}


def callers(model, tokenizer, n: int, new: int, options: dict) -> tuple[float, list[int]]:
    gen, high = torch.Generator().manual_seed(0), min(40_000, model.config.vocab_size)
    system = torch.randint(3, high, (SYSTEM,), generator=gen).tolist()
    questions = [torch.randint(3, high, (QUESTION,), generator=gen).tolist() for _ in range(n)]
    with PrefixCache(model, tokenizer, CacheConfig(ttl_seconds=None), start_sweeper=False) as cache:
        cache.warm(system)

        def call(i: int) -> int:
            extra = {**options, "seed": options["seed"] + i} if "seed" in options else options
            prompt = system + questions[i]
            if tokenizer is not None:
                return len(cache.answer(prompt, max_new_tokens=new, ignore_eos=True, **extra).token_ids)
            out = cache.generate(torch.tensor([prompt]), max_new_tokens=new, **extra)  # a random model: no EOS
            return out.shape[1] - len(prompt)

        lengths, wall = _concurrently(call, n)
        return wall, lengths


def row_cost(vocab: int, options: dict) -> float:
    params = SamplingParams(max_new_tokens=64, temperature=options["temperature"], top_p=options.get("top_p"),
                            top_k=50, seed=options.get("seed"))
    prompt = list(range(SYSTEM + QUESTION))
    sampler, gen = Sampler(params, len(prompt)), torch.Generator().manual_seed(0)
    scores = torch.randn(vocab, generator=gen)
    output: list[int] = []
    times = []
    for _ in range(210):
        t0 = time.perf_counter()
        output.append(sampler.next_token(scores, prompt, output, gen))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[10:])


def step_cost(vocab: int, rows: int, options: dict, device: torch.device) -> tuple[float, float]:
    """A step's ``rows`` unseeded sampled rows: each through ``Sampler.next_token`` after a copy to the host,
    against ``draw_rows`` on all of them where the logits are (medians of 30, device drained)."""
    params = SamplingParams(max_new_tokens=64, temperature=options["temperature"], top_p=options.get("top_p"),
                            top_k=50)
    samplers = [Sampler(params, 1) for _ in range(rows)]
    gens = [torch.Generator().manual_seed(i) for i in range(rows)]
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)).to(device)
    alone, together = [], []
    for _ in range(30):
        t0 = time.perf_counter()
        for k, (sampler, gen) in enumerate(zip(samplers, gens, strict=True)):
            sampler.next_token(logits[k].float().cpu(), [0], [], gen)
        alone.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        draw_rows(logits.float(), [s.warp for s in samplers], [Sampler.uniform(g) for g in gens])
        together.append(time.perf_counter() - t0)
    return statistics.median(alone), statistics.median(together)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--callers", type=int, default=16)
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--shape", default=None, help="a random-weight model of this shape (bench.gpu.SHAPES)")
    parser.add_argument("--no-rows", action="store_true")
    args = parser.parse_args(argv)
    if args.shape is None:
        model, tokenizer = load_default_model(dtype=torch.float32)
    else:
        cuda = torch.cuda.is_available()
        model, tokenizer = build_model(GpuSpec(shape=args.shape), torch.bfloat16 if cuda else torch.float32,
                                       torch.device("cuda" if cuda else "cpu")), None
    print(f"model: {args.shape or 'default'}, {next(model.parameters()).device}, {torch.__version__}")
    callers(model, tokenizer, 2, 4, {})  # warm-up: the first cache's start-up and the model's first steps
    print(f"| round | way | {args.callers} callers' wall (s) | tokens/s | vs greedy |")
    print("|---|---|---|---|---|")
    for r in range(args.rounds):
        greedy = None
        for way, options in WAYS.items():
            wall, lengths = callers(model, tokenizer, args.callers, args.new, options)
            if any(n != args.new for n in lengths):
                raise SystemExit(f"{way}: a caller got {min(lengths)} tokens, not {args.new}")
            rate = args.callers * args.new / wall
            greedy = greedy or rate
            print(f"| {r + 1} | {way} | {wall:.2f} | {rate:.1f} | {rate / greedy:.2f}x |", flush=True)
    if args.no_rows:
        return
    device = next(model.parameters()).device
    print(f"\n| way | one step's {args.callers} unseeded sampled rows, one by one on the host (ms) | "
          "drawn together where the logits are (ms) |\n|---|---|---|")
    for way, options in WAYS.items():
        if options and "seed" not in options:
            alone, together = step_cost(model.config.vocab_size, args.callers, options, device)
            print(f"| {way} | {alone * 1e3:.2f} | {together * 1e3:.2f} |")
    print("\n| way | host time of one sampled row's token (ms, median of 200) |\n|---|---|")
    for way, options in WAYS.items():
        if options:
            print(f"| {way} | {row_cost(model.config.vocab_size, options) * 1e3:.3f} |")


if __name__ == "__main__":
    main()
