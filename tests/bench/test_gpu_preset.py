"""``prefixcache bench --preset gpu`` end to end at CPU-sized shapes (the figures need CUDA)."""
from __future__ import annotations

import json

import torch

from prefixcache.bench import gpu
from prefixcache.serving.engine import BatchConfig, device_defaults


def test_the_gpu_preset_runs_every_workload_and_writes_its_figures(tmp_path):
    result = gpu.run_gpu(gpu.SMOKE, tmp_path, torch.device("cpu"))
    written = json.loads((tmp_path / "gpu.json").read_text())
    assert written["spec"]["shape"] == "tiny"
    assert result["parity"] == {"equal": gpu.SMOKE.parity_clients, "of": gpu.SMOKE.parity_clients,
                                "seconds": result["parity"]["seconds"]}
    assert result["hit"]["cached_tokens"] == gpu.SMOKE.cold_tokens
    assert result["clients"]["prefixcache_tok_s"] > 0 and "generate_batch_tok_s" in result["clients"]
    assert "ratio" in result["cold"] and "skipped" in result["memory"]
    assert "| cold 96 tokens" in gpu.table(result)


def test_defaults_are_sized_for_the_device():
    assert device_defaults("cpu", 24 << 30, 2, 46_000) == {}
    h100 = device_defaults("cuda", 80 << 30, 132, 32 << 10)
    assert h100["max_batch"] == 128 and h100["token_budget"] == 8192 and h100["prefill_chunk"] == 2048
    assert h100["max_private_tokens"] == (80 << 30) // 4 // (32 << 10)
    small = device_defaults("cuda", 8 << 30, 20, 32 << 10)
    assert small["max_batch"] == 32 and small["token_budget"] == 2048
    BatchConfig(**h100)  # valid


def test_batching_fields_over_the_device_defaults_are_checked():
    import pytest

    from prefixcache import PrefixCache
    from prefixcache.errors import ConfigError
    from tests.conftest import build_tiny

    with pytest.raises(ConfigError, match="max_batsh"):
        PrefixCache(build_tiny("llama-gqa"), batching={"max_batsh": 4}, start_sweeper=False)
    with pytest.raises(ConfigError, match="max_batch"):
        PrefixCache(build_tiny("llama-gqa"), batching={"max_batch": 0}, start_sweeper=False)
    with PrefixCache(build_tiny("llama-gqa"), batching={"max_batch": 3}, start_sweeper=False) as cache:
        assert cache.batcher.config.max_batch == 3 and cache.batching_disabled_reason is None
