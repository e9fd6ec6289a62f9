"""A synthetic Mooncake-format trace with realistic reuse, for measuring the planner at scale.

``python -m prefixcache.planner.synth OUT.jsonl --requests 100000 --blocks 50`` writes one
request per line: Poisson arrivals; a new conversation starts with one of a few hundred
shared system prompts (Zipf popularity) and continues with blocks of its own; a follow-up
turn reuses most of a recent conversation's blocks. Every request has exactly ``--blocks``
hash ids. Memory stays bounded: only recent conversations are remembered.
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
from collections import deque
from collections.abc import Iterator, Sequence


def requests(n: int, blocks: int, rng: random.Random, rate: float = 20.0, prompts: int = 500,
             follow_up: float = 0.35, block_tokens: int = 512) -> Iterator[dict]:
    """``n`` Mooncake-format records (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``)."""
    fresh = itertools.count()
    systems = [[next(fresh) for _ in range(rng.randint(min(8, blocks), min(32, blocks)))] for _ in range(prompts)]
    weights = [1 / (k + 1) ** 1.1 for k in range(prompts)]
    recent: deque[list[int]] = deque(maxlen=2000)
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        if recent and rng.random() < follow_up:
            base = recent[-1 - min(len(recent) - 1, int(rng.expovariate(1 / 50)))]
            shared = base[: rng.randint(blocks * 3 // 5, blocks - 1)]
        else:
            shared = rng.choices(systems, weights)[0]
        ids = shared + [next(fresh) for _ in range(blocks - len(shared))]
        recent.append(ids)
        yield {"timestamp": int(t * 1000), "input_length": blocks * block_tokens - rng.randrange(block_tokens),
               "output_length": rng.randint(16, 512), "hash_ids": ids}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefixcache.planner.synth", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="file to write (JSONL)")
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--blocks", type=int, default=50, help="hash ids per request")
    parser.add_argument("--rate", type=float, default=20.0, help="mean requests per second")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.requests < 1 or args.blocks < 1 or args.rate <= 0:
        parser.error("--requests and --blocks must be >= 1 and --rate > 0")
    with open(args.out, "w") as out:
        for record in requests(args.requests, args.blocks, random.Random(args.seed), args.rate):
            out.write(json.dumps(record, separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
