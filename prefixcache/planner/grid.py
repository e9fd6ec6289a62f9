"""Every budget x TTL, plus an unlimited budget per TTL, and the smallest budget close to it."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prefixcache.planner.replay import PointResult, Scenario, logged_hit_rate, replay
from prefixcache.planner.trace import Trace

#: A budget is "enough" when its token hit rate is within this much of the unlimited budget's.
CLOSE_ENOUGH = 0.02


@dataclass(slots=True)
class GridResult:
    points: list[PointResult]  # every (budget, TTL), unlimited budgets included (budget_bytes None)
    budgets: list[int]
    ttls: list[float | None]
    requests: int
    skipped: int
    block_tokens: int
    kv_bytes_per_token: int
    logged_token_hit_rate: float | None
    knobs: dict[str, Any]

    def point(self, budget: int | None, ttl: float | None) -> PointResult:
        return next(p for p in self.points if p.budget_bytes == budget and p.ttl_seconds == ttl)

    def smallest_enough(self, ttl: float | None) -> int | None:
        """The smallest budget whose token hit rate is within ``CLOSE_ENOUGH`` of unlimited (None: none is)."""
        best = self.point(None, ttl).token_hit_rate
        ok = [b for b in self.budgets if self.point(b, ttl).token_hit_rate >= best - CLOSE_ENOUGH - 1e-12]
        return min(ok) if ok else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests, "skipped_invalid_lines": self.skipped, "block_tokens": self.block_tokens,
            "kv_bytes_per_token": self.kv_bytes_per_token, "block_bytes": self.block_tokens * self.kv_bytes_per_token,
            "logged_token_hit_rate": self.logged_token_hit_rate, "knobs": self.knobs,
            "smallest_budget_within_2_points": [{"ttl_seconds": t, "budget_bytes": self.smallest_enough(t),
                                                 "unlimited_token_hit_rate": self.point(None, t).token_hit_rate}
                                                for t in self.ttls],
            "points": [p.as_dict() for p in self.points],
        }


def run_grid(trace: Trace, budgets: Sequence[int], ttls: Sequence[float | None], base: Scenario,
             progress: Callable[[int], None] | None = None) -> GridResult:
    """Replay ``trace`` at every budget and TTL (``base`` gives the other knobs)."""
    budgets = sorted(set(budgets))
    points = [replay(trace, dataclasses.replace(base, budget_bytes=b, ttl_seconds=t), progress)
              for t in ttls for b in [*budgets, None]]
    knobs = {k: v for k, v in dataclasses.asdict(base).items() if k not in ("budget_bytes", "ttl_seconds")}
    return GridResult(points, budgets, list(ttls), len(trace), trace.skipped, trace.block_tokens,
                      base.kv_bytes_per_token, logged_hit_rate(trace), knobs)
