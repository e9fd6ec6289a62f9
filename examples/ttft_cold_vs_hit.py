"""Time to first token, cold vs hit, on the default model: S-token system prompt, Q-token question.

Run:  .venv/bin/python examples/ttft_cold_vs_hit.py --system-tokens 1024 --question-tokens 32
(``--model HUB_ID_OR_FOLDER`` or PREFIXCACHE_MODEL for another model than the embedded SmolLM2.)
Token ids are drawn from the vocabulary with a fixed seed, so sizes are exact.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics

import torch

from prefixcache import PrefixCache, load_default_model, load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--model", default=os.environ.get("PREFIXCACHE_MODEL"),
                        help="hub id or local folder of a causal LM (default: the embedded SmolLM2)")
    args = parser.parse_args()

    if args.model:
        model, tokenizer = load_model(args.model, dtype=args.dtype)
    else:
        model, tokenizer = load_default_model(dtype=args.dtype)
    rng = random.Random(0)
    draw = lambda n: [rng.randrange(100, 40_000) for _ in range(n)]  # noqa: E731
    system = draw(args.system_tokens)
    with PrefixCache(model, tokenizer, start_sweeper=False) as cache:  # closed on leaving: its engine stops
        cold, hit = [], []
        for _ in range(args.repeats):
            cache.flush()
            cache.generate(torch.tensor([system + draw(args.question_tokens)]), max_new_tokens=1, do_sample=False)
            cold.append(cache.last_call.ttft_seconds)
            cache.generate(torch.tensor([system + draw(args.question_tokens)]), max_new_tokens=1, do_sample=False)
            assert cache.last_call.cached_tokens == args.system_tokens, cache.last_call
            hit.append(cache.last_call.ttft_seconds)
    c, h = statistics.median(cold), statistics.median(hit)
    print(f"dtype={args.dtype} system={args.system_tokens} question={args.question_tokens} repeats={args.repeats}")
    print(f"cold TTFT median {c:.3f}s  ({', '.join(f'{x:.3f}' for x in cold)})")
    print(f"hit  TTFT median {h:.3f}s  ({', '.join(f'{x:.3f}' for x in hit)})")
    print(f"cold/hit = {c / h:.1f}x")


if __name__ == "__main__":
    main()
