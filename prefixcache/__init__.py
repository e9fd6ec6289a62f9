"""prefixcache: prompt-prefix KV caching for Hugging Face causal LMs.

Pipeline (one module per stage, each importing only earlier ones):
canonicalize → hashing → trie → policy → store → cascade → kv_cache → engine
→ scheduler → sampling → batching → sdk. ``config``, ``errors`` and ``loading`` are shared.
"""
from prefixcache.config import CacheConfig
from prefixcache.errors import (
    CapacityError,
    ConfigError,
    ContextLengthExceededError,
    InvalidRequestError,
    ModelLoadError,
    PrefixCacheError,
)
from prefixcache.loading import load_default_model, load_model
from prefixcache.sdk import GenerationResult, PrefixCache, Usage, WarmResult

__all__ = [
    "CacheConfig", "CapacityError", "ConfigError", "ContextLengthExceededError", "GenerationResult",
    "InvalidRequestError", "ModelLoadError", "PrefixCache", "PrefixCacheError", "Usage", "WarmResult",
    "load_default_model", "load_model",
]
__version__ = "0.1.0"
