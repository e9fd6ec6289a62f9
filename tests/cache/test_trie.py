"""The prefix trie against a brute-force reference: token-granular longest-prefix matching."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache.hashing import BlockHasher
from prefixcache.cache.trie import Node, PrefixTrie, common_prefix

NS = ("tenant", "model")
# A small alphabet makes shared prefixes, divergences inside blocks and equal blocks common.
SEQ = st.lists(st.integers(0, 3), min_size=1, max_size=14)


def insert(trie: PrefixTrie, root: Node, tokens: list[int]) -> list[Node]:
    """Store ``tokens`` block by block as the store does; returns the path of nodes.

    An equal block is reused; a block that extends a partial leaf becomes its sibling
    (copy-on-write: a partial block never gets children or longer tokens).
    """
    path, node, bs = [], root, trie.block_size
    for start in range(0, len(tokens), bs):
        block = tuple(tokens[start : start + bs])
        child = next((c for c in node.children() if c.tokens == block), None)
        node = child if child is not None else trie.add_child(node, block)
        path.append(node)
    return path


def reference(paths: list[tuple[list[int], list[Node]]], query: list[int], limit: int, dead: set[int]) -> int:
    """Longest prefix of ``query[:limit]`` any stored sequence provides up to its first dead node."""
    best = 0
    for tokens, path in paths:
        alive_end = next((n.start for n in path if id(n) in dead), len(tokens))
        best = max(best, min(common_prefix(tokens, query[:limit]), alive_end))
    return best


def check_steps(root: Node, steps, query: list[int], bs: int) -> int:
    """The steps form a parent chain from the root whose used tokens spell ``query``'s prefix."""
    pos, parent = 0, root
    for step in steps:
        assert step.node.parent is parent and step.node.start == pos
        assert 0 < step.used <= len(step.node.tokens)
        assert list(step.node.tokens[: step.used]) == query[pos : pos + step.used]
        pos += step.used
        parent = step.node
    assert all(s.used == bs for s in steps[:-1])  # only the last step may stop inside a block
    return pos


@pytest.mark.parametrize("hash_fn", [None, lambda data, seed: 7], ids=["xxh3", "constant"])
@settings(max_examples=150, deadline=None)
@given(data=st.data(), block_size=st.integers(1, 5), stored=st.lists(SEQ, min_size=1, max_size=8),
       queries=st.lists(SEQ, min_size=1, max_size=6))
def test_match_equals_brute_force(hash_fn, data, block_size, stored, queries):
    hasher = BlockHasher(5) if hash_fn is None else BlockHasher(5, hash_fn)
    trie = PrefixTrie(block_size, hasher)
    root = trie.root(NS, "tenant", create=True)
    paths = [(s, insert(trie, root, s)) for s in stored]
    nodes = list(trie.iter_nodes())
    assert len(nodes) == len({id(n) for _, p in paths for n in p})  # every node once, none lost
    for node in nodes:
        assert node.is_root or node.parent is root or len(node.parent.tokens) == block_size
    # some leaves removed, some nodes unusable (expired, doomed): both end a match there
    removed = {id(n) for n in nodes if n.num_children == 0 and data.draw(st.booleans(), "remove")}
    for node in nodes:
        if id(node) in removed:
            trie.remove_leaf(node)
    unusable = {id(n) for n in nodes if id(n) not in removed and data.draw(st.integers(0, 5), "unusable") == 0}
    assert {id(n) for n in trie.iter_nodes()} == {id(n) for n in nodes} - removed
    for query in queries:
        limit = data.draw(st.integers(0, len(query)), "limit")
        steps = trie.match(root, query, limit, lambda n: id(n) not in unusable)
        got = check_steps(root, steps, query, block_size)
        assert got == reference(paths, query, limit, removed | unusable), (stored, query, limit)
        assert all(id(s.node) not in unusable for s in steps)


def test_roots_are_confirmed_by_namespace_not_by_hash():
    trie = PrefixTrie(4, BlockHasher(0, lambda data, seed: 1))  # every root collides
    a = trie.root(("a", "bc"), "a", create=True)
    b = trie.root(("ab", "c"), "ab", create=True)
    assert a is not b and a.key == b.key
    assert trie.root(("a", "bc"), "a", create=False) is a and trie.root(("x",), "x", create=False) is None
    trie.drop_root_if_empty(a)
    assert not a.alive and list(trie.roots()) == [b]


def test_a_root_in_use_or_with_children_is_kept():
    trie = PrefixTrie(2, BlockHasher(0))
    root = trie.root(NS, "t", create=True)
    child = trie.add_child(root, (1, 2))
    trie.drop_root_if_empty(root)
    assert root.alive
    trie.remove_leaf(child)
    root.refcount = 1
    trie.drop_root_if_empty(root)
    assert root.alive
    root.refcount = 0
    trie.drop_root_if_empty(root)
    assert not root.alive and list(trie.roots()) == []


def test_only_full_blocks_take_children():
    trie = PrefixTrie(4, BlockHasher(0))
    root = trie.root(NS, "t", create=True)
    partial = trie.add_child(root, (1, 2))
    with pytest.raises(AssertionError, match="full blocks"):
        trie.add_child(partial, (3,))
    with pytest.raises(AssertionError):
        trie.add_child(root, (1, 2, 3, 4, 5))  # longer than a block
    full = trie.add_child(root, (1, 2, 3, 4))
    assert trie.add_child(full, (5,)).start == 4
