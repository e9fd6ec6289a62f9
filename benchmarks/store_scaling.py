"""Store work per inserted block under memory pressure, against how much is stored.

Run: ``python -m benchmarks.store_scaling [--sizes 1000 100000] [--rounds 200]``
(no model: tiny fake KV tensors; prints one JSON object).

For each size N the store is filled with N blocks (the budget is exactly N blocks), then
``rounds`` inserts of ``blocks_per_insert`` new blocks each follow, so every block inserted
evicts one. Reported per size: microseconds per inserted block, per lookup (a hit on a stored
prefix) and per ``snapshot_stats`` call. With an incremental eviction index these stay flat
as N grows; a store that scans its nodes per block grows linearly.
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence

import torch

from prefixcache.cache.hashing import BlockHasher
from prefixcache.cache.scope import Scope
from prefixcache.cache.store import KVStore
from prefixcache.config import CacheConfig

BLOCK = 4  # tokens per block
BYTES_PER_TOKEN = 2 * 4  # fake KV [L=1, 2, H=1, n, D=1] float32


class _Clock:
    """Moves forward by one tick per read, so every access has its own time (a strict LRU order)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-3
        return self.now


def _slicer(start: int, end: int) -> torch.Tensor:
    return torch.zeros(1, 2, 1, end - start, 1)


def _sequence(i: int, blocks: int) -> list[int]:
    # The first token tells sequences apart, so each one is a branch of its own.
    return [i] + [7] * (blocks * BLOCK - 1)


def measure(size: int, rounds: int, blocks_per_insert: int = 8, fill_blocks: int = 64,
            timer: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Fill a store with ``size`` blocks, then time inserts that each evict, lookups and stats."""
    cfg = CacheConfig(max_bytes=size * BLOCK * BYTES_PER_TOKEN, block_size=BLOCK, ttl_seconds=3600.0,
                      tenant_quota_bytes=None)
    store = KVStore(cfg, BlockHasher(1), _Clock())
    scope = Scope(("t", "bench"), "t")
    n = 0
    while n * fill_blocks < size:
        tokens = _sequence(n, min(fill_blocks, size - n * fill_blocks))
        store.insert(scope, tokens, _slicer)
        n += 1
    assert store.bytes == cfg.max_bytes, "the fill must reach the budget"
    start = timer()
    for r in range(rounds):
        store.insert(scope, _sequence(n + r, blocks_per_insert), _slicer)
    insert_us = (timer() - start) / (rounds * blocks_per_insert) * 1e6
    probe = _sequence(n + rounds - 1, blocks_per_insert)
    start = timer()
    for _ in range(rounds):
        store.release(store.acquire(scope, probe, len(probe) - 1))
    lookup_us = (timer() - start) / rounds * 1e6
    start = timer()
    for _ in range(rounds):
        store.snapshot_stats()
    stats_us = (timer() - start) / rounds * 1e6
    return {"stored_blocks": size, "insert_us_per_block": round(insert_us, 2),
            "lookup_us": round(lookup_us, 2), "stats_us": round(stats_us, 2)}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.store_scaling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 100_000], help="stored blocks")
    parser.add_argument("--rounds", type=int, default=200, help="timed inserts (and lookups, stats calls)")
    args = parser.parse_args(argv)
    print(json.dumps([measure(size, args.rounds) for size in args.sizes], indent=1))


if __name__ == "__main__":
    main()
