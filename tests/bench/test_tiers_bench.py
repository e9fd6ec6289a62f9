"""The tier benchmark on a tiny model: real disk and Redis tiers, and its miss overhead split at the model."""
from __future__ import annotations

import torch

from benchmarks import tiers


class _Sleepy(torch.nn.Module):
    """A module whose forward takes ``cost`` seconds of the given clock."""

    def __init__(self, clock, cost: float):
        super().__init__()
        self.clock, self.cost = clock, cost

    def forward(self, x):
        self.clock.advance(self.cost)
        return x


def test_the_model_clock_counts_forward_passes_only(clock):
    model = _Sleepy(clock, 0.25)
    with tiers.ModelClock(clock).watching(model) as watch:
        model(torch.zeros(1))
        clock.advance(1.0)  # time outside the model
        model(torch.zeros(1))
    model(torch.zeros(1))  # hooks removed: not counted
    assert watch.seconds == 0.5


def test_the_overhead_is_the_paired_time_outside_the_model():
    # The forward passes vary by a second from round to round; the tiers add 10 ms outside them.
    model = {"recompute": [5.0, 6.0, 5.5], "tiered_miss": [6.0, 5.0, 5.5]}
    outside = {"recompute": [0.05, 0.06, 0.04], "tiered_miss": [0.06, 0.07, 0.05]}
    times = {s: [m + o for m, o in zip(model[s], outside[s])] for s in model}
    for name in ("device_hit", "disk_restore", "redis_restore"):
        times[name], model[name] = [0.5, 0.5, 0.5], [0.4, 0.4, 0.4]
    report = tiers.summarize(times, {s: [0, 0, 0] for s in times}, model, 3, 2048, 128)
    rec = report["ttft_median_seconds"]["recompute"]
    assert abs(report["miss_overhead"] - 0.01 / rec) < 1e-9
    assert [round(e * rec, 9) for e in report["miss_overhead_each_round"]] == [0.01, 0.01, 0.01]
    assert report["model_time_ratio"] == 1.0
    assert report["miss_overhead_ttft"] != report["miss_overhead"]  # the plain TTFT ratio carries the noise


def test_a_run_on_a_tiny_model_restores_from_disk_and_redis(chat_llama, tokenizer):
    report = tiers.run(rounds=2, prefix_len=96, question_len=16, block_size=16, model=chat_llama, tokenizer=tokenizer)
    assert report["rounds"] == 2 and report["model"].startswith("LlamaForCausalLM")
    assert report["cached_tokens"]["recompute"] == [0, 0] and report["cached_tokens"]["tiered_miss"] == [0, 0]
    for name in ("device_hit", "disk_restore", "redis_restore"):
        assert report["cached_tokens"][name] == [96, 96], name  # the whole prefix, from each tier
    for name in tiers.SYSTEMS:
        assert all(0 < m < t for m, t in zip(report["model_seconds"][name], report["ttft_seconds"][name])), name
    assert len(report["miss_overhead_each_round"]) == 2 and len(report["background_write_seconds"]) == 2
