"""Generated tokens to text deltas, holding back what could still become a stop string."""
from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Callable, Sequence

import torch
from transformers.generation.streamers import BaseStreamer

from prefixcache.serving.logprobs import TokenLogprob


class TextStream(BaseStreamer):
    """Decodes new tokens incrementally and hands text deltas to ``on_text``.

    A ``generate()`` streamer: the first ``put`` is the prompt (skipped), then the new
    tokens. Each token costs work in proportion to the text it adds, not to the answer so
    far: only the last few tokens are decoded again (a token can change how the ones before it
    read, e.g. the bytes of one character), and stop strings are searched in the new text and
    a stop string's length before it. Text that could still turn into a stop string is held
    back, so a client never sees a stop sequence (OpenAI semantics); ``stopped`` once one
    appeared. ``text`` is what has been decoded so far.

    ``logprobs``: each new token's ``TokenLogprob``, which the producer appends before it ``put``s the
    token (where the call asks for them). ``on_logprobs`` receives those of the tokens whose text
    ``on_text`` receives next (all of it or its start, the rest held back), but special tokens (whose
    text the answer skips), just before ``on_text`` receives that text; at ``end`` those of the tokens
    left (with or without text), but once stopped only up to the one in which the answer's text ends
    (``covering``): in all, ``answer_logprobs``.
    """

    def __init__(self, tokenizer, on_text: Callable[[str], None] | None, stop: Sequence[str],
                 on_logprobs: Callable[[list[TokenLogprob]], None] | None = None):
        self._tok, self._on_text, self._stop = tokenizer, on_text or (lambda _t: None), tuple(s for s in stop if s)
        self._on_logprobs = on_logprobs
        self._special = frozenset(getattr(tokenizer, "all_special_ids", ()))
        self.logprobs: list[TokenLogprob] = []
        self._reported = 0  # logprobs[:_reported] went to ``on_logprobs``
        self._longest = max((len(s) for s in self._stop), default=0)
        self._ids: list[int] = []
        self._prefix = self._read = 0  # ids[_prefix:_read] decode to the end of ``text``; later ids are pending
        # ids[:_reads[i]] decode to text[:_lengths[i]], ids[_starts[i]:_reads[i]] the window that decoded its end
        self._reads, self._lengths, self._starts = [0], [0], [0]
        self.text = ""
        self._scanned = 0  # stop strings were searched in text[:_scanned]
        self._sent = 0
        self._prompt_seen = False
        self.stopped = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self._ids.extend(value.reshape(-1).tolist())
        self._decode(final=False)
        self._emit(final=False)

    def end(self) -> None:
        self._decode(final=True)
        self._emit(final=True)
        self._report(self.covering(self._sent) if self.stopped else len(self.logprobs))

    def covering(self, length: int) -> int:
        """How many of the first ids it takes to decode ``text[:length]``: up to and including the one in which
        that text ends (a stop string may begin inside it); all the ids decoded where ``text`` is shorter."""
        at = bisect.bisect_left(self._lengths, length)
        if at == 0 or at == len(self._reads):
            return 0 if at == 0 else self._read
        low, high, start = self._reads[at - 1], self._reads[at], self._starts[at]
        if high - low > 1:  # ids decoded together (a character split across them): the first the text reaches
            before = self._tok.decode(self._ids[start:low], skip_special_tokens=True)
            for upto in range(low + 1, high):
                after = self._tok.decode(self._ids[start:upto], skip_special_tokens=True).rstrip("\ufffd")
                if self._lengths[at - 1] + len(after) - len(os.path.commonprefix([before, after])) >= length:
                    return upto
        return high

    def answer_logprobs(self, tokens: int) -> tuple[TokenLogprob, ...]:
        """The logprobs of the answer's first ``tokens`` tokens, but special tokens'."""
        return tuple(e for e in self.logprobs[:tokens] if e.token not in self._special)

    def _report(self, upto: int) -> None:
        """Hand ``on_logprobs`` the logprobs after the last reported up to ``upto`` (none: nothing)."""
        if self._on_logprobs is None or upto <= self._reported:
            return
        fresh = [e for e in self.logprobs[self._reported : upto] if e.token not in self._special]
        self._reported = upto
        if fresh:
            self._on_logprobs(fresh)

    def _decode(self, final: bool) -> None:
        """Append the text the pending ids complete (all of it when ``final``)."""
        if self.stopped or self._read == len(self._ids):
            return
        before = self._tok.decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
        after = self._tok.decode(self._ids[self._prefix :], skip_special_tokens=True)
        if not final and (len(after) <= len(before) or not after.startswith(before) or after.endswith("\ufffd")):
            return  # the new ids do not extend the text yet (e.g. half a character): wait for more
        self.text += after[len(os.path.commonprefix([before, after])) :]
        self._starts.append(self._prefix)
        self._prefix, self._read = self._read, len(self._ids)
        self._reads.append(self._read)
        self._lengths.append(len(self.text))

    def _emit(self, final: bool) -> None:
        if self.stopped:
            return
        text = self.text
        start = max(0, self._scanned - self._longest + 1)
        cut = first_stop(text[start:], self._stop)
        self._scanned = len(text)
        if cut is not None:
            text, self.stopped = text[: start + cut], True
        elif not final:
            safe = len(text)  # hold back any possible start of a stop string
            for s in self._stop:
                for k in range(min(len(s) - 1, safe), 0, -1):
                    if text.endswith(s[:k], 0, safe):
                        safe -= k
                        break
            text = text[:safe]
        if len(text) > self._sent:
            self._report(min(self.covering(len(text)), len(self.logprobs)))
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
