"""Structured outputs: an answer held to a JSON schema (OpenAI's ``response_format``) by constrained decoding.

``parse_response_format`` checks a call's format once: ``{"type": "json_schema", "json_schema": {"name", "schema",
"strict"}}`` (the answer is JSON matching ``schema``) or ``{"type": "json_object"}`` (any JSON object); "text"
or None constrain nothing. A schema llguidance cannot compile is a 400 naming ``response_format.json_schema
.schema``; a strict one follows OpenAI's strict-mode rules (``tool_schemas.check_strict_shape``). Not strict, a
string ``format`` llguidance does not know is an annotation, left out of the grammar (``_known_formats``).

``parse_output_format`` does the same for Anthropic's ``output_config.format`` (``{"type": "json_schema",
"schema"}``), whose schema follows Anthropic's rules (``tool_schemas.check_anthropic_shape``); its errors name
``output_config.format.schema``.

``Vocabulary`` is llguidance's view of the tokenizer (built once, on the first constrained call: about a second
for a vocabulary of tens of thousands). ``Constraint`` binds a format to it; each call gets its own
``GrammarLogits``, a logits processor that advances the grammar's matcher with the tokens chosen so far and sets
every token the grammar does not allow next to -inf. It runs where penalties run, before temperature, top-k and
top-p, so a sampled call draws within the allowed tokens, and a greedy one takes the likeliest of them. The
end-of-sequence tokens are allowed once the grammar is complete, and are then the only tokens allowed when it
cannot go on: the answer ends there. Both engines apply it: the serial engine in ``generate()``'s processors, the
batching engine in the row's ``Sampler`` (rows without a format keep the step's one argmax or joint draw). It
changes logits only, never the KV, so a cached answer stays the uncached one.

``tool_call_grammar`` turns a request that forces a call to strict tools only (``tool_choice`` "required" or a
named tool, every tool it may call strict) into a grammar of its own: the call(s) in the chat template family's
syntax (``tool_calls.call_layout``), each ``{"name": ..., "arguments": <that tool's schema>}``, then the end of
the answer. ``Constraint`` binds either grammar, and the engines apply it alike; the calls are still checked when
parsed (``tool_calls``).

After generation the answer's text is checked against the schema (``ResponseFormat.check``, the strict tools'
jsonschema validator) as a safety net: a mismatch is ``OutputFormatError``, never served. An answer cut by
``max_tokens`` ends with the partial JSON, as OpenAI's does.
"""
from __future__ import annotations

import copy
import functools
import json
import logging
import re
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from jsonschema.protocols import Validator
from llguidance import LLMatcher, LLTokenizer
from llguidance.hf import from_tokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
from transformers import LogitsProcessor

from prefixcache.errors import InvalidRequestError, OutputFormatError
from prefixcache.serving.tool_calls import ToolUse, call_layout
from prefixcache.serving.tool_schemas import (
    ANTHROPIC_FORMATS,
    OPENAI_FORMATS,
    check_anthropic_shape,
    check_strict_shape,
    compile_schema,
    first_mismatch,
    schema_objects,
)

log = logging.getLogger(__name__)

#: JSON as compact as json.dumps(separators=(",", ":")) writes it: no whitespace between tokens, so a model
#: cannot spend its answer on blank space.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}
#: The schema of ``{"type": "json_object"}``: any JSON object.
ANY_OBJECT: dict[str, Any] = {"type": "object"}
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SCHEMA_PARAM = "response_format.json_schema.schema"


@dataclass(frozen=True, eq=False, slots=True)
class ResponseFormat:
    """A checked ``response_format``: its type, name (json_schema), schema, strictness, llguidance grammar
    and the schema's validator."""

    kind: str  # "json_object" or "json_schema"
    name: str | None
    schema: dict[str, Any]
    strict: bool
    grammar: str
    validator: Validator

    def check(self, text: str) -> None:
        """Raise ``OutputFormatError`` unless ``text`` is JSON that matches the schema."""
        what = "a JSON object" if self.kind == "json_object" else \
            f"response_format {self.name!r}" if self.name is not None else "output_config.format's schema"
        try:
            value = json.loads(text)
        except ValueError as exc:
            log.warning("structured answer not served: not JSON: %s", exc)
            raise OutputFormatError(f"the model's answer is not JSON ({exc}), though it must be {what}") from exc
        try:
            error = first_mismatch(value, self.validator)
        except Exception as exc:  # noqa: BLE001 - a check that cannot finish serves nothing either
            raise OutputFormatError(f"the model's answer could not be checked against {what}: {exc}") from exc
        if error is not None:
            log.warning("structured answer not served: %s at %s: %s", what, error.json_path, error.message)
            raise OutputFormatError(f"the model's answer does not match {what} at {error.json_path}: "
                                    f"{error.message[:300]}")


def parse_response_format(value: Any, param: str = "response_format") -> ResponseFormat | None:
    """``value`` (OpenAI's ``response_format`` object, or a ``ResponseFormat``) checked and compiled; None for
    ``{"type": "text"}`` or None. A bad one raises ``InvalidRequestError`` naming where it is wrong."""
    if value is None or isinstance(value, ResponseFormat):
        return value
    if not isinstance(value, dict):
        raise InvalidRequestError("response_format must be an object such as {'type': 'json_object'}", param=param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _compiled("json_object", None, ANY_OBJECT, False, param)
    if kind != "json_schema":
        raise InvalidRequestError(f"response_format.type must be 'text', 'json_object' or 'json_schema', not "
                                  f"{kind!r}", param=f"{param}.type")
    spec = value.get("json_schema")
    at = f"{param}.json_schema"
    if not isinstance(spec, dict):
        raise InvalidRequestError(f"{at} must be an object with name and schema", param=at)
    name, schema, strict = spec.get("name"), spec.get("schema"), spec.get("strict")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequestError(f"{at}.name must be 1 to 64 letters, digits, underscores or dashes",
                                  param=f"{at}.name")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError(f"{at}.strict must be true or false", param=f"{at}.strict")
    if schema is None:
        raise InvalidRequestError(f"{at}.schema is required (a JSON schema object)", param=f"{at}.schema")
    return _compiled("json_schema", name, schema, bool(strict), f"{at}.schema")


def parse_output_format(value: Any, param: str = "output_config.format") -> ResponseFormat | None:
    """``value`` (Anthropic's ``output_config.format`` object, or a ``ResponseFormat``) checked and compiled;
    None for None. Its schema follows Anthropic's rules (``check_anthropic_shape``: every object closed with
    ``additionalProperties`` false, no numeric or length bounds, no recursion) and its string ``format``s are
    asserted; ``"format": "text"`` (what the ``anthropic`` client's ``transform_schema`` writes on a plain
    string) constrains nothing. A bad one raises ``InvalidRequestError`` naming where it is wrong."""
    if value is None or isinstance(value, ResponseFormat):
        return value
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{param} must be an object such as {{'type': 'json_schema', 'schema': {{...}}}}",
                                  param=param)
    if value.get("type") != "json_schema":
        raise InvalidRequestError(f"{param}.type must be 'json_schema', not {value.get('type')!r}",
                                  param=f"{param}.type")
    unknown = sorted(set(value) - {"type", "schema"})
    if unknown:
        raise InvalidRequestError(f"{param}.{unknown[0]}: unknown field", param=f"{param}.{unknown[0]}")
    if value.get("schema") is None:
        raise InvalidRequestError(f"{param}.schema is required (a JSON schema object)", param=f"{param}.schema")
    return _compiled("json_schema", None, value["schema"], True, f"{param}.schema", anthropic=True)


def _compiled(kind: str, name: str | None, schema: Any, strict: bool, at: str,
              anthropic: bool = False) -> ResponseFormat:
    """The format's validator and grammar, or a 400 naming ``at``; ``strict`` under OpenAI's strict-mode rules,
    or ``anthropic``'s."""
    validator = compile_schema(schema, at, formats=ANTHROPIC_FORMATS if anthropic else
                               OPENAI_FORMATS if strict else ())
    if anthropic:
        check_anthropic_shape(schema, None, at, owner="output_config.format")
    elif strict:
        check_strict_shape(schema, str(name), at, owner="response_format")
    try:
        grammar = LLMatcher.grammar_from_json_schema(_plain_text(schema) if anthropic else
                                                     schema if strict else _known_formats(schema),
                                                     defaults=JSON_OPTIONS)
        error = LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError) as exc:
        error = str(exc)
    if error:
        raise InvalidRequestError(f"{at} cannot be used to constrain the answer: {error}", param=at)
    return ResponseFormat(kind, name, schema, strict, grammar, validator)


@dataclass(frozen=True, eq=False, slots=True)
class ToolCallGrammar:
    """A forced call to strict tools as a grammar (``tool_call_grammar``): the answer is the call(s), in the
    template ``family``'s syntax, to one of ``names`` with arguments that match that tool's schema.

    ``grammar`` spells the family's markers (``<tool_call>``) in text; ``bound`` lets a marker that is one token
    of the vocabulary be that token too (llguidance will not spell a token it holds special, such as an added
    ``<tool_call>``, in text, and a model writes the marker as its token)."""

    family: str
    names: tuple[str, ...]
    parallel: bool  # one call or more; else exactly one
    markers: tuple[str, ...]
    lark: Callable[[Mapping[str, int]], str]  # the grammar in lark, each marker in the map also its token
    grammar: str

    def bound(self, tokens: Mapping[str, int]) -> str:
        """The grammar, each marker in ``tokens`` written as its text or as that token id."""
        return LLMatcher.grammar_from_lark(self.lark(tokens))


def tool_call_grammar(use: ToolUse | None) -> ToolCallGrammar | None:
    """The grammar of the answer to a request that forces a call (``tool_choice`` "required" or a tool's name)
    when every tool it may call is strict: exactly one call (``use.parallel``: one or more) in ``use.family``'s
    syntax (``tool_calls.call_layout``), each ``{"name": <a tool it may call>, <arguments>: <that tool's schema>}``,
    then the end of the answer. None where nothing is forced, a tool it may call is not strict, or a schema
    cannot be compiled to a grammar (its calls are then only checked after generation, as ever)."""
    if use is None or use.choice in ("auto", "none"):
        return None
    names = tuple(sorted(use.names)) if use.choice == "required" else (use.choice,)
    if not names or not all(name in use.strict for name in names):
        return None
    (opening, separator, closing), key, markers = call_layout(use.family)
    rules = []
    for i, name in enumerate(names):
        schema = getattr(use.strict[name], "schema", None)
        if not isinstance(schema, dict):
            return None
        schema = {**_plain_text(schema), "x-guidance": JSON_OPTIONS}
        head = f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{key}": '
        rules.append(f"call_{i}: {_literal(head)} %json {json.dumps(schema)} {_literal('}')}")
    call = " | ".join(f"call_{i}" for i in range(len(names)))

    def lark(tokens: Mapping[str, int]) -> str:
        def text(part: str) -> str:
            return _spelled(part, markers, tokens)
        calls = f"({call}) ({text(separator)} ({call}))*" if use.parallel else f"({call})"
        start = " ".join(part for part in (text(opening), calls, text(closing)) if part)
        return "\n".join(["%llguidance {}", f"start: {start}", *rules, ""])

    try:
        grammar = LLMatcher.grammar_from_lark(lark({}))
        error = LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError) as exc:
        error = str(exc)
    if error:
        log.warning("forced call to %s not constrained (only checked when done): %s", ", ".join(names),
                    error.strip().splitlines()[0] if error.strip() else error)
        return None
    return ToolCallGrammar(use.family, names, use.parallel, markers, lark, grammar)


def _spelled(text: str, markers: Sequence[str], tokens: Mapping[str, int]) -> str:
    """``text`` as a lark sequence ("" for none): string literals, each of ``markers`` it holds that has an id
    in ``tokens`` either its text or that token."""
    for marker in markers:
        if marker in tokens and marker in text:
            before, _, after = text.partition(marker)
            either = f"({_literal(marker)} | <[{tokens[marker]}]>)"
            return " ".join(p for p in (_spelled(before, markers, tokens), either,
                                        _spelled(after, markers, tokens)) if p)
    return _literal(text)


def _literal(text: str) -> str:
    """``text`` as a lark string literal ("" for none)."""
    return json.dumps(text) if text else ""


def _known_formats(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (a valid JSON schema) without the string ``format``s llguidance does not know: in a schema that
    is not strict an unknown ``format`` is an annotation, as JSON schema has it (its validator asserts none), so
    the grammar leaves it out rather than refusing the schema."""
    unknown = [node for node in schema_objects(schema)
               if isinstance(node.get("format"), str) and not _grammar_knows(node["format"])]
    if not unknown:
        return schema
    plain = copy.deepcopy(schema)
    for node in schema_objects(plain):
        if isinstance(node.get("format"), str) and not _grammar_knows(node["format"]):
            del node["format"]
    return plain


@functools.lru_cache(maxsize=256)
def _grammar_knows(string_format: str) -> bool:
    """Whether llguidance constrains a string to ``string_format`` (it refuses a schema with one it does not)."""
    try:
        return not LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(
            {"type": "string", "format": string_format}))
    except (ValueError, TypeError):
        return False


def _plain_text(node: Any) -> Any:
    """``node`` without ``"format": "text"`` on its string schemas (a plain string, for llguidance, which knows
    no such format)."""
    if isinstance(node, list):
        return [_plain_text(item) for item in node]
    if not isinstance(node, dict):
        return node
    return {key: _plain_text(value) for key, value in node.items()
            if not (key == "format" and value == "text" and node.get("type") == "string")}


class Vocabulary:
    """llguidance's view of ``tokenizer`` (a fast, Rust-backed Hugging Face tokenizer) for logits ``width``
    tokens wide; one per set of end-of-sequence ids, each built on first use."""

    def __init__(self, tokenizer: Any, width: int):
        self.tokenizer, self.width = tokenizer, width
        self._built: dict[frozenset[int], LLTokenizer] = {}
        self._special: dict[frozenset[int], tuple[int, ...]] = {}
        self._lock = threading.Lock()

    def constraint(self, fmt: ResponseFormat | ToolCallGrammar, eos_ids: Collection[int]) -> Constraint:
        """``fmt``'s grammar bound to this vocabulary, its answer ending at one of ``eos_ids`` (a 400 if there are
        none, or a forced call's marker this vocabulary cannot write)."""
        eos = frozenset(eos_ids)
        if not eos:
            raise InvalidRequestError("response_format needs the answer to end at an end-of-sequence token: the "
                                      "model has none, or ignore_eos is set", param="response_format")
        with self._lock:
            built = self._built.get(eos)
            if built is None:
                try:
                    built = from_tokenizer(self.tokenizer, n_vocab=max(self.width, len(self.tokenizer)),
                                           eos_token=sorted(eos))
                except ValueError as exc:  # a slow (Python) tokenizer
                    raise InvalidRequestError(f"response_format needs a fast (Rust-backed) tokenizer: {exc}",
                                              param="response_format") from exc
                self._built[eos] = built
                self._special[eos] = tuple(t for t in range(min(built.vocab_size, self.width))
                                           if built.is_special_token(t) and t not in eos)
            special = self._special[eos]
        if isinstance(fmt, ResponseFormat):
            return Constraint(fmt.grammar, built, self.width, special)
        return Constraint(fmt.bound(self._marker_tokens(fmt.markers, built)), built, self.width, special)

    def _marker_tokens(self, markers: Sequence[str], built: LLTokenizer) -> dict[str, int]:
        """The ``markers`` that are one token llguidance holds special, with their ids; ``InvalidRequestError``
        where such a token is special to the tokenizer too (decoded text would lose the marker)."""
        out = {}
        for marker in markers:
            token = self.tokenizer.convert_tokens_to_ids(marker)
            if not isinstance(token, int) or not 0 <= token < self.width or \
                    self.tokenizer.convert_ids_to_tokens(token) != marker or not built.is_special_token(token):
                continue
            if token in self.tokenizer.all_special_ids:
                raise InvalidRequestError(f"the tool-call marker {marker} is a special token of this tokenizer: "
                                          "left out of the answer's text, so a call cannot be constrained")
            out[marker] = token
        return out


@dataclass(frozen=True, eq=False, slots=True)
class Constraint:
    """A grammar (a response format's, or a forced tool call's) bound to a vocabulary: what a call's
    ``SamplingParams`` carry."""

    grammar: str  # llguidance's
    tokenizer: LLTokenizer
    width: int  # the logits' width
    special: tuple[int, ...] = ()  # the tokens llguidance holds special, less the end-of-sequence ones

    def processor(self, prompt_len: int) -> GrammarLogits:
        """A fresh matcher for one call whose prompt is ``prompt_len`` tokens long."""
        return GrammarLogits(self, prompt_len)


class GrammarLogits(LogitsProcessor):
    """One call's grammar: each call advances the matcher with the tokens chosen since the last, then sets the
    logits of the tokens it does not allow next to -inf. input_ids: [1, S] (prompt, then the answer so far);
    scores: [1, V]. A matcher in error (a limit of llguidance's reached) allows only the end-of-sequence
    tokens, so the call ends and the final check reports it. Where the processors before it left none of the
    tokens it allows (``min_new_tokens`` masks the end-of-sequence tokens, the only ones a complete JSON allows),
    the end-of-sequence tokens get score 0: the answer ends with its JSON, and a step always has a token to draw.

    Where the grammar forces text that a token llguidance holds special spells (an added ``</tool_call>`` in an
    ``enum`` string), llguidance's mask offers that token and its matcher then refuses it: such a token is taken
    out of the allowed ones, and the forced text is spelled with ordinary tokens instead."""

    def __init__(self, constraint: Constraint, prompt_len: int):
        self.matcher = LLMatcher(constraint.tokenizer, constraint.grammar, log_level=0)  # errors: below
        self.prompt_len, self.seen, self.width = prompt_len, 0, constraint.width
        self.eos = [t for t in constraint.tokenizer.eos_tokens if t < constraint.width]
        self.tokenizer, self.special = constraint.tokenizer, np.asarray(constraint.special, dtype=np.int64)
        self._bits = allocate_token_bitmask(1, constraint.tokenizer.vocab_size)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        chosen = input_ids[0, self.prompt_len + self.seen :].tolist()
        for token in chosen:
            self.matcher.consume_token(token)
        self.seen += len(chosen)
        allowed = torch.from_numpy(self.allowed())
        out = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        if not bool(torch.isfinite(out).any()):  # a processor before it ruled out all it allows (min_new_tokens
            out[:, self.eos] = 0.0  # masking the end of a complete JSON): the grammar's end wins, never no token
        return out

    def allowed(self) -> np.ndarray:
        """[width] bool: the tokens the grammar allows next."""
        if not self.matcher.is_error():
            fill_next_token_bitmask(self.matcher, self._bits)
            allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.width].view(bool)
            self._refuse_special(allowed)
            if allowed.any():
                return allowed
        log.warning("the grammar of a structured answer failed (%s): the answer ends here",
                    (self.matcher.get_error() or "no token allowed").splitlines()[0])
        allowed = np.zeros(self.width, dtype=bool)
        allowed[self.eos] = True
        return allowed

    def _refuse_special(self, allowed: np.ndarray) -> None:
        """Take out of ``allowed`` the special tokens in it that the matcher refuses; where that leaves none,
        allow the first ordinary token of the text the grammar forces."""
        refused = [t for t in self.special[allowed[self.special]].tolist() if not self.matcher.validate_tokens([t])]
        if not refused:
            return
        allowed[refused] = False
        if allowed.any():
            return
        forced = self.matcher.compute_ff_bytes()
        for cut in range(len(forced), max(len(forced) - 4, 0), -1):  # the forced bytes may end inside a character
            try:
                text = forced[:cut].decode()
            except UnicodeDecodeError:
                continue
            first = self.tokenizer.greedy_tokenize(text)[:1]
            if first and first[0] < self.width and self.matcher.validate_tokens(first):
                allowed[first[0]] = True
            return
