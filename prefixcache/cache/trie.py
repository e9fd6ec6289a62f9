"""Prefix trie over token blocks: structure and matching, no policy.

Each node holds one block of at most ``block_size`` tokens that starts at a multiple
of ``block_size``. Only full blocks have children, so a partial block is always a
leaf; extending one creates a full sibling (copy-on-write) instead of writing to it.
Children are indexed two ways: by chained block key (exact full-block lookups in
O(1)) and by first token (token-granular partial matches). Every candidate found by
key is confirmed by comparing token ids. Most nodes of a large trie have one child
(a conversation's blocks form a chain), so a lone child is held directly and the two
indexes exist only from the second child on.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from prefixcache.cache.hashing import BlockHasher


@dataclass(slots=True, eq=False)
class Node:
    """One block of a cached prefix. ``kv`` is opaque here (the store owns it)."""

    key: int
    tokens: tuple[int, ...]
    start: int
    parent: Node | None
    tenant: str
    kv: Any = None
    nbytes: int = 0
    only: Node | None = None  # the child, while there is exactly one
    by_key: dict[int, list[Node]] | None = None  # children by chained key, from the second child on
    by_first: dict[int, list[Node]] | None = None  # children by first token, likewise
    num_children: int = 0
    refcount: int = 0
    pins: int = 0  # every pin of a path through this block: the operator's and its tenant's
    operator_pins: int = 0  # of ``pins``, the operator's (``privileged``): no deadline, undone by the operator only
    pin_until: float = math.inf  # while the tenant's pins (the others) last: when they lapse together
    last_access: float = 0.0
    expires_at: float = -math.inf  # set when the store publishes the node
    alive: bool = True
    doomed: bool = False  # flushed while in use: never matched, freed on release
    namespace: tuple[str, ...] | None = None  # set on roots only
    indexed: int = 0  # which of the store's indexes hold this node (``StoreIndex.sync`` owns it)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def children(self) -> Iterator[Node]:
        if self.only is not None:
            yield self.only
        elif self.by_first is not None:
            for bucket in self.by_first.values():
                yield from bucket

    def keyed(self, key: int) -> Sequence[Node]:
        """Children whose chained key is ``key`` (candidates: confirm by token ids)."""
        if self.by_key is not None:
            return self.by_key.get(key, ())
        only = self.only
        return (only,) if only is not None and only.key == key else ()

    def starting(self, token: int) -> Sequence[Node]:
        """Children whose first token is ``token``."""
        if self.by_first is not None:
            return self.by_first.get(token, ())
        only = self.only
        return (only,) if only is not None and only.tokens[0] == token else ()


class Step(NamedTuple):
    """A matched node and how many of its tokens the match uses (from its start)."""

    node: Node
    used: int


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixTrie:
    """Namespace roots plus block nodes. Not thread-safe: the store serialises access."""

    def __init__(self, block_size: int, hasher: BlockHasher):
        self.block_size = block_size
        self.hasher = hasher
        self._roots: dict[int, list[Node]] = {}

    # -- roots ---------------------------------------------------------------------
    def root(self, namespace: tuple[str, ...], tenant: str, create: bool) -> Node | None:
        key = self.hasher.root(namespace)
        for node in self._roots.get(key, ()):
            if node.namespace == namespace:  # confirm: a hash never decides alone
                return node
        if not create:
            return None
        node = Node(key=key, tokens=(), start=0, parent=None, tenant=tenant, namespace=namespace)
        self._roots.setdefault(key, []).append(node)
        return node

    def roots(self) -> Iterator[Node]:
        for bucket in self._roots.values():
            yield from bucket

    def drop_root_if_empty(self, root: Node) -> None:
        if root.num_children == 0 and root.refcount == 0:
            bucket = self._roots.get(root.key, [])
            if root in bucket:
                bucket.remove(root)
                if not bucket:
                    del self._roots[root.key]
            root.alive = False

    # -- matching ------------------------------------------------------------------
    def match(self, root: Node, tokens: Sequence[int], limit: int, usable: Callable[[Node], bool]) -> list[Step]:
        """Longest cached prefix of ``tokens[:limit]`` below ``root``, token-granular.

        Full blocks are found by chained key and confirmed by token ids; the last
        step may use only part of a node (a partial block, or a divergence inside a
        block). Nodes for which ``usable`` is false (expired, freed) end the match.
        """
        steps: list[Step] = []
        node, pos, bs = root, 0, self.block_size
        while pos < limit:
            block = tuple(tokens[pos : pos + bs])
            child = None
            if len(block) == bs:
                only = node.only
                if only is not None:  # one child: its tokens decide (its key is chained from them), no hash
                    child = only if only.tokens == block and usable(only) else None
                else:
                    key = self.hasher.chain(node.key, block)
                    child = next((c for c in node.keyed(key) if c.tokens == block and usable(c)), None)
            if child is not None:
                used = min(bs, limit - pos)
                steps.append(Step(child, used))
                pos += used
                node = child
                if used < bs:
                    break
                continue
            best, best_len = None, 0
            want = tokens[pos:limit]
            for cand in node.starting(want[0]):
                if usable(cand):
                    n = common_prefix(cand.tokens, want)
                    if n > best_len:
                        best, best_len = cand, n
            if best is not None:
                steps.append(Step(best, best_len))
            break
        return steps

    def covering(self, parent: Node, chunk: tuple[int, ...], usable: Callable[[Node], bool]) -> Node | None:
        """A usable child of ``parent`` holding ``chunk`` (a partial chunk may sit inside a longer block)."""
        n = len(chunk)
        for child in parent.starting(chunk[0]):
            tokens = child.tokens
            if (tokens == chunk or (n < self.block_size and tokens[:n] == chunk)) and usable(child):
                return child
        return None

    def superseded(self, parent: Node, chunk: tuple[int, ...]) -> list[Node]:
        """Children of ``parent`` that ``chunk`` extends: shorter partial blocks it would replace."""
        if len(chunk) < 2:
            return []
        return [c for c in parent.starting(chunk[0]) if len(c.tokens) < len(chunk) and chunk[: len(c.tokens)] == c.tokens]

    # -- mutation ------------------------------------------------------------------
    def add_child(self, parent: Node, tokens: tuple[int, ...]) -> Node:
        assert parent.parent is None or len(parent.tokens) == self.block_size, "only full blocks have children"
        assert 0 < len(tokens) <= self.block_size
        key = self.hasher.chain(parent.key, tokens)
        node = Node(key, tokens, parent.start + len(parent.tokens), parent, parent.tenant)  # start: parent.end
        if parent.num_children == 0:
            parent.only = node
        else:
            if parent.by_key is None:  # a second child: index both
                parent.by_key, parent.by_first = {}, {}
                _index(parent, parent.only)
                parent.only = None
            _index(parent, node)
        parent.num_children += 1
        return node

    def remove_leaf(self, node: Node) -> None:
        assert node.num_children == 0 and node.parent is not None
        parent = node.parent
        if parent.by_key is None:
            assert parent.only is node
            parent.only = None
        else:
            for index, k in ((parent.by_key, node.key), (parent.by_first, node.tokens[0])):
                bucket = index[k]
                bucket.remove(node)
                if not bucket:
                    del index[k]
            if parent.num_children == 2:  # one child left: back to holding it directly
                parent.only = next(iter(parent.by_key.values()))[0]
                parent.by_key = parent.by_first = None
        parent.num_children -= 1
        node.alive = False

    def iter_nodes(self, roots: Iterable[Node] | None = None) -> Iterator[Node]:
        """Every non-root node (below ``roots``, default all), parents before children."""
        stack = list(self.roots() if roots is None else roots)
        while stack:
            node = stack.pop()
            if not node.is_root:
                yield node
            stack.extend(node.children())


def _index(parent: Node, child: Node) -> None:
    parent.by_key.setdefault(child.key, []).append(child)
    parent.by_first.setdefault(child.tokens[0], []).append(child)
