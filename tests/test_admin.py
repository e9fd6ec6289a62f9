"""The admin fan-out's aggregation and command line (against live replicas: tests/bench/test_replicas.py)."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.admin import SUMMED, FanOut, aggregate_stats
from prefixcache.cli import build_parser

counts = st.fixed_dictionaries({name: st.integers(0, 10**6) for name in SUMMED})


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])  # a loaded shared machine is slow
@given(st.lists(counts, min_size=1, max_size=5))
def test_counters_are_summed_and_rates_recomputed_from_the_sums(replicas):
    total = aggregate_stats(replicas)
    for name in SUMMED:
        assert total[name] == sum(r[name] for r in replicas)
    queries, prompt = total["queries"], total["prompt_tokens"]
    assert total["hit_rate"] == ((total["hits"] + total["partial_hits"]) / queries if queries else 0.0)
    assert total["token_hit_rate"] == (total["cached_tokens"] / prompt if prompt else 0.0)


def test_a_replica_without_a_figure_counts_as_zero():
    # A tenant key's stats omit some figures (entries of other tenants, etc.): None adds nothing.
    total = aggregate_stats([{"queries": 2, "hits": 1, "entries": None}, {"queries": 2, "partial_hits": 1}])
    assert total["queries"] == 4 and total["entries"] == 0 and total["hit_rate"] == 0.5


def test_the_command_line_needs_replica_urls_and_an_action():
    parser = build_parser()
    args = parser.parse_args(["admin", "--replicas", "http://a:8000, http://b:8000/", "stats"])
    assert args.replicas == ["http://a:8000", "http://b:8000/"] and args.action == "stats"
    for bad in (["admin", "--replicas", "a:8000", "stats"], ["admin", "--replicas", "http://a:8000"],
                ["admin", "--replicas", "http://a", "prewarm"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    with pytest.raises(ValueError, match="at least one"):
        FanOut([], "key")
    with FanOut(["http://a:8000/"], "key") as fan:
        assert fan.replicas == ["http://a:8000"]


def test_the_admin_help_shows_the_timeout_default(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["admin", "--help"])
    assert "seconds per replica call (default: 300)" in " ".join(capsys.readouterr().out.split())
