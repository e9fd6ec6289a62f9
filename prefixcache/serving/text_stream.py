"""Generated tokens to text deltas, holding back what could still become a stop string."""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch
from transformers.generation.streamers import BaseStreamer


class TextStream(BaseStreamer):
    """Decodes new tokens incrementally and hands text deltas to ``on_text``.

    A ``generate()`` streamer: the first ``put`` is the prompt (skipped), then the new
    tokens. Text that could still turn into a stop string is held back, so a client never
    sees a stop sequence (OpenAI semantics); ``stopped`` once one appeared.
    """

    def __init__(self, tokenizer, on_text: Callable[[str], None] | None, stop: Sequence[str]):
        self._tok, self._on_text, self._stop = tokenizer, on_text or (lambda _t: None), tuple(stop)
        self._ids: list[int] = []
        self._sent = 0
        self._prompt_seen = False
        self.stopped = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self._ids.extend(value.reshape(-1).tolist())
        self._emit(final=False)

    def end(self) -> None:
        self._emit(final=True)

    def _emit(self, final: bool) -> None:
        if self.stopped:
            return
        text = self._tok.decode(self._ids, skip_special_tokens=True)
        cut = first_stop(text, self._stop)
        if cut is not None:
            text, self.stopped = text[:cut], True
        elif not final:
            # Hold back an unfinished multi-byte character and any possible stop-string start.
            safe = len(text) - 1 if text.endswith("\ufffd") else len(text)
            for s in self._stop:
                for k in range(min(len(s) - 1, safe), 0, -1):
                    if text[:safe].endswith(s[:k]):
                        safe -= k
                        break
            text = text[:safe]
        if len(text) > self._sent:
            self._on_text(text[self._sent :])
            self._sent = len(text)


class Halt:
    """A cancel event for the batching engine: set when the caller cancels or ``stream`` saw a stop string."""

    def __init__(self, cancel: threading.Event | None, stream: TextStream):
        self._cancel, self._stream = cancel, stream

    def is_set(self) -> bool:
        return self._stream.stopped or (self._cancel is not None and self._cancel.is_set())


def first_stop(text: str, stop: Sequence[str]) -> int | None:
    """Index of the earliest stop string in ``text``, or None."""
    hits = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return min(hits) if hits else None
