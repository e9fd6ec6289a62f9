"""Canonicalize: a chat request or a text prompt becomes one deterministic token-id sequence.

Chat is rendered with the tokenizer's template and tokenized *span by span*: the text
each message adds (render of ``messages[:i+1]`` minus render of ``messages[:i]``) is
tokenized alone, so no BPE merge crosses a message boundary and requests sharing their
first k messages share those tokens. An assistant header is a span of its own, so last
turn's prompt (with its generation prompt) is a token prefix of this turn's. Where the
template is not prefix-monotone, the rest is one span and ``drift`` is set.

Canonical inputs: tool definitions and tool-call arguments (dicts or JSON strings) get
recursively sorted keys; dict content becomes compact sorted JSON; text parts are joined
with "\\n" (as vLLM does); ``content=None`` becomes ""; keys other than role, content,
name, tool_calls, tool_call_id are dropped. Opt-in whitespace/Unicode normalisation
touches message content only, never the template's own text.
"""
from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from prefixcache.config import UNICODE_FORMS, CacheConfig
from prefixcache.errors import ConfigError, InvalidRequestError

ROLES = ("system", "developer", "user", "assistant", "tool")
# Part of the fingerprint: bump it whenever the canonical form changes, so ids made by an
# older algorithm never share KV with ids made by a newer one.
CANON_VERSION = "canon-1"
# Encoded with and without special tokens: shows what the tokenizer adds (BOS) and
# fingerprints its behaviour beyond the vocab size.
_PROBE = "Hello, world! 123 \u00fcn\u00efc\u00f6d\u00e9\n\tx  y"
_HSPACE = re.compile(r"[ \t]+")
#: Extension field of a text content part: ``true`` marks the part a reusable chunk (its KV is reused
#: wherever it appears in a prompt, ``serving/blend.py``). Other servers ignore or refuse unknown fields.
CHUNK_FIELD = "prefixcache_chunk"
# Partial renders may add up to this many times the full render's length (plus the
# allowance, so short conversations are always located exactly); see ``_Cutter``.
_RENDER_BUDGET, _RENDER_ALLOWANCE = 4, 64 << 10


@dataclass(frozen=True, slots=True)
class CanonicalPrompt:
    """The canonical ids of one request.

    ``boundaries[i]``: token offset where message i's span ends (where drift merged it
    into a later span, that span's end); ``encode_text`` gives ``(len(token_ids),)``.
    ``drift``: the template was not prefix-monotone somewhere, so a shorter request may
    not be a token prefix of this one.
    """

    token_ids: tuple[int, ...]
    boundaries: tuple[int, ...]
    drift: bool
    #: Token spans ``[start, end)`` of the parts marked ``CHUNK_FIELD``, in order; each is its text tokenized alone.
    chunks: tuple[tuple[int, int], ...] = ()
    #: Marked parts whose text the chat template did not render verbatim (not reusable as chunks).
    unplaced: int = 0


def template_fingerprint(tokenizer: Any, *, normalize_whitespace: bool = False,
                         unicode_normalization: str | None = None) -> str:
    """Stable 16-hex-digit xxh64 of everything that decides the canonical ids.

    Covers the chat template, tokenizer class, vocab sizes, special and added tokens, a
    probe encoding (catches a changed BOS rule), the normalisation options and
    ``CANON_VERSION``. Goes into the cache namespace, so a change never shares KV.
    """
    cls = type(tokenizer)
    facts = {
        "version": CANON_VERSION, "class": f"{cls.__module__}.{cls.__qualname__}",
        "template": getattr(tokenizer, "chat_template", None),
        "vocab_size": tokenizer.vocab_size, "len": len(tokenizer),
        "special": tokenizer.special_tokens_map, "added": tokenizer.get_added_vocab(),
        "probe": [tokenizer(_PROBE)["input_ids"], tokenizer(_PROBE, add_special_tokens=False)["input_ids"]],
        "normalize_whitespace": normalize_whitespace, "unicode_normalization": unicode_normalization,
    }
    blob = json.dumps(facts, sort_keys=True, ensure_ascii=False, default=str)
    return xxhash.xxh64_hexdigest(blob.encode("utf-8"), seed=0)


class Canonicalizer:
    """Turns chat messages or a text prompt into a ``CanonicalPrompt`` for one tokenizer.

    Holds no per-request state, so one instance can serve concurrent requests. Both the
    cached and the uncached path must feed the model these ids. The fingerprint is taken
    at construction: build a new instance after changing the tokenizer or its template.
    """

    def __init__(self, tokenizer: Any, *, normalize_whitespace: bool = False,
                 unicode_normalization: str | None = None):
        if unicode_normalization is not None and unicode_normalization not in UNICODE_FORMS:
            raise ConfigError("unicode_normalization", unicode_normalization, f"None or one of {UNICODE_FORMS}")
        self._tok = tokenizer
        self._ws = bool(normalize_whitespace)
        self._form = unicode_normalization
        self._fingerprint = template_fingerprint(tokenizer, normalize_whitespace=self._ws,
                                                 unicode_normalization=self._form)
        self._auto_prefix = _auto_prefix_ids(tokenizer)
        template = str(getattr(tokenizer, "chat_template", None) or "")
        # OpenAI's "developer" role is its system instructions: a template that names no such role would drop
        # the message or frame it as a stranger's turn, so it reaches such a template as "system".
        self._developer_role = "developer" in template
        self._renders_tool_calls = "tool_calls" in template

    @classmethod
    def from_config(cls, tokenizer: Any, config: CacheConfig) -> Canonicalizer:
        """A canonicalizer with ``config``'s normalisation options."""
        return cls(tokenizer, normalize_whitespace=config.normalize_whitespace,
                   unicode_normalization=config.unicode_normalization)

    @property
    def fingerprint(self) -> str:
        """``template_fingerprint`` of this tokenizer and these options."""
        return self._fingerprint

    def encode_text(self, prompt: str) -> CanonicalPrompt:
        """A plain completion prompt, with the tokenizer's default special tokens and no normalisation."""
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"prompt must be a string, got {type(prompt).__name__}", param="prompt")
        ids = tuple(self._tok(check_text(prompt, "prompt"))["input_ids"])
        if not ids:
            raise InvalidRequestError("prompt is empty: it encodes to no tokens", param="prompt")
        return CanonicalPrompt(ids, (len(ids),), False)

    def encode_chat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False) -> CanonicalPrompt:
        """Canonical, prefix-stable ids of an OpenAI-shaped chat request.

        With ``continue_final_message`` the last message, an assistant turn of text, is left open
        (no end of turn, no generation prompt): the answer continues it (Anthropic's prefill).
        Raises ``InvalidRequestError`` (with ``param``) for malformed messages or tools,
        tools on a template that ignores them, a tokenizer without a chat template, or a
        template that refuses the conversation.
        """
        if not getattr(self._tok, "chat_template", None):
            raise InvalidRequestError("this model's tokenizer has no chat template, so chat messages cannot "
                                      "be formatted; send a plain prompt to /v1/completions", param="messages")
        msgs = _canonical_messages(messages, self._clean)
        tools = _canonical_tools(tools)
        # Refuse rather than silently drop tools the model would never see.
        if tools and not re.search(r"\btools\b", self._tok.get_chat_template(None, tools)):
            raise InvalidRequestError("this model's chat template does not support tools", param="tools")
        for i, msg in enumerate(msgs):
            if msg["role"] == "developer" and not self._developer_role:
                msg["role"] = "system"
            if "tool_calls" in msg and not self._renders_tool_calls:  # refused, as tools are: never silently dropped
                raise InvalidRequestError("this model's chat template does not render tool calls",
                                          param=f"messages[{i}].tool_calls")
        if continue_final_message:
            _check_continued(msgs)
            add_generation_prompt = False
        full, cuts, ends, drift = self._plan(msgs, tools, add_generation_prompt, continue_final_message)
        marked, unplaced = _place_chunks(full, ends, _marked_texts(messages, self._clean))
        cuts = sorted({*cuts, *(at for span in marked for at in span)})
        spans = [full[a:b] for a, b in zip(cuts, cuts[1:])]
        encoded = self._tokenize_spans(spans)
        ids = [tid for span in encoded for tid in span]
        # Templates usually write BOS themselves; if this one does not but the tokenizer
        # adds one by default, the model expects it: keep it rather than silently drop it.
        prefix = self._auto_prefix if ids[:len(self._auto_prefix)] != self._auto_prefix else []
        token_at, pos = {0: len(prefix)}, len(prefix)  # character cut -> token offset
        for cut, span in zip(cuts[1:], encoded):
            pos += len(span)
            token_at[cut] = pos
        chunks = tuple((token_at[a], token_at[b]) for a, b in marked if token_at[b] > token_at[a])
        return CanonicalPrompt(tuple(prefix + ids), tuple(token_at[e] for e in ends), drift, chunks, unplaced)

    def _tokenize_spans(self, spans: list[str]) -> list[list[int]]:
        """Each span's ids, tokenizing each distinct span once (headers and short turns repeat)."""
        distinct = list(dict.fromkeys(spans))
        ids = self._tok(distinct, add_special_tokens=False)["input_ids"] if distinct else []
        table = dict(zip(distinct, ids))
        return [table[span] for span in spans]

    def _plan(self, msgs: list[dict], tools: list[dict] | None, add_generation_prompt: bool,
              continued: bool = False) -> tuple[str, list[int], list[int], bool]:
        """Render the request once and choose its cuts: character offsets where spans split.

        Returns (full text, cuts from 0 to len(full), each message's end cut, drift). The
        work is linear in the conversation: see ``_Cutter``.
        """
        full = self._render(msgs, tools, add_generation_prompt, strict=True, continued=continued)
        cutter = _Cutter(full, lambda part, gen: self._render(part, tools, gen))
        ends: list[int | None] = []
        for i, msg in enumerate(msgs):
            prev = ends[-1] if ends else 0
            if msg["role"] == "assistant" and i > 0:  # the header alone: last turn's generation prompt
                cutter.header(msgs, i, prev)
            last = i + 1 == len(msgs) and not add_generation_prompt
            ends.append(cutter.end(msgs, i, prev, last))
        cutter.verify(msgs, ends)
        cuts = cutter.cuts
        if cuts[-1] != len(full):
            cuts.append(len(full))
        after = len(full)  # a message whose end is no cut ends where the next located end does
        for i in range(len(ends) - 1, -1, -1):
            after = ends[i] = after if ends[i] is None else ends[i]
        return full, cuts, ends, cutter.drift

    def _render(self, msgs: list[dict], tools: list[dict] | None, gen: bool, strict: bool = False,
                continued: bool = False) -> str | None:
        try:
            if continued:  # the last message left open (only a full render asks)
                return self._tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=False,
                                                     continue_final_message=True, tokenize=False)
            return self._tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=gen, tokenize=False)
        except Exception as exc:  # templates are user code: any failure is the template's verdict
            if not strict:
                return None  # a partial conversation the template refuses: that cut is unavailable
            raise InvalidRequestError(f"the chat template cannot format these messages: {exc}",
                                      param="messages") from exc

    def _clean(self, text: str) -> str:
        """Opt-in normalisation of message content (identity when both options are off)."""
        if self._form is not None:
            text = unicodedata.normalize(self._form, text)
        if self._ws:
            text = _HSPACE.sub(" ", text.replace("\r\n", "\n").replace("\r", "\n"))
            text = "\n".join(line.rstrip(" ") for line in text.split("\n")).strip()
        return text


class _Cutter:
    """Finds where each message's text ends in the full render, in time linear in the conversation.

    A cut is where the render of ``messages[:i+1]`` ends (or, before an assistant message,
    where ``messages[:i]`` with the generation prompt ends), so the text before it depends
    on those messages only. Rendering every partial conversation would be quadratic.
    Instead each message is first matched in place: the frame its role had the last time
    it was located by a partial render (the text before and after the content), around
    this message's content, must be the next text of the full render. Only where no
    frame matches is a partial render made: it places the cut and teaches the role's
    frame (the first message of a role, or one the template frames differently). Partial
    renders are bounded in total to ``_RENDER_BUDGET`` times the full render (plus a fixed
    allowance); a partial render that is not a prefix of the full one, that the template
    refuses, or that is over budget is drift, and that message merges into the next span.
    """

    def __init__(self, full: str, render: Callable[[list[dict], bool], str | None]):
        self.full, self._render = full, render
        self.cuts, self.drift = [0], False
        self._budget = _RENDER_BUDGET * len(full) + _RENDER_ALLOWANCE
        self._frames: dict[str, tuple[str, str]] = {}  # role -> (text before, text after) its content
        self._header: str | None = None  # the generation prompt, after a message's end
        self._matched = False

    def header(self, msgs: list[dict], i: int, prev: int | None) -> None:
        """Cut after the generation prompt that precedes assistant message ``i``."""
        if prev is not None and self._header is not None and self.full.startswith(self._header, prev):
            self._matched = True
            self._cut(prev + len(self._header))
            return
        text = self._partial(msgs, i, True)
        if text is not None and prev is not None:
            self._header = text[prev:]
        self._cut(None if text is None else len(text))

    def end(self, msgs: list[dict], i: int, prev: int | None, last: bool) -> int | None:
        """The cut where message ``i`` ends, or None (drift: it merges into the next span)."""
        if last:  # the full render is that of msgs[:i+1]
            return self._cut(len(self.full))
        msg = msgs[i]
        frame = self._frames.get(msg["role"])
        if prev is not None and frame is not None:
            piece = frame[0] + msg["content"] + frame[1]
            if self.full.startswith(piece, prev):
                self._matched = True
                return self._cut(prev + len(piece))
        text = self._partial(msgs, i + 1, False)
        if text is not None and prev is not None:
            own, content = text[prev:], msg["content"]
            if content and own.count(content) == 1:  # where the content sits is unambiguous
                at = own.index(content)
                self._frames[msg["role"]] = (own[:at], own[at + len(content):])
        return self._cut(None if text is None else len(text))

    def verify(self, msgs: list[dict], ends: list[int | None]) -> None:
        """Where frames placed cuts, check the one that matters most (the previous turn) by rendering it."""
        if not self._matched or len(msgs) < 2 or ends[-2] is None:
            return
        text = self._render(msgs[:-1], False)
        if text is None or len(text) != ends[-2] or not self.full.startswith(text):
            self.drift = True

    def _partial(self, msgs: list[dict], count: int, gen: bool) -> str | None:
        """The render of ``msgs[:count]`` if it is a prefix of the full one and not before the last cut, else None."""
        if self._budget < 0:  # checked before slicing: a slice per message would be quadratic too
            return None
        text = self._render(msgs[:count], gen)
        self._budget -= len(text or "")
        if text is None or not self.full.startswith(text) or len(text) < self.cuts[-1]:
            return None
        return text

    def _cut(self, at: int | None) -> int | None:
        if at is None:
            self.drift = True
        elif at > self.cuts[-1]:
            self.cuts.append(at)
        return at


def _check_continued(msgs: list[dict]) -> None:
    """A conversation whose last message can be continued: an assistant turn of text without tool calls."""
    where, last = f"messages[{len(msgs) - 1}]", msgs[-1]
    if last["role"] != "assistant" or "tool_calls" in last:
        raise InvalidRequestError("only a final assistant message of text can be continued", param=where)
    if not last["content"]:
        raise InvalidRequestError("a final assistant message to continue must not be empty", param=f"{where}.content")
    if last["content"] != last["content"].rstrip():
        raise InvalidRequestError("a final assistant message to continue cannot end with whitespace",
                                  param=f"{where}.content")


def _marked_texts(messages: Sequence[dict], clean: Callable[[str], str]) -> list[tuple[int, str]]:
    """(message index, text as rendered) of every content part marked ``CHUNK_FIELD`` (validated already)."""
    return [(i, clean(part["text"])) for i, msg in enumerate(messages) if isinstance(msg.get("content"), (list, tuple))
            for part in msg["content"] if part.get(CHUNK_FIELD)]


def _place_chunks(full: str, ends: list[int], marked: list[tuple[int, str]]) -> tuple[list[tuple[int, int]], int]:
    """Character spans of the marked texts in the render ``full``, each found verbatim inside its own message and
    after the previous one (a template that rewrites content leaves a part unplaced); and how many were not."""
    spans, after, unplaced = [], 0, 0
    for i, text in marked:
        start = max(after, ends[i - 1] if i else 0)
        at = full.find(text, start, ends[i]) if text else -1
        if at < 0:
            unplaced += 1
            continue
        spans.append((at, at + len(text)))
        after = at + len(text)
    return spans, unplaced


def _auto_prefix_ids(tokenizer: Any) -> list[int]:
    """The ids the tokenizer puts in front of text by default (usually [BOS] or [])."""
    with_special = tokenizer(_PROBE)["input_ids"]
    plain = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
    for start in range(len(with_special) - len(plain) + 1):
        if with_special[start:start + len(plain)] == plain:
            return list(with_special[:start])
    return []  # adding specials rewrote the text itself: nothing is safe to prepend


def _sorted_json(value: Any) -> Any:
    """Recursively key-sorted copy, so a template's ``tojson`` prints keys in a stable order."""
    if isinstance(value, dict):
        return {k: _sorted_json(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, (list, tuple)):
        return [_sorted_json(v) for v in value]
    return value


def _canonical_tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools):
        raise InvalidRequestError("tools must be a list of tool definition objects", param="tools")
    return [_sorted_json(t) for t in tools] or None  # [] and no tools render the same


def _canonical_messages(messages: Any, clean: Callable[[str], str]) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise InvalidRequestError("messages must be a list of message objects", param="messages")
    if not messages:
        raise InvalidRequestError("messages must contain at least one message", param="messages")
    return [_canonical_message(f"messages[{i}]", m, clean) for i, m in enumerate(messages)]


def _canonical_message(where: str, msg: Any, clean: Callable[[str], str]) -> dict:
    if not isinstance(msg, dict):
        raise InvalidRequestError(f"{where} must be an object, got {type(msg).__name__}", param=where)
    role = msg.get("role")
    if role not in ROLES:
        raise InvalidRequestError(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}",
                                  param=f"{where}.role")
    out = {"role": role, "content": _canonical_content(where, role, msg.get("content"), clean)}
    for key in ("name", "tool_call_id"):
        if msg.get(key) is not None:
            if not isinstance(msg[key], str):
                raise InvalidRequestError(f"{where}.{key} must be a string", param=f"{where}.{key}")
            out[key] = msg[key]
    if msg.get("tool_calls"):
        out["tool_calls"] = _canonical_tool_calls(where, msg["tool_calls"])
    return out


def check_text(text: str, param: str) -> str:
    """Reject text that is not valid Unicode (lone surrogates cannot be encoded or tokenized)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"{param} is not valid UTF-8 text: {exc.reason} at position {exc.start}",
                                  param=param) from None
    return text


def _canonical_content(where: str, role: str, content: Any, clean: Callable[[str], str]) -> str:
    if isinstance(content, str):
        return clean(check_text(content, f"{where}.content"))
    if content is None and role == "assistant":
        return ""  # OpenAI allows null content beside tool_calls; templates expect a string
    if isinstance(content, dict):
        return json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    if not isinstance(content, (list, tuple)):
        raise InvalidRequestError(f"{where}.content must be a string or a list of content parts, "
                                  f"got {type(content).__name__}", param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise InvalidRequestError(f"{where}.content[{j}] has type {kind!r}: only 'text' parts are "
                                      "supported (no images, audio or files)", param=f"{where}.content[{j}].type")
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{where}.content[{j}].text must be a string",
                                      param=f"{where}.content[{j}].text")
        if not isinstance(part.get(CHUNK_FIELD, False), bool):
            raise InvalidRequestError(f"{where}.content[{j}].{CHUNK_FIELD} must be true or false",
                                      param=f"{where}.content[{j}].{CHUNK_FIELD}")
        text = clean(check_text(part["text"], f"{where}.content[{j}].text"))
        if part.get(CHUNK_FIELD) and not text.strip():
            raise InvalidRequestError(f"{where}.content[{j}] is marked {CHUNK_FIELD} but holds no text",
                                      param=f"{where}.content[{j}].text")
        texts.append(text)
    return "\n".join(texts)


def _canonical_tool_calls(where: str, calls: Any) -> list[dict]:
    if not isinstance(calls, (list, tuple)) or not all(isinstance(c, dict) for c in calls):
        raise InvalidRequestError(f"{where}.tool_calls must be a list of objects", param=f"{where}.tool_calls")
    out = [_sorted_json(call) for call in calls]
    for call in out:
        fn = call.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            # A JSON string and the same object as a dict must render identically; text that
            # is not a JSON object has no canonical form and is kept as the model wrote it.
            try:
                parsed = json.loads(fn["arguments"])
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                fn["arguments"] = _sorted_json(parsed)
    return out
