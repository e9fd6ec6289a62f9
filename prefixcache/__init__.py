"""prefixcache: prompt-prefix KV caching for Hugging Face causal LMs.

Layers, each importing only lower ones: ``cache`` (hashing, trie, policy, runs, store) ←
``model`` (layout, hf_cache, cascade, private_kv, cpu) ← ``serving`` (canonicalize,
scheduling, the batching and serial engines) ← ``sdk``. ``config`` and ``errors`` sit under
everything. Module map: docs/architecture.md.

The public names are imported on first use (``__getattr__``), so code that needs only a lower
layer (the capacity planner replays traces on ``cache`` alone) does not load torch and
transformers through ``import prefixcache``.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixcache.config import CacheConfig
    from prefixcache.errors import (
        CacheClosedError,
        CapacityError,
        ConfigError,
        ContextLengthExceededError,
        EngineFaultError,
        GenerationTimeoutError,
        InvalidRequestError,
        KVMemoryError,
        ModelLoadError,
        OutputFormatError,
        PinQuotaExceededError,
        PrefixCacheError,
        RequestCancelledError,
        TierPurgeError,
        ToolArgumentsError,
        ToolCallError,
        UnsupportedModelError,
    )
    from prefixcache.loading import load_default_model, load_model
    from prefixcache.sdk import GenerationResult, PrefixCache, Usage, WarmResult
    from prefixcache.serving.breakpoints import CacheUsage
    from prefixcache.serving.engine import BatchConfig
    from prefixcache.serving.logprobs import TokenLogprob
    from prefixcache.serving.messages import MessagesPrompt
    from prefixcache.serving.request import CallStats
    from prefixcache.serving.tool_calls import ToolCall

#: Every error class a caller may catch (``prefixcache.errors``; each derives from ``PrefixCacheError``).
_ERRORS = ("CacheClosedError", "CapacityError", "ConfigError", "ContextLengthExceededError", "EngineFaultError", "GenerationTimeoutError",
           "InvalidRequestError", "KVMemoryError", "ModelLoadError", "OutputFormatError", "PinQuotaExceededError", "PrefixCacheError",
           "RequestCancelledError", "TierPurgeError", "ToolArgumentsError", "ToolCallError",
           "UnsupportedModelError")

#: Each public name and the module that defines it.
_HOMES = {
    "CacheConfig": "prefixcache.config",
    **dict.fromkeys(_ERRORS, "prefixcache.errors"),
    "load_default_model": "prefixcache.loading", "load_model": "prefixcache.loading",
    **dict.fromkeys(("GenerationResult", "PrefixCache", "Usage", "WarmResult"), "prefixcache.sdk"),
    "CacheUsage": "prefixcache.serving.breakpoints",
    "BatchConfig": "prefixcache.serving.engine",
    "TokenLogprob": "prefixcache.serving.logprobs",
    "MessagesPrompt": "prefixcache.serving.messages",
    "CallStats": "prefixcache.serving.request",
    "ToolCall": "prefixcache.serving.tool_calls",
}

__all__ = sorted(_HOMES)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'prefixcache' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
