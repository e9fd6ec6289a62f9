"""The planner's outputs: a markdown table, JSON, and a plot of hit rate against budget (a line per TTL)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from prefixcache.planner.grid import CLOSE_ENOUGH, GridResult
from prefixcache.planner.units import format_duration, format_size
from prefixcache.plotting import PlottingUnavailable, pyplot


def markdown(grid: GridResult) -> str:
    tier2 = grid.knobs.get("tier2_bytes") is not None
    lines = [f"Replayed {grid.requests} requests ({grid.skipped} invalid lines skipped); blocks of "
             f"{grid.block_tokens} tokens, {format_size(grid.block_tokens * grid.kv_bytes_per_token)} each.", ""]
    if grid.logged_token_hit_rate is not None:
        lines += [f"The server itself reported a token hit rate of {grid.logged_token_hit_rate:.1%}.", ""]
    head = ["TTL", "budget", "token hit rate", "request hit rate"]
    head += ["tier-2 token hits", "tier-2 requests"] if tier2 else []
    head += ["evicted lru", "evicted quota", "expired", "mean bytes held", "peak bytes held"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in grid.points:
        row = [format_duration(p.ttl_seconds), format_size(p.budget_bytes), f"{p.token_hit_rate:.1%}",
               f"{p.request_hit_rate:.1%}"]
        if tier2:
            row += [f"{p.tier2_token_hit_rate:.1%}", str(p.tier2_hit_requests)]
        row += [str(p.evictions.get("lru", 0)), str(p.evictions.get("quota", 0)), str(p.evictions.get("ttl", 0)),
                format_size(int(p.mean_bytes)), format_size(p.peak_bytes)]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", f"Smallest budget within {CLOSE_ENOUGH * 100:g} points of the unlimited-budget token hit rate:", "",
              "| TTL | unlimited-budget token hit rate | smallest budget within 2 points |", "|---|---|---|"]
    for t in grid.ttls:
        best = grid.smallest_enough(t)
        lines.append(f"| {format_duration(t)} | {grid.point(None, t).token_hit_rate:.1%} | "
                     f"{format_size(best) if best is not None else 'none of the budgets tried'} |")
    return "\n".join(lines) + "\n"


def plot(grid: GridResult, path: Path) -> None:
    """Token hit rate against budget (log scale), one line per TTL; dotted: that TTL's unlimited budget."""
    plt = pyplot()  # PlottingUnavailable without the `bench` extra
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    gib = [b / 2**30 for b in grid.budgets]
    for t in grid.ttls:
        rates = [100 * grid.point(b, t).token_hit_rate for b in grid.budgets]
        (line,) = ax.plot(gib, rates, marker="o", label=f"TTL {format_duration(t)}")
        ax.axhline(100 * grid.point(None, t).token_hit_rate, color=line.get_color(), linestyle=":", linewidth=1)
        best = grid.smallest_enough(t)
        if best is not None:
            ax.plot([best / 2**30], [100 * grid.point(best, t).token_hit_rate], marker="*", markersize=14,
                    color=line.get_color())
    if len(gib) > 1 and max(gib) / max(min(gib), 1e-12) > 20:
        ax.set_xscale("log")
    ax.set_xlabel("KV budget (GiB)")
    ax.set_ylabel("token hit rate (%)")
    ax.set_title(f"{grid.requests} requests, {grid.block_tokens}-token blocks (dotted: unlimited budget; "
                 f"star: smallest within 2 points)", fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write(grid: GridResult, out: Path) -> dict[str, Path]:
    """``plan.md``, ``plan.json`` and ``plan.png`` in ``out``; without matplotlib, no PNG and one line saying so."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / "plan.md", "json": out / "plan.json"}
    paths["markdown"].write_text(markdown(grid))
    paths["json"].write_text(json.dumps(grid.as_dict(), indent=2) + "\n")
    try:
        plot(grid, out / "plan.png")
    except PlottingUnavailable as exc:
        print(exc, file=sys.stderr)
    else:
        paths["png"] = out / "plan.png"
    return paths
