"""Errors in Anthropic's shape: ``{"type": "error", "error": {"type": ..., "message": ...}}``.

The proxy maps every exception once (``errors.map_exception``) to a status and OpenAI's
error object; on the Anthropic routes that status becomes Anthropic's status and error
type, so the official SDK raises its typed exceptions (``BadRequestError``,
``AuthenticationError``, ``RateLimitError``, ``OverloadedError``, …).
"""
from __future__ import annotations

from typing import Any

#: Routes whose errors take Anthropic's shape.
PREFIX = "/v1/messages"

#: Our status -> (Anthropic's status, error type). Anthropic answers overload with 529.
_TABLE = {400: (400, "invalid_request_error"), 401: (401, "authentication_error"), 403: (403, "permission_error"),
          404: (404, "not_found_error"), 405: (405, "invalid_request_error"), 408: (408, "timeout_error"),
          413: (413, "request_too_large"),
          429: (429, "rate_limit_error"), 499: (499, "invalid_request_error"), 503: (529, "overloaded_error"),
          504: (504, "timeout_error")}


def is_anthropic(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def anthropic_error(status: int, message: str) -> tuple[int, dict[str, Any]]:
    """Anthropic's status and body for an error the proxy answers with ``status``."""
    code, kind = _TABLE.get(status, (500, "api_error") if status >= 500 else (status, "invalid_request_error"))
    return code, {"type": "error", "error": {"type": kind, "message": message}}
