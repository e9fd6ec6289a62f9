"""The batching engine's own figures (python -m benchmarks.engine_figures) on a tiny model."""
from __future__ import annotations

import math
import statistics

import pytest

from benchmarks.engine_figures import (
    concurrent_vs_serial,
    conversation_steps,
    generate_threads,
    short_behind_long,
    step_times,
)
from prefixcache.errors import ConfigError
from tests.conftest import build_tiny


def test_step_times_on_a_tiny_model():
    model = build_tiny("llama-gqa")
    got = step_times(model, prefix_len=64, batch=4, new_tokens=6, block_size=16)
    assert set(got) == {"single_step_s", "batch4_step_s", "ratio"}
    assert _positive(got["single_step_s"], got["batch4_step_s"], got["ratio"])
    assert got["ratio"] == got["batch4_step_s"] / got["single_step_s"]


def _positive(*values: float) -> bool:
    return all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in values)


def test_concurrent_vs_serial_on_a_tiny_model():
    # question + new tokens = one private chunk (32), so the pool's granularity adds nothing here
    got = concurrent_vs_serial(build_tiny("llama-gqa"), clients=4, prefix_len=64, question=24, new_tokens=8,
                               block_size=16, rounds=2)
    assert got["ideal_kv_tokens"] == 64 + 4 * (24 + 8)
    assert got["peak_kv_tokens"] >= 64 + 4 * 24  # at least the prefix and every question were held at once
    assert got["peak_over_ideal"] <= 1.1
    assert got["batched_tok_s"] > 0 and got["serial_tok_s"] > 0 and 0 < got["ttft_p50_s"] <= got["ttft_max_s"]
    assert got["peak_over_ideal"] == got["peak_kv_tokens"] / got["ideal_kv_tokens"]
    rounds = got["rounds"]
    assert len(rounds) == 2  # each round: its own batched and serial run, and their ratio
    for r in rounds:
        assert r["batched_over_serial"] == r["batched_tok_s"] / r["serial_tok_s"] and r["serial_s"] > 0
        # both sides made every client's 8 tokens: rates are those 32 tokens over each side's time
        assert r["batched_tok_s"] == pytest.approx(4 * 8 / r["batched_s"])
        assert r["serial_tok_s"] == pytest.approx(4 * 8 / r["serial_s"])
        before, after = r["serial_halves_s"]  # serial halves bracket the batched run
        assert before > 0 and after > 0 and r["serial_s"] == before + after
    assert got["batched_over_serial"] == statistics.median(r["batched_over_serial"] for r in rounds)
    assert got["peak_kv_tokens"] == max(r["peak_kv_tokens"] for r in rounds)
    assert "rounds" not in concurrent_vs_serial(build_tiny("llama-gqa"), clients=2, prefix_len=32, question=8,
                                                new_tokens=2, block_size=16)
    with pytest.raises(ConfigError, match="rounds"):
        concurrent_vs_serial(build_tiny("llama-gqa"), clients=2, prefix_len=32, question=8, rounds=0)


def test_short_behind_long_on_a_tiny_model():
    got = short_behind_long(build_tiny("llama-gqa"), long_tokens=600, prefix_len=64, question=8, new_tokens=2,
                            block_size=16)
    assert set(got) == {"short_alone_ttft_s", "short_during_long_prefill_ttft_s", "long_prefill_ttft_s"}
    assert _positive(*got.values())


def test_conversation_steps_on_a_tiny_model():
    got = conversation_steps(build_tiny("llama-gqa"), users=2, turns=2, system_len=48, question=8, answer=4,
                             new_tokens=6, block_size=8)
    assert set(got) == {"folded_step_s", "in_place_step_s", "alone_step_s", "in_place_over_folded",
                        "folded_over_alone"}
    assert _positive(*got.values())
    assert got["in_place_over_folded"] == got["in_place_step_s"] / got["folded_step_s"]
    assert got["folded_over_alone"] == got["folded_step_s"] / got["alone_step_s"]


def test_generate_threads_on_a_tiny_model():
    got = generate_threads(build_tiny("llama-gqa"), callers=4, prefix_len=64, question=8, new_tokens=6, block_size=16)
    assert got["token_identical"] is True and got["callers"] == 4
    assert got["one_by_one_tok_s"] == pytest.approx(4 * 6 / got["one_by_one_s"])
    assert got["concurrent_tok_s"] == pytest.approx(4 * 6 / got["concurrent_s"])
    assert got["speedup"] == got["one_by_one_s"] / got["concurrent_s"]
    assert sum(got["one_by_one_halves_s"]) == got["one_by_one_s"]
    # the four callers shared steps: far fewer than the 4 x (1 prefill + 6 decode) of one-by-one calls
    assert got["concurrent_steps"] < 4 * 7
