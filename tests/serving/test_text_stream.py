"""The text stream: deltas add up to the decoded answer, stop strings are cut and never shown,
and each token costs work in proportion to what it adds."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.serving.logprobs import TokenLogprob
from prefixcache.serving.text_stream import TextStream


class Counting:
    """The real tokenizer, counting the ids each decode call reads."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, []

    def decode(self, ids, **kwargs):
        self.decoded.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def run(tokenizer, ids, stop=()):
    deltas: list[str] = []
    stream = TextStream(tokenizer, deltas.append, stop)
    stream.put(torch.tensor([1, 2, 3]))  # the prompt: skipped
    for t in ids:
        stream.put(torch.tensor([t]))
    stream.end()
    return deltas, stream


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 60))
def test_deltas_add_up_to_the_full_decode(tokenizer, seed, n):
    rng = random.Random(seed)
    # Byte-level pieces: many ids are parts of one multi-byte character.
    ids = [rng.randrange(len(tokenizer)) for _ in range(n)]
    deltas, stream = run(tokenizer, ids)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == stream.text == full


def test_multibyte_characters_are_not_split(tokenizer):
    ids = tokenizer.encode("héllo wörld 東京 🙂 done", add_special_tokens=False)
    deltas, _ = run(tokenizer, ids)
    assert "".join(deltas) == "héllo wörld 東京 🙂 done"
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_is_cut_and_never_shown(tokenizer):
    text = "The answer is forty-two. END of the story, and more after it."
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, stream = run(tokenizer, ids, stop=["END", "never there"])
    assert stream.stopped and "".join(deltas) == "The answer is forty-two. "
    assert all("E" not in d for d in deltas)  # the stop string's start was held back, never sent


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 40), at=st.floats(0, 1), size=st.integers(1, 12))
def test_a_stopped_stream_reports_the_logprobs_of_the_tokens_its_text_needs(tokenizer, seed, n, at, size):
    """Stopped anywhere (at a token boundary, inside a token, inside a character), the logprobs reported, streamed
    each just before the text it begins, are the first tokens up to the one in which the text returned ends."""
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(n)]
    full = tokenizer.decode(ids, skip_special_tokens=True)
    start = int(at * len(full))
    stop = full[start : start + size].strip("\ufffd")
    events: list[tuple[str, object]] = []
    stream = TextStream(tokenizer, lambda t: events.append(("text", t)), [stop],
                        lambda e: events.append(("logprobs", e)))
    stream.put(torch.tensor([1, 2, 3]))  # the prompt: skipped
    for t in ids:
        stream.logprobs.append(TokenLogprob(t, -1.0))
        stream.put(torch.tensor([t]))
    stream.end()
    text = "".join(t for kind, t in events if kind == "text")
    reported = [e.token for kind, batch in events if kind == "logprobs" for e in batch]
    special = set(tokenizer.all_special_ids)
    if not stop or stop not in full:
        assert reported == [t for t in ids if t not in special]
        return
    assert stream.stopped and text == full[: full.find(stop)]
    k = stream.covering(len(text))
    assert reported == [t for t in ids[:k] if t not in special]
    assert tokenizer.decode(ids[:k], skip_special_tokens=True).startswith(text)
    assert k == 0 or len(tokenizer.decode(ids[: k - 1], skip_special_tokens=True).rstrip("\ufffd")) < len(text)
    for i, (kind, _) in enumerate(events):  # each token's logprobs come before the text it begins
        assert kind == "text" or i + 1 < len(events) and events[i + 1][0] == "text"


def test_a_stop_string_at_a_character_split_across_tokens_leaves_out_the_tokens_after_the_text(tokenizer):
    """" ‡" reads as one token of " " and the character's first byte, then one of its last: stopped at "‡", the
    text " " ends in the first, and only its logprobs are reported; stopped after "‡", both."""
    ids = tokenizer.encode("x ‡ done", add_special_tokens=False)
    assert tokenizer.decode(ids[1:2]).endswith("\ufffd") and "".join(tokenizer.decode([t]) for t in ids[:3]) != "x ‡"
    for stop, text, reported in (("‡", "x ", 2), (" done", "x ‡", 3)):
        got: list[TokenLogprob] = []
        stream = TextStream(tokenizer, None, [stop], got.extend)
        stream.put(torch.tensor([1, 2, 3]))  # the prompt: skipped
        for t in ids:
            stream.logprobs.append(TokenLogprob(t, -1.0))
            stream.put(torch.tensor([t]))
        stream.end()
        assert stream.text[: len(text)] == text and stream.covering(len(text)) == reported
        assert [e.token for e in got] == ids[:reported]


def test_each_token_decodes_a_bounded_window(tokenizer):
    ids = tokenizer.encode("word " * 600, add_special_tokens=False)
    counting = Counting(tokenizer)
    deltas, _ = run(counting, ids, stop=["zzz"])
    assert "".join(deltas) == tokenizer.decode(ids)
    assert max(counting.decoded) <= 8  # not the whole answer again at every token
    assert sum(counting.decoded) <= 4 * len(ids)


@pytest.mark.parametrize("stop", [["x" * 256] * 4])
def test_long_stop_strings_cost_little_per_token(tokenizer, stop):
    ids = tokenizer.encode("x" * 200 + " y" * 300, add_special_tokens=False)
    deltas, stream = run(tokenizer, ids, stop=stop)
    assert not stream.stopped and "".join(deltas) == tokenizer.decode(ids)
