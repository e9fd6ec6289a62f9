"""prefixcache: prompt-prefix KV caching for Hugging Face causal LMs.

Layers, each importing only lower ones: ``cache`` (hashing, trie, policy, runs, store) ←
``model`` (layout, hf_cache, cascade, private_kv, cpu) ← ``serving`` (canonicalize,
scheduling, the batching and serial engines) ← ``sdk``. ``config`` and ``errors`` sit under
everything. Module map: docs/architecture.md.
"""
from prefixcache.config import CacheConfig
from prefixcache.errors import (
    CapacityError,
    ConfigError,
    ContextLengthExceededError,
    InvalidRequestError,
    ModelLoadError,
    PinQuotaExceededError,
    PrefixCacheError,
)
from prefixcache.loading import load_default_model, load_model
from prefixcache.sdk import GenerationResult, PrefixCache, Usage, WarmResult
from prefixcache.serving.breakpoints import CacheUsage
from prefixcache.serving.messages import MessagesPrompt

__all__ = [
    "CacheConfig", "CacheUsage", "CapacityError", "ConfigError", "ContextLengthExceededError", "GenerationResult",
    "InvalidRequestError", "MessagesPrompt", "ModelLoadError", "PinQuotaExceededError", "PrefixCache", "PrefixCacheError", "Usage", "WarmResult",
    "load_default_model", "load_model",
]
__version__ = "0.1.0"
