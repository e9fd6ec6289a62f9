"""Token logprobs (``prefixcache.serving.logprobs``) in the shapes of OpenAI's APIs.

A token's ``token`` is its own text (``tokenizer.decode`` of it alone: part of a character reads as
U+FFFD) and ``bytes`` the bytes it stands for (part of a character: that part, so consecutive tokens'
bytes join to the text); a log-probability too small for a float is OpenAI's -9999.0 (JSON has no -inf).
"""
from __future__ import annotations

import codecs
import re
from collections.abc import Sequence
from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode

from prefixcache.serving.logprobs import TokenLogprob

#: What OpenAI reports for a token of probability zero.
UNLIKELY = -9999.0


#: A SentencePiece byte-fallback token, one byte: ``<0xE2>``.
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


#: Byte-level BPE's (GPT-2's) printable stand-in of each byte, to that byte.
_BYTE_LEVEL = {char: byte for byte, char in bytes_to_unicode().items()}


def _is_byte_level(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` is a fast byte-level BPE one, its tokens spelling their bytes in ``_BYTE_LEVEL``."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


class TokenText:
    """Token ids to their text and bytes, each worked out once per tokenizer."""

    def __init__(self, tokenizer: Any):
        self._tok = tokenizer
        self._seen: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}
        self._byte_level = _is_byte_level(tokenizer)
        self._added = set(getattr(tokenizer, "added_tokens_decoder", None) or ())

    def __call__(self, token: int) -> str:
        text = self._seen.get(token)
        if text is None:
            text = self._seen[token] = self._tok.decode([token], skip_special_tokens=False)
        return text

    def bytes(self, token: int) -> bytes:
        """The bytes ``token`` stands for: its piece's bytes where it is a byte-level or byte-fallback one (part
        of a character: that part), else its text's UTF-8."""
        raw = self._bytes.get(token)
        if raw is None:
            raw = self._bytes[token] = self._raw(token)
        return raw

    def _raw(self, token: int) -> bytes:
        if token not in self._added:
            piece = self._tok.convert_ids_to_tokens(token)
            if isinstance(piece, str):
                if (byte := _BYTE_PIECE.fullmatch(piece)) is not None:
                    return bytes([int(byte.group(1), 16)])
                if self._byte_level and piece and all(c in _BYTE_LEVEL for c in piece):
                    return bytes(_BYTE_LEVEL[c] for c in piece)
        return self(token).encode("utf-8")


class TextOffsets:
    """Completions' ``text_offset``: each token's offset in its answer's text, counted in characters over the
    tokens' bytes (``TokenText.bytes``), so tokens that each hold part of a character count it once. A token
    starting inside a character has that character's offset."""

    def __init__(self, start: int = 0):
        self.at = start
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def take(self, raw: bytes) -> int:
        """The offset of a token of bytes ``raw`` coming next; moves past it."""
        offset = self.at
        self.at += len(self._decoder.decode(raw))
        return offset


def _value(logprob: float) -> float:
    return logprob if logprob > UNLIKELY else UNLIKELY


def _one(text: TokenText, token: int, logprob: float, with_bytes: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {"token": text(token), "logprob": _value(logprob)}
    if with_bytes:
        out["bytes"] = list(text.bytes(token))
    return out


def chat_content(entries: Sequence[TokenLogprob], text: TokenText, with_bytes: bool = True) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content``, the Responses API's ``output_text.logprobs``; without ``bytes`` (``with_bytes``
    False), its ``response.output_text.delta`` events' ``logprobs``."""
    return [{**_one(text, e.token, e.logprob, with_bytes),
             "top_logprobs": [_one(text, t, v, with_bytes) for t, v in e.top]} for e in entries]


def completion_logprobs(entries: Sequence[TokenLogprob], text: TokenText, offsets: TextOffsets) -> dict[str, Any]:
    """Legacy completions' ``logprobs``: tokens, their logprobs, each position's alternatives with the chosen
    token among them (up to ``logprobs`` + 1, as OpenAI's), and each token's offset in the text (``offsets``, moved
    past them: a stream's chunks share one)."""
    tokens = [text(e.token) for e in entries]
    tops = [{**{text(t): _value(v) for t, v in e.top}, text(e.token): _value(e.logprob)} for e in entries]
    return {"tokens": tokens, "token_logprobs": [_value(e.logprob) for e in entries], "top_logprobs": tops,
            "text_offset": [offsets.take(text.bytes(e.token)) for e in entries]}
