"""Token logprobs (``prefixcache.serving.logprobs``) in the shapes of OpenAI's APIs.

A token's ``token`` is its own text (``tokenizer.decode`` of it alone: part of a character reads as
U+FFFD) and ``bytes`` that text's UTF-8 bytes; a log-probability too small for a float is
OpenAI's -9999.0 (JSON has no -inf).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefixcache.serving.logprobs import TokenLogprob

#: What OpenAI reports for a token of probability zero.
UNLIKELY = -9999.0


class TokenText:
    """Token ids to their text, each decoded once per tokenizer."""

    def __init__(self, tokenizer: Any):
        self._tok = tokenizer
        self._seen: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._seen.get(token)
        if text is None:
            text = self._seen[token] = self._tok.decode([token], skip_special_tokens=False)
        return text


def _value(logprob: float) -> float:
    return logprob if logprob > UNLIKELY else UNLIKELY


def _one(text: TokenText, token: int, logprob: float, with_bytes: bool = True) -> dict[str, Any]:
    s = text(token)
    out: dict[str, Any] = {"token": s, "logprob": _value(logprob)}
    if with_bytes:
        out["bytes"] = list(s.encode("utf-8"))
    return out


def chat_content(entries: Sequence[TokenLogprob], text: TokenText, with_bytes: bool = True) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content``, the Responses API's ``output_text.logprobs``; without ``bytes`` (``with_bytes``
    False), its ``response.output_text.delta`` events' ``logprobs``."""
    return [{**_one(text, e.token, e.logprob, with_bytes),
             "top_logprobs": [_one(text, t, v, with_bytes) for t, v in e.top]} for e in entries]


def completion_logprobs(entries: Sequence[TokenLogprob], text: TokenText, offset: int) -> dict[str, Any]:
    """Legacy completions' ``logprobs``: tokens, their logprobs, each position's alternatives with the chosen
    token among them (up to ``logprobs`` + 1, as OpenAI's), and each token's offset in the text from ``offset``."""
    tokens = [text(e.token) for e in entries]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    tops = [{**{text(t): _value(v) for t, v in e.top}, text(e.token): _value(e.logprob)} for e in entries]
    return {"tokens": tokens, "token_logprobs": [_value(e.logprob) for e in entries], "top_logprobs": tops,
            "text_offset": offsets}
