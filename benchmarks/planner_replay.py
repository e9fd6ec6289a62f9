"""CPU time and peak memory of the capacity planner's replay, one grid point per process.

Run: ``python -m benchmarks.planner_replay TRACE --format mooncake --kv-bytes-per-token B
--budget 20000blocks --ttl 1h`` (``--budget none``: the unlimited point). Prints one JSON object:
the CPU seconds spent reading the trace and replaying it (user + system of this process, so a
machine shared with other work does not inflate it as wall-clock time would), the peak RSS of
the process, and the point's hit rates and evictions, so the speed is measured on a known answer.

One point per process, so the peak RSS is that point's own: run the budgets and the unlimited
point as separate commands. ``python -m prefixcache.planner.synth`` writes a trace of any size.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from prefixcache.planner.replay import Scenario, replay
from prefixcache.planner.trace import FORMATS, read_trace
from prefixcache.planner.units import parse_duration, parse_size


def measure(path: str, fmt: str, kv_bytes_per_token: int, budget: str, ttl: str,
            cpu: Callable[[], float] = time.process_time) -> dict[str, Any]:
    """Read ``path`` and replay it at one budget and TTL; CPU seconds of each phase and the result."""
    start = cpu()
    trace = read_trace([path], fmt)
    read_s = cpu() - start
    block_bytes = trace.block_tokens * kv_bytes_per_token
    budget_bytes = None if budget == "none" else parse_size(budget, block_bytes)
    start = cpu()
    point = replay(trace, Scenario(budget_bytes, parse_duration(ttl), kv_bytes_per_token))
    replay_s = cpu() - start
    return {"requests": len(trace), "blocks": len(trace.ids), "budget_bytes": budget_bytes,
            "ttl_seconds": point.ttl_seconds, "read_cpu_s": round(read_s, 2), "replay_cpu_s": round(replay_s, 2),
            "replay_us_per_request": round(replay_s / len(trace) * 1e6, 1),
            "token_hit_rate": point.token_hit_rate, "request_hit_rate": point.request_hit_rate,
            "evictions": point.evictions, "peak_bytes": point.peak_bytes}


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.planner_replay",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a trace file (JSONL)")
    parser.add_argument("--format", choices=FORMATS, default="mooncake")
    parser.add_argument("--kv-bytes-per-token", type=int, required=True, metavar="B")
    parser.add_argument("--budget", default="none", help="bytes with a unit, Nblocks, or none (unlimited)")
    parser.add_argument("--ttl", default="1h", help="30s, 5m, 1h or none")
    args = parser.parse_args(argv)
    try:
        out = measure(args.trace, args.format, args.kv_bytes_per_token, args.budget, args.ttl)
    except ValueError as exc:  # TraceError included
        print(f"planner_replay: {exc}", file=sys.stderr)
        return 2
    out["peak_rss_mib"] = round(peak_rss_mib(), 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
