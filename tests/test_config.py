"""Configuration is validated; a bad value names the field and the allowed range."""
from __future__ import annotations

import pytest

from prefixcache import CacheConfig, ConfigError


@pytest.mark.parametrize("field, value", [
    ("max_bytes", -1), ("max_bytes", 1.5), ("block_size", 0), ("block_size", 10_000), ("ttl_seconds", 0),
    ("ttl_seconds", float("nan")), ("tenant_quota_bytes", -5), ("sweep_interval_seconds", 0),
    ("unicode_normalization", "NFX"), ("hash_seed", -1), ("block_size", True),
])
def test_bad_values_name_field_and_range(field, value):
    with pytest.raises(ConfigError) as err:
        CacheConfig(**{field: value})
    assert err.value.field == field and field in str(err.value) and "allowed" in str(err.value)


def test_defaults_are_valid():
    cfg = CacheConfig()
    assert cfg.ttl_seconds == 300.0 and cfg.block_size == 64 and cfg.max_bytes > 0
