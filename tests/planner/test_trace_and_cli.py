"""Trace readers, the plan command on a Mooncake trace with a known answer, errors and the what-if knobs."""
from __future__ import annotations

import json

import pytest

from prefixcache.cli import main
from prefixcache.planner.replay import Scenario, replay
from prefixcache.planner.trace import TraceError, read_trace, regroup
from prefixcache.planner.units import parse_duration, parse_size

# 4-token blocks, 1 byte per token: a block is 4 bytes. Requests at 0 s, 1 s, 2 s and 400 s.
MOONCAKE = [
    {"timestamp": 0, "input_length": 12, "output_length": 5, "hash_ids": [1, 2, 3]},
    {"timestamp": 1000, "input_length": 10, "output_length": 5, "hash_ids": [1, 2, 9]},  # 2 full blocks
    {"timestamp": 2000, "input_length": 13, "output_length": 5, "hash_ids": [1, 2, 3, 4]},
    {"timestamp": 400_000, "input_length": 8, "output_length": 5, "hash_ids": [1, 2]},  # may reuse 1 block
]


def write_lines(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def plan_json(capsys, *args):
    assert main(["plan", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_mooncake_trace_with_a_known_answer(tmp_path, capsys):
    trace = write_lines(tmp_path / "m.jsonl", MOONCAKE)
    out = plan_json(capsys, trace, "--format", "mooncake", "--block-tokens", 4, "--kv-bytes-per-token", 1,
                    "--budgets", "2blocks,64B", "--ttls", "5m,none", "--out", tmp_path / "out")
    rates = {(p["budget_bytes"], p["ttl_seconds"]): (p["cached_tokens"], p["hit_requests"]) for p in out["points"]}
    # Unlimited: 0 + 8 (2 blocks) + 12 (3 blocks) + 4 (1 block; its last token is recomputed) of 43 prompt tokens.
    assert rates[None, None] == (24, 3)
    assert rates[None, 300.0] == (20, 2)  # 400 s later the prefix has expired
    # Two blocks: the first request stores only [1, 2], so the third reuses 2 blocks, not 3.
    assert rates[8, None] == (20, 3) and rates[8, 300.0] == (16, 2)
    assert rates[64, None] == (24, 3)
    assert all(p["prompt_tokens"] == 43 for p in out["points"])
    best = {b["ttl_seconds"]: b["budget_bytes"] for b in out["smallest_budget_within_2_points"]}
    assert best == {300.0: 64, None: 64}
    assert (tmp_path / "out" / "plan.png").stat().st_size > 1000
    assert "| none | unlimited | 55.8%" in (tmp_path / "out" / "plan.md").read_text()


def test_second_tier_hits_are_reported_apart(tmp_path):
    trace = read_trace([write_lines(tmp_path / "m.jsonl", MOONCAKE[:3])], "mooncake", 4)
    # Nothing is evicted at three blocks: a second tier changes nothing.
    one = replay(trace, Scenario(3 * 4, None, 1, tier2_bytes=None))
    two = replay(trace, Scenario(3 * 4, None, 1, tier2_bytes=100))
    assert one.cached_tokens == two.cached_tokens and two.tier2_tokens == 0  # nothing was evicted
    evicting = read_trace([write_lines(tmp_path / "e.jsonl", [
        {"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [1, 2, 3]},
        {"timestamp": 1000, "input_length": 9, "output_length": 1, "hash_ids": [7, 8, 9]},
        {"timestamp": 2000, "input_length": 9, "output_length": 1, "hash_ids": [1, 2, 3]}])], "mooncake", 4)
    device_only = replay(evicting, Scenario(2 * 4, None, 1))
    tiered = replay(evicting, Scenario(2 * 4, None, 1, tier2_bytes=2 * 4))
    assert device_only.cached_tokens == tiered.cached_tokens == 0  # [1, 2] was evicted from the device
    assert (tiered.tier2_tokens, tiered.tier2_hit_requests) == (8, 1)  # and found in the second tier
    assert device_only.tier2_tokens == 0


def test_pins_and_block_size_what_ifs(tmp_path):
    trace = read_trace([write_lines(tmp_path / "e.jsonl", [
        {"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [1, 2, 3]},
        {"timestamp": 1000, "input_length": 9, "output_length": 1, "hash_ids": [7, 8, 9]},
        {"timestamp": 2000, "input_length": 9, "output_length": 1, "hash_ids": [1, 2, 3]}])], "mooncake", 4)
    assert replay(trace, Scenario(2 * 4, None, 1)).cached_tokens == 0  # the second request evicted [1, 2]
    pinned = replay(trace, Scenario(2 * 4, None, 1, pins=(("", (1,)),)))
    assert (pinned.cached_tokens, pinned.hit_requests) == (8, 2)  # the first and last hit the pinned block
    coarse = regroup(trace, 2)
    assert coarse.block_tokens == 8 and list(coarse.chain(0)) == [2] and coarse.match_blocks[0] == 1
    assert replay(coarse, Scenario(None, None, 1)).cached_tokens == 8


def test_malformed_line_names_file_and_line_or_is_skipped(tmp_path, capsys):
    path = write_lines(tmp_path / "bad.jsonl", [MOONCAKE[0], "{not json", MOONCAKE[1],
                                                {"timestamp": 5, "input_length": 12, "hash_ids": [1]}])
    with pytest.raises(TraceError, match=rf"{tmp_path}/bad.jsonl:2: not a JSON object"):
        read_trace([path], "mooncake", 4)
    assert main(["plan", str(path), "--format", "mooncake", "--block-tokens", "4", "--kv-bytes-per-token", "1",
                 "--budgets", "1KiB"]) == 2
    assert "bad.jsonl:2:" in capsys.readouterr().err
    out = plan_json(capsys, path, "--format", "mooncake", "--block-tokens", 4, "--kv-bytes-per-token", 1,
                    "--budgets", "1KiB", "--skip-invalid")
    assert out["skipped_invalid_lines"] == 2 and out["requests"] == 2


@pytest.mark.parametrize("record, message", [
    ({"timestamp": 0, "input_length": 12, "output_length": 1, "hash_ids": [1]}, "'hash_ids' has 1 ids"),
    ({"timestamp": -1, "input_length": 4, "output_length": 1, "hash_ids": [1]}, "'timestamp' must be"),
    ({"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": ["a"]}, "list of integers"),
    ([1, 2], "expected a JSON object"),
])
def test_each_bad_record_gets_its_reason(tmp_path, record, message):
    path = write_lines(tmp_path / "t.jsonl", [MOONCAKE[0], record])
    with pytest.raises(TraceError, match=f":2: .*{message}"):
        read_trace([path], "mooncake", 4)


def test_empty_log_is_an_error_not_a_zero_plot(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(TraceError, match="no requests to replay"):
        read_trace([empty], "prefixcache")
    assert main(["plan", str(empty), "--budgets", "1GiB", "--out", str(tmp_path / "o")]) == 2
    assert "no requests to replay" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_sizes_and_durations():
    assert parse_size("4GiB", 10) == 4 << 30 and parse_size("1.5KB", 10) == 1500 and parse_size("3blocks", 10) == 30
    assert parse_duration("5m") == 300 and parse_duration("1h") == 3600 and parse_duration("none") is None
    for bad in ("4 parsecs", "-1GiB", "0B"):
        with pytest.raises(ValueError):
            parse_size(bad, 10)
    with pytest.raises(ValueError):
        parse_duration("0s")


def test_a_pin_names_a_tenant_of_the_log_where_it_has_several():
    """A pin under no tenant of the log could never be hit: refused, not planned as a loss."""
    from prefixcache.planner.cli import _pin
    from prefixcache.planner.trace import Trace

    two = Trace(4, None, tenants=["alpha", "beta"])
    assert _pin("beta:1,2", two) == ("beta", (1, 2))
    with pytest.raises(ValueError, match="several tenants"):
        _pin("1,2", two)
    with pytest.raises(ValueError, match="no tenant 'gamma'"):
        _pin("gamma:1,2", two)
    assert _pin("1,2", Trace(4, None, tenants=["alpha"])) == ("alpha", (1, 2))  # the one tenant
