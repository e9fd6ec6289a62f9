"""Workload generation and option parsing: the benchmark's inputs are what they claim to be."""
from __future__ import annotations

import argparse
import random

import pytest

from prefixcache.bench import add_arguments
from prefixcache.bench.options import PRESETS, SharedPrefixSpec, options_from_args
from prefixcache.bench.workloads import TokenSpace, build, ideal_cached, multi_turn, no_reuse, shared_prefix

SPACE = TokenSpace(64, frozenset({0, 1}))


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_shared_prefix_groups_share_their_system_prompt_and_are_shuffled():
    spec = SharedPrefixSpec(groups=3, prompts=4, system_tokens=10, question_tokens=5)
    w = shared_prefix(spec, SPACE, random.Random(1))
    assert len(w.requests) == 12 and [r.index for r in w.requests] == list(range(12))
    for r in w.requests:
        assert r.new_tokens[:10] == w.prefixes[r.group] and len(r.new_tokens) == 15
        assert not {0, 1} & set(r.new_tokens)
    assert len({r.session for r in w.requests}) == 12
    assert [r.group for r in w.requests] != sorted(r.group for r in w.requests)  # shuffled
    assert w.formula_hit_rate == pytest.approx((1 - 1 / 4) * 10 / 15)


def test_workloads_are_deterministic_per_seed():
    opts = PRESETS["small"]
    assert build("shared-prefix", opts, SPACE) == build("shared-prefix", opts, SPACE)
    other = options_from_args(_parse("--seed", "7"))
    assert build("shared-prefix", other, SPACE).requests != build("shared-prefix", opts, SPACE).requests


def test_multi_turn_rounds_follow_each_users_order():
    w = multi_turn(PRESETS["small"].multi, SPACE, random.Random(3))
    spec = PRESETS["small"].multi
    assert len(w.requests) == spec.users * spec.rounds
    for u in range(spec.users):
        mine = [r for r in w.requests if r.session == f"u{u}"]
        assert [r.round for r in mine] == list(range(spec.rounds))
        assert mine[0].new_tokens[: spec.system_tokens] == w.prefixes["system"]
        assert all(len(r.new_tokens) == spec.question_tokens for r in mine[1:])
        assert [r.last_in_session for r in mine] == [False] * (spec.rounds - 1) + [True]
    rounds = w.rounds()
    assert [len(b) for b in rounds] == [spec.users] * spec.rounds


def test_no_reuse_has_nothing_to_share():
    w = no_reuse(PRESETS["small"].unique, SPACE, random.Random(0))
    assert w.prefixes == {} and all(r.group is None for r in w.requests)
    assert len({r.new_tokens for r in w.requests}) == len(w.requests)


def test_ideal_cached_is_the_longest_common_prefix_leaving_one_token():
    assert ideal_cached([1, 2, 3, 4], []) == 0
    assert ideal_cached([1, 2, 3, 4], [[1, 2, 9], [1, 2, 3, 7]]) == 3
    assert ideal_cached([1, 2, 3], [[1, 2, 3, 4]]) == 2  # the last prompt token is always computed


def test_flags_override_the_preset_and_bad_names_are_refused():
    opts = options_from_args(_parse("--preset", "default", "--groups", "5", "--dtype", "bfloat16",
                                     "--systems", "generate,prefixcache", "--workloads", "no-reuse"))
    assert opts.shared.groups == 5 and opts.shared.system_tokens == PRESETS["default"].shared.system_tokens
    assert opts.dtypes == ("bfloat16",) and opts.systems == ("generate", "prefixcache")
    assert PRESETS["default"].shared.groups != 5  # the preset itself is untouched
    with pytest.raises(SystemExit):
        _parse("--systems", "generate,vllm")
    with pytest.raises(SystemExit):
        _parse("--output-tokens", "0")
