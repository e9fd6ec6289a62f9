"""The planner's replay benchmark measures a real replay of one grid point and says what it found."""
from __future__ import annotations

import json
import random

from benchmarks import planner_replay
from prefixcache.planner import synth
from prefixcache.planner.replay import Scenario, replay
from prefixcache.planner.trace import read_trace


def test_one_point_per_run_with_its_cpu_time_peak_memory_and_answer(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in synth.requests(300, 12, random.Random(3), rate=2.0)))
    ticks = iter(range(0, 100, 5))
    small = planner_replay.measure(str(path), "mooncake", 100, "40blocks", "5m", cpu=lambda: float(next(ticks)))
    assert (small["read_cpu_s"], small["replay_cpu_s"]) == (5.0, 5.0)  # each phase timed on the given clock
    expected = replay(read_trace([path], "mooncake"), Scenario(40 * 512 * 100, 300.0, 100))
    assert small["token_hit_rate"] == expected.token_hit_rate and small["evictions"] == expected.evictions
    assert small["evictions"]["lru"] > 0 and small["peak_bytes"] <= 40 * 512 * 100

    assert planner_replay.main([str(path), "--kv-bytes-per-token", "100", "--budget", "none", "--ttl", "none"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["budget_bytes"] is None and out["ttl_seconds"] is None and out["requests"] == 300
    assert out["evictions"]["lru"] == 0 and out["token_hit_rate"] >= small["token_hit_rate"]
    assert out["replay_cpu_s"] >= 0 and out["peak_rss_mib"] > 0


def test_a_bad_trace_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 1}\n')
    assert planner_replay.main([str(path), "--kv-bytes-per-token", "100"]) == 2
    assert f"{path}:1" in capsys.readouterr().err
