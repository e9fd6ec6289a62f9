"""Logprobs through the official ``openai`` client on live proxies (one per engine): chat, legacy completions and
the Responses API, each equal to a log_softmax of the model's own logits computed here, streamed as unstreamed,
cached as uncached."""
from __future__ import annotations

import copy

import openai
import pytest
import torch
from prefixcache_api import create_app
from proxy_support import ALPHA, MODEL, live, settings

from prefixcache import CacheConfig, PrefixCache
from tests.conftest import untouched

SYSTEM = "You grade short answers for a shipping company. " * 8
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is parcel 7 late?"}]
TOL = 1e-4


@pytest.fixture(scope="module")
def engines(chat_llama, tokenizer):
    """{"batched": server, "serial": server} over copies of one model, and that model untouched."""
    caches = {"batched": PrefixCache(copy.deepcopy(chat_llama), tokenizer, CacheConfig(max_bytes=256 << 20)),
              "serial": PrefixCache(copy.deepcopy(chat_llama), tokenizer, CacheConfig(max_bytes=256 << 20),
                                    batching=False)}
    reference = untouched(chat_llama)
    with live(create_app(settings(), cache=caches["batched"])) as a, \
            live(create_app(settings(), cache=caches["serial"])) as b:
        yield {"batched": a, "serial": b}, reference
    for cache in caches.values():
        cache.close()


def model_logprobs(reference, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """[len(answer), V]: log_softmax of the model's logits at each answer token's step, computed directly."""
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + answer])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) - 1 + len(answer)]


def check_chat(content, want: torch.Tensor, tokenizer, top: int) -> None:
    for step, entry in enumerate(content):
        assert entry.bytes == list(entry.token.encode("utf-8"))
        values, index = torch.topk(want[step], top)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=TOL)
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([i]) for i in index.tolist()]
        # greedy: the chosen token is the likeliest
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == pytest.approx(values[0].item(), abs=TOL)


def ask_chat(server, stream: bool = False, **kwargs):
    client = server.openai(ALPHA)
    body = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=4,
                extra_body={"ignore_eos": True}, **kwargs)
    if not stream:
        r = client.chat.completions.create(**body)
        return r.choices[0].message.content, r.choices[0].logprobs.content, r
    text, content, chunks = "", [], list(client.chat.completions.create(stream=True, **body))
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            if chunk.choices[0].logprobs is not None:
                content += chunk.choices[0].logprobs.content
    return text, content, chunks


def test_chat_logprobs_are_the_model_s_on_both_engines_streamed_or_not_cached_or_not(engines, tokenizer):
    servers, reference = engines
    seen = []
    for name, server in servers.items():
        server.cache.flush()
        cold = ask_chat(server)
        warm = ask_chat(server)
        assert cold[2].usage.prompt_tokens_details.cached_tokens == 0
        assert warm[2].usage.prompt_tokens_details.cached_tokens > 0
        streamed = ask_chat(server, stream=True)
        seen += [cold, warm, streamed]
    prompt = servers["batched"].cache.encode_chat(MESSAGES)
    text, content, _ = seen[0]
    ids = [int(t) for t in servers["batched"].cache.answer(prompt, max_new_tokens=6, ignore_eos=True).token_ids]
    assert "".join(c.token for c in content) == text == tokenizer.decode(ids, skip_special_tokens=True)
    want = model_logprobs(reference, prompt, ids)
    assert [c.logprob for c in content] == pytest.approx([want[i, t].item() for i, t in enumerate(ids)], abs=TOL)
    check_chat(content, want, tokenizer, 4)
    for other_text, other, _ in seen[1:]:
        assert other_text == text
        assert [c.token for c in other] == [c.token for c in content]
        assert [c.logprob for c in other] == pytest.approx([c.logprob for c in content], abs=TOL)
        assert [[t.token for t in c.top_logprobs] for c in other] == [[t.token for t in c.top_logprobs]
                                                                      for c in content]


def test_chat_stream_chunks_carry_their_own_tokens(engines):
    servers, _ = engines
    _, content, chunks = ask_chat(servers["batched"], stream=True)
    with_text = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert with_text and all(c.choices[0].logprobs is not None for c in with_text)
    for chunk in with_text:  # each delta's text is its tokens' (whole words for this vocabulary)
        assert "".join(t.token for t in chunk.choices[0].logprobs.content) == chunk.choices[0].delta.content
    assert chunks[0].choices[0].logprobs is None  # the role chunk


def test_chat_without_logprobs_reports_none_and_limits_are_400s(engines):
    server = engines[0]["batched"]
    client = server.openai(ALPHA)
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for kwargs, param in (({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                          ({"top_logprobs": 2}, "top_logprobs"),
                          ({"logprobs": True, "tools": [tool]}, "logprobs")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **kwargs)
        assert err.value.status_code == 400 and err.value.body["param"] == param, (kwargs, err.value.body)
    # Tools the model does not see: logprobs as without them.
    hidden = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0,
                                            logprobs=True, tools=[tool], tool_choice="none")
    assert len(hidden.choices[0].logprobs.content) == hidden.usage.completion_tokens


def test_legacy_completions_logprobs(engines, tokenizer):
    servers, reference = engines
    prompt = "Parcel 7 left the depot on"
    got = {}
    for name, server in servers.items():
        client = server.openai(ALPHA)
        body = dict(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=3,
                    extra_body={"ignore_eos": True})
        whole = client.completions.create(**body).choices[0]
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **body) if c.choices]
        lp = whole.logprobs
        assert "".join(lp.tokens) == whole.text and lp.text_offset[0] == 0
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        assert all(len(top) <= 4 and top[tok] == v for top, tok, v in zip(lp.top_logprobs, lp.tokens,
                                                                          lp.token_logprobs, strict=True))
        streamed = [c.logprobs for c in chunks if c.logprobs is not None and c.logprobs.tokens]
        assert sum((s.tokens for s in streamed), []) == lp.tokens
        assert sum((s.token_logprobs for s in streamed), []) == pytest.approx(lp.token_logprobs, abs=TOL)
        assert sum((s.text_offset for s in streamed), []) == lp.text_offset
        got[name] = lp
    ids = list(servers["batched"].cache.answer(servers["batched"].cache.encode_text(prompt), max_new_tokens=5,
                                                ignore_eos=True).token_ids)
    want = model_logprobs(reference, servers["batched"].cache.encode_text(prompt), ids)
    assert got["batched"].token_logprobs == pytest.approx([want[i, t].item() for i, t in enumerate(ids)], abs=TOL)
    assert got["serial"].token_logprobs == pytest.approx(got["batched"].token_logprobs, abs=TOL)
    client = servers["batched"].openai(ALPHA)
    for kwargs in ({"logprobs": 6}, {"logprobs": 2, "echo": True}):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **kwargs)
        assert err.value.status_code == 400 and err.value.body["param"] == "logprobs", kwargs


def test_responses_output_text_logprobs(engines):
    servers, _ = engines
    server = servers["batched"]
    client = server.openai(ALPHA)
    body = dict(model=MODEL, instructions=SYSTEM, input="Is parcel 7 late?", max_output_tokens=6, temperature=0,
                include=["message.output_text.logprobs"], top_logprobs=2)
    whole = client.responses.create(**body)
    part = whole.output[0].content[0]
    assert len(part.logprobs) == whole.usage.output_tokens and whole.top_logprobs == 2
    assert "".join(lp.token for lp in part.logprobs) == part.text
    assert all(len(lp.top_logprobs) == 2 and lp.bytes == list(lp.token.encode()) for lp in part.logprobs)
    events = list(client.responses.create(stream=True, **body))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    streamed = [lp for e in deltas for lp in e.logprobs]

    def same(got, want):
        """Two calls' logprobs: the same tokens and alternatives, values within TOL (the second call reads the
        cached prompt, whose logits may round otherwise on some CPUs)."""
        assert [lp.token for lp in got] == [lp.token for lp in want]
        assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in want], abs=TOL)
        assert [[t.token for t in lp.top_logprobs] for lp in got] == [[t.token for t in lp.top_logprobs] for lp in want]
        assert [t.logprob for lp in got for t in lp.top_logprobs] == pytest.approx(
            [t.logprob for lp in want for t in lp.top_logprobs], abs=TOL)
    same(streamed, part.logprobs)
    done = next(e for e in events if e.type == "response.output_text.done")
    final = next(e for e in events if e.type in ("response.completed", "response.incomplete")).response
    # Within the streamed call: its deltas, its done event and its final response say the same, exactly.
    assert [lp.logprob for lp in done.logprobs] == [lp.logprob for lp in streamed]
    assert [(lp.token, lp.logprob, [(t.token, t.logprob) for t in lp.top_logprobs])
            for lp in final.output[0].content[0].logprobs] == \
        [(lp.token, lp.logprob, [(t.token, t.logprob) for t in lp.top_logprobs]) for lp in streamed]
    same(final.output[0].content[0].logprobs, part.logprobs)
    assert client.responses.retrieve(whole.id, include=["message.output_text.logprobs"]).output[0].content[0] \
        .logprobs == part.logprobs
    # The stored conversation continues, and its output sent back as input is read as text.
    after = client.responses.create(model=MODEL, previous_response_id=whole.id, input="And 8?", max_output_tokens=2)
    assert after.status in ("completed", "incomplete")
    resent = client.responses.create(model=MODEL, input=[*[o.model_dump() for o in whole.output],
                                                         {"role": "user", "content": "And 8?"}], max_output_tokens=2)
    assert resent.status in ("completed", "incomplete")
    plain = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert plain.output[0].content[0].logprobs == []
    for kwargs, param in (({"top_logprobs": 2}, "top_logprobs"), ({"top_logprobs": 21}, "top_logprobs")):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, **kwargs)
        assert err.value.body["param"] == param, (kwargs, err.value.body)


def test_each_of_n_choices_carries_its_own_logprobs_streamed_as_not(engines):
    """n=2 greedy: each choice's logprobs are the one-choice answer's, under its own index, streamed (each chunk its
    choice's tokens, completions' offsets from its choice's start) as not; chat and completions, both engines."""
    servers, _ = engines
    seen = {}
    for name, server in servers.items():
        client = server.openai(ALPHA)
        _, one, _ = ask_chat(server)
        both = ask_chat(server, n=2)[2]
        assert [c.index for c in both.choices] == [0, 1]
        streamed: list[list] = [[], []]
        for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                                    logprobs=True, top_logprobs=4, n=2, stream=True,
                                                    extra_body={"ignore_eos": True}):
            for c in chunk.choices:
                if c.logprobs is not None:
                    assert "".join(t.token for t in c.logprobs.content) == (c.delta.content or "")
                    streamed[c.index] += c.logprobs.content
        for got in [c.logprobs.content for c in both.choices] + streamed:
            assert [t.token for t in got] == [t.token for t in one]
            assert [t.logprob for t in got] == pytest.approx([t.logprob for t in one], abs=TOL)
            assert [[t.token for t in c.top_logprobs] for c in got] == [[t.token for t in c.top_logprobs] for c in one]
        assert [c.message.content for c in both.choices] == ["".join(t.token for t in one)] * 2

        body = dict(model=MODEL, prompt="Parcel 7 left the depot on", max_tokens=5, temperature=0, logprobs=3,
                    extra_body={"ignore_eos": True})
        single = client.completions.create(**body).choices[0].logprobs
        whole = client.completions.create(n=2, **body)
        parts: list[list] = [[], []]
        for chunk in client.completions.create(n=2, stream=True, **body):
            for c in chunk.choices:
                if c.logprobs is not None:
                    parts[c.index].append(c.logprobs)
        for lp, pieces in zip([c.logprobs for c in whole.choices], parts, strict=True):
            assert lp.tokens == single.tokens and lp.text_offset == single.text_offset
            assert lp.token_logprobs == pytest.approx(single.token_logprobs, abs=TOL)
            assert sum((p.tokens for p in pieces), []) == lp.tokens
            assert sum((p.text_offset for p in pieces), []) == lp.text_offset
            assert sum((p.token_logprobs for p in pieces), []) == pytest.approx(lp.token_logprobs, abs=TOL)
        seen[name] = one
    assert [t.logprob for t in seen["serial"]] == pytest.approx([t.logprob for t in seen["batched"]], abs=TOL)


def test_a_stop_string_s_tokens_are_left_out_of_the_logprobs_streamed_as_not(engines):
    """With a stop string the logprobs are those of the tokens whose text the answer returns: their texts join to
    the content (a stop string at a token boundary) or to it and the rest of the token the stop string begins inside;
    streamed as not, every chunk's tokens its own text's; completions' text_offset within the text; both engines."""
    servers, _ = engines
    for name, server in servers.items():
        client = server.openai(ALPHA)
        _, free, _ = ask_chat(server)
        texts = [t.token for t in free]
        assert len(texts[2]) > 1, texts
        at_boundary, inside = texts[3] + texts[4], texts[2][1:] + texts[3] + texts[4]
        for stop, content in ((at_boundary, "".join(texts[:3])), (inside, "".join(texts[:2]) + texts[2][:1])):
            whole_text, whole, r = ask_chat(server, stop=[stop])
            assert r.choices[0].finish_reason == "stop" and whole_text == content, name
            assert [t.token for t in whole] == texts[:3], (name, stop)
            streamed_text, streamed, chunks = ask_chat(server, stream=True, stop=[stop])
            assert streamed_text == content and [t.token for t in streamed] == texts[:3], (name, stop)
            assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in whole], abs=TOL)
            joined = "".join(t.token for t in whole)
            assert joined.startswith(content) and len(joined) - len(whole[-1].token) < len(content)
            assert (joined == content) == (stop == at_boundary)
            assert all(c.delta.content for chunk in chunks for c in chunk.choices  # no chunk of tokens without text
                       if c.logprobs is not None and c.logprobs.content), name

        prompt = "Parcel 7 left the depot on"
        body = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2,
                    extra_body={"ignore_eos": True})
        tokens = client.completions.create(**body).choices[0].logprobs.tokens
        assert len(tokens[2]) > 1, tokens
        for stop in (tokens[3] + tokens[4], tokens[2][1:] + tokens[3] + tokens[4]):
            whole = client.completions.create(stop=[stop], **body).choices[0]
            lp = whole.logprobs
            assert whole.finish_reason == "stop" and lp.tokens == tokens[:3], (name, stop)
            assert "".join(lp.tokens).startswith(whole.text) and all(o < len(whole.text) for o in lp.text_offset)
            pieces = [c.choices[0].logprobs for c in client.completions.create(stream=True, stop=[stop], **body)
                      if c.choices and c.choices[0].logprobs is not None]
            assert sum((p.tokens for p in pieces), []) == lp.tokens
            assert sum((p.text_offset for p in pieces), []) == lp.text_offset


def test_token_bytes_and_text_offsets_of_tokens_holding_parts_of_characters(tokenizer):
    """A byte-level token holding part of a character: ``bytes`` its part (the tokens' bytes join to the text, as
    OpenAI's), its ``token`` U+FFFD; completions' ``text_offset`` counts each character once, within the text."""
    from prefixcache_api.logprobs import TextOffsets, TokenText, chat_content, completion_logprobs

    from prefixcache.serving.logprobs import TokenLogprob

    ids = tokenizer.encode("x \U0001fae0\U0001d518\ua66e y")
    text = tokenizer.decode(ids)
    entries = [TokenLogprob(t, -0.5) for t in ids]
    names = TokenText(tokenizer)
    content = chat_content(entries, names)
    assert any(e["token"] == "\ufffd" for e in content)  # the emoji is split over tokens
    assert b"".join(bytes(e["bytes"]) for e in content).decode("utf-8") == text
    offsets = completion_logprobs(entries, names, TextOffsets())["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] < len(text)
    assert text[offsets[-1]:] == " y" and text[offsets[1]:offsets[1] + 2] == " \U0001fae0"
    streamed = TextOffsets()
    halves = [completion_logprobs(part, names, streamed)["text_offset"] for part in (entries[:3], entries[3:])]
    assert halves[0] + halves[1] == offsets
