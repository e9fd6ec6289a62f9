"""Typed exceptions for everything a caller can cause.

The proxy maps these once, at its edge, to HTTP status codes and OpenAI error
objects. Internal invariants use ``assert``; these are for callers.
"""
from __future__ import annotations


class PrefixCacheError(Exception):
    """Base class of every error prefixcache raises on purpose."""


class ConfigError(PrefixCacheError, ValueError):
    """A configuration value is out of range; the message names the field and the allowed range."""

    def __init__(self, field: str, value: object, allowed: str):
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"{field}={value!r} is invalid: allowed {allowed}")


class ModelLoadError(PrefixCacheError, RuntimeError):
    """A model could not be found or loaded; the message says how to fix it."""


class InvalidRequestError(PrefixCacheError, ValueError):
    """A request is malformed (bad messages, empty prompt, unsupported argument)."""

    def __init__(self, message: str, param: str | None = None):
        self.param = param
        super().__init__(message)


class ContextLengthExceededError(InvalidRequestError):
    """Prompt tokens plus requested new tokens exceed the model's context window."""


class CapacityError(PrefixCacheError, RuntimeError):
    """The cache cannot hold what was asked (for example a pin larger than the budget)."""


class PinQuotaExceededError(CapacityError):
    """A tenant's pin would take its pinned bytes over ``CacheConfig.pin_quota_bytes``.

    The figures are the caller's own: its pinned bytes, its quota and what the pin needs.
    """

    def __init__(self, message: str, *, pinned_bytes: int, quota_bytes: int, need_bytes: int):
        self.pinned_bytes = pinned_bytes
        self.quota_bytes = quota_bytes
        self.need_bytes = need_bytes
        super().__init__(message)

    @classmethod
    def of(cls, pinned_bytes: int, quota_bytes: int, need_bytes: int) -> PinQuotaExceededError:
        """The error for a pin of ``need_bytes`` more, with the tenant's own figures in the message."""
        return cls(f"cannot pin {need_bytes} more bytes: the tenant's pin quota is {quota_bytes} bytes and "
                   f"{pinned_bytes} bytes are pinned already; unpin something, use a shorter prefix, or ask the "
                   f"operator (admin key) to pin it", pinned_bytes=pinned_bytes, quota_bytes=quota_bytes,
                   need_bytes=need_bytes)


class KVMemoryError(CapacityError):
    """A request's KV does not fit the total all KV memory may use (``CacheConfig.kv_total_bytes``),
    even after evicting the snapshots that may go, within the bounded wait; retry later."""


class UnsupportedModelError(PrefixCacheError, RuntimeError):
    """The model's cache layout cannot be shared as plain per-layer KV; serve uncached."""


class EngineFaultError(PrefixCacheError, RuntimeError):
    """The engine failed while serving this request (a fault, not the request's doing); retry.

    The original exception is the ``__cause__``. The engine goes on serving other requests,
    or, if its loop stopped, reports itself down and calls run on the serial engine.
    """

    @classmethod
    def wrapping(cls, exc: BaseException, what: str) -> EngineFaultError:
        """The error a caller gets for ``exc``, raised while the engine was ``what``."""
        fault = cls(f"the batching engine failed {what}: {type(exc).__name__}: {exc}; retry")
        fault.__cause__ = exc
        return fault


class GenerationTimeoutError(PrefixCacheError, TimeoutError):
    """A generation did not finish within the caller's timeout; it was cancelled in the engine."""


class RequestCancelledError(PrefixCacheError):
    """The caller cancelled the work (its ``cancel`` event was set) before it finished; nothing was kept."""


class TierPurgeError(PrefixCacheError, RuntimeError):
    """A flush could not reach every lower tier (the message names those it could not); retry later."""


class CacheClosedError(PrefixCacheError, RuntimeError):
    """A call on a ``PrefixCache`` (or its batching engine) after ``close()``: nothing was computed or stored."""


class ToolCallError(PrefixCacheError, RuntimeError):
    """``tool_choice`` asked for a call (any, or to a named tool) that the model's answer does not make."""


class ToolArgumentsError(PrefixCacheError, RuntimeError):
    """The model called a strict tool with arguments that do not match its schema (or are not a JSON object):
    the answer is not served, since a strict tool promises arguments that match."""


class OutputFormatError(ToolArgumentsError):
    """A structured answer (``response_format``) that does not match its schema, or is not JSON: not served.
    Constrained decoding prevents it; the check after generation makes sure."""
