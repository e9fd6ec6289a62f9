"""OpenAI's prompt-cache breakpoints: ``prompt_cache_options`` and ``prompt_cache_breakpoint`` on content parts.

As OpenAI's client documents them: ``prompt_cache_breakpoint: {"mode": "explicit", "ttl":
"30m" | "12h"}`` on a text part marks the end of a reusable prefix (its TTL unset: the
request's); ``prompt_cache_options: {"mode": "implicit" | "explicit", "ttl": "30m" | "12h"}``
(mode unset: implicit; ttl unset: 30m). A request writes at most ``MAX_WRITTEN`` breakpoints:
in implicit mode one implicit breakpoint, at the end of the newest message that is not the
assistant's (the whole prompt of a text completion), and the latest three explicit ones; in
explicit mode the latest four explicit ones and no implicit one (none marked: nothing is
written). More may be marked; the earlier ones are not written.

A written breakpoint is kept as an Anthropic breakpoint is (``breakpoints.py``): its prefix
lives at least its TTL, refreshed whenever a request writes it again, nothing kept below
``breakpoint_min_tokens``; ``cache_write_tokens`` are the tokens after the read ones up to
the last breakpoint kept. Automatic prefix reuse stays on, as for every request.

A breakpoint's position is the tokens the prompt shares with the same request cut right after
the marked part (encoded without a generation prompt), as for Anthropic's blocks.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefixcache.errors import InvalidRequestError
from prefixcache.serving.breakpoints import OPENAI_TTLS, Breakpoint
from prefixcache.serving.canonicalize import Canonicalizer
from prefixcache.serving.messages import MessagesPrompt, common_prefix

MODES = ("implicit", "explicit")
DEFAULT_TTL = "30m"
MAX_WRITTEN = 4
FIELD = "prompt_cache_breakpoint"


def encode_chat(canon: Canonicalizer, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
                mode: str | None = None, ttl: str | None = None, continue_final: bool = False) -> MessagesPrompt:
    """A chat's ids and the breakpoints it writes, in prefix order (``continue_final``: the answer continues the
    last message). Raises ``InvalidRequestError``."""
    mode, ttl = _options(mode, ttl)
    encoded = canon.encode_chat(messages, tools, continue_final_message=continue_final)
    full = encoded.token_ids
    marks = _marks(messages, ttl)
    written = marks[-(MAX_WRITTEN - (mode == "implicit")):] if marks else []
    if mode == "implicit":
        newest = max((i for i, m in enumerate(messages) if m.get("role") != "assistant"), default=None)
        if newest is not None:
            written.append((Breakpoint(f"messages[{newest}]", ttl), (newest, None)))
    located: dict[int, Breakpoint] = {}
    for bp, cut in written:  # an explicit breakpoint where the implicit one falls: one write
        position = _position(canon, full, messages, tools, cut)
        located.setdefault(position, Breakpoint(bp.where, bp.ttl, position))
    return MessagesPrompt(full, tuple(located[p] for p in sorted(located)), encoded.chunks, encoded.unplaced)


def text_breakpoints(token_ids: Sequence[int], mode: str | None = None, ttl: str | None = None
                     ) -> tuple[Breakpoint, ...]:
    """A text completion's breakpoints: the implicit one closes the whole prompt; explicit mode writes none."""
    mode, ttl = _options(mode, ttl)
    return (Breakpoint("prompt", ttl, len(token_ids)),) if mode == "implicit" else ()


def _options(mode: str | None, ttl: str | None) -> tuple[str, str]:
    mode, ttl = mode or "implicit", ttl or DEFAULT_TTL
    if mode not in MODES:
        raise InvalidRequestError(f"prompt_cache_options.mode must be one of {list(MODES)}",
                                  param="prompt_cache_options.mode")
    _check_ttl(ttl, "prompt_cache_options.ttl")
    return mode, ttl


def _check_ttl(ttl: Any, param: str) -> None:
    if ttl not in OPENAI_TTLS:
        raise InvalidRequestError(f"{param} must be one of {sorted(OPENAI_TTLS)}", param=param)


def _marks(messages: Sequence[dict[str, Any]], ttl: str) -> list[tuple[Breakpoint, tuple[int, int | None]]]:
    """Every part with ``prompt_cache_breakpoint``, in prefix order."""
    found = []
    for m, message in enumerate(messages):
        content = message.get("content")
        for k, part in enumerate(content if isinstance(content, list) else []):
            marker = part.get(FIELD) if isinstance(part, dict) else None
            if marker is None:
                continue
            where = f"messages[{m}].content[{k}].{FIELD}"
            if not isinstance(marker, dict) or marker.get("mode") != "explicit":
                raise InvalidRequestError(f"{where}.mode must be 'explicit'", param=f"{where}.mode")
            own = marker.get("ttl")
            if own is not None:
                _check_ttl(own, f"{where}.ttl")
            found.append((Breakpoint(f"messages[{m}].content[{k}]", own or ttl), (m, k)))
    return found


def _position(canon: Canonicalizer, full: Sequence[int], messages: Sequence[dict[str, Any]],
              tools: Sequence[dict[str, Any]] | None, cut: tuple[int, int | None]) -> int:
    """Tokens ``full`` shares with the chat cut right after part ``k`` of message ``m`` (all of it: None)."""
    m, k = cut
    last = messages[m] if k is None else dict(messages[m], content=messages[m]["content"][: k + 1])
    ids = canon.encode_chat([*messages[:m], last], tools, add_generation_prompt=False).token_ids
    return common_prefix(full, ids)
