"""Block hashes: chaining, the seed, length-prefixed namespaces, the injected hash function."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache.hashing import BlockHasher, encode_namespace, token_bytes, xxh3_64

PARTS = st.lists(st.text(max_size=6), max_size=4).map(tuple)
TOKENS = st.lists(st.integers(0, 2**40), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(a=PARTS, b=PARTS)
def test_namespace_encoding_is_injective(a, b):
    """Distinct tuples never encode alike, whatever their joined strings are."""
    assert (encode_namespace(a) == encode_namespace(b)) == (a == b)


@pytest.mark.parametrize("a, b", [(("a", "bc"), ("ab", "c")), (("a", ""), ("a",)), (("",), ()),
                                  (("a\x00", "b"), ("a", "\x00b")), (("é",), ("e\u0301",))])
def test_namespaces_that_join_alike_have_different_roots(a, b):
    hasher = BlockHasher(seed=3)
    assert hasher.root(a) != hasher.root(b)
    assert hasher.root(a) == BlockHasher(seed=3).root(a)  # deterministic for one seed


def test_namespace_parts_must_be_strings():
    with pytest.raises(TypeError, match="str"):
        encode_namespace(("tenant", 7))


def test_chain_depends_on_the_parent_the_tokens_and_their_order():
    h = BlockHasher(seed=11)
    root = h.root(("t",))
    key = h.chain(root, [1, 2, 3])
    assert key == h.chain(root, [1, 2, 3])
    assert key != h.chain(root, [3, 2, 1]) and key != h.chain(root, [1, 2]) and key != h.chain(root + 1, [1, 2, 3])
    # chaining: the same block under another parent is another key, so equal blocks at
    # different positions (or after different prefixes) never share a key
    assert h.chain(key, [1, 2, 3]) != key
    assert h.chain(h.chain(root, [1, 2]), [3]) != h.chain(h.chain(root, [1]), [2, 3])


def test_tokens_are_encoded_as_64_bit_ids():
    """Large ids are not truncated: 2**32 + 1 and 1 differ, and two ids never read as one."""
    assert token_bytes([2**32 + 1]) != token_bytes([1])
    assert len(token_bytes([1, 2])) == 16
    h = BlockHasher(seed=0)
    assert h.chain(0, [2**32 + 1]) != h.chain(0, [1])


def test_the_seed_changes_every_key_and_defaults_to_a_secret():
    a, b = BlockHasher(seed=1), BlockHasher(seed=2)
    assert a.root(("t",)) != b.root(("t",)) and a.chain(5, [1, 2]) != b.chain(5, [1, 2])
    assert BlockHasher().seed != BlockHasher().seed  # drawn per hasher (64 random bits)
    assert 0 <= BlockHasher().seed < 2**64


def test_the_injected_function_gets_the_data_and_the_seed_and_decides_the_key():
    calls: list[tuple[bytes, int]] = []

    def recording(data: bytes, seed: int) -> int:
        calls.append((data, seed))
        return len(calls)

    h = BlockHasher(seed=42, hash_fn=recording)
    assert h.root(("ab", "c")) == 1
    assert calls[0] == (b"ns" + encode_namespace(("ab", "c")), 42)  # roots are domain-separated
    assert h.chain(7, [5, 6]) == 2
    assert calls[1] == ((7).to_bytes(8, "little") + token_bytes([5, 6]), 42)
    # and the default function is seeded xxh3 over the same bytes
    assert BlockHasher(seed=42).chain(7, [5, 6]) == xxh3_64(calls[1][0], 42)
