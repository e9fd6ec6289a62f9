"""Which live blocks view each run, so held bytes always equal accounted bytes.

The blocks one insert stores are views of one run (``KVStore._grow``). When some of them
are freed, the run still holds their bytes: the run is *dirty* until ``compact`` re-homes
the survivors into exact-size runs. The store compacts before every operation returns, so
between operations every run is covered exactly by the blocks viewing it.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prefixcache.cache.runs import RunOps
from prefixcache.cache.trie import Node


class RunBook:
    def __init__(self, ops: RunOps):
        self._ops = ops
        # Run key -> live nodes viewing it, in path order (a list: runs are short, and a list
        # of a few pointers is far smaller than a set when a trie holds millions of blocks).
        self._runs: dict[int, list[Node]] = {}
        self._dirty: set[int] = set()

    def add(self, run: Any, nodes: list[Node]) -> None:
        """``nodes`` (a path, root-first) are the views of ``run``."""
        self._runs[self._ops.key(run)] = list(nodes)

    def drop(self, node: Node) -> None:
        """``node`` is being freed: its run no longer counts it (and is dirty if others remain)."""
        key = self._ops.key(node.kv)
        nodes = self._runs[key]
        nodes.remove(node)
        if nodes:
            self._dirty.add(key)
        else:
            del self._runs[key]
            self._dirty.discard(key)

    def compact(self) -> None:
        """Re-home the surviving blocks of partly freed runs into exact-size runs.

        A run's blocks are a path, freed deepest first, so survivors are contiguous; each
        contiguous group is cloned once and its nodes repointed (same values: a snapshot's
        content never changes). Readers still holding the old views keep them valid until
        they drop them.
        """
        ops = self._ops
        while self._dirty:
            nodes = sorted(self._runs.pop(self._dirty.pop()), key=lambda n: n.start)
            groups: list[list[Node]] = []
            for node in nodes:
                if groups and ops.follows(groups[-1][-1].kv, node.kv):
                    groups[-1].append(node)
                else:
                    groups.append([node])
            for group in groups:
                span = ops.join([n.kv for n in group])
                at = 0
                for node in group:
                    n = ops.tokens(node.kv)
                    node.kv, at = ops.view(span, at, at + n), at + n
                self._runs[ops.key(span)] = group

    def check(self, nodes: Iterable[Node]) -> None:
        """Every live block is in its run's list, and every run is covered exactly by its blocks."""
        ops = self._ops
        for node in nodes:
            assert node in self._runs.get(ops.key(node.kv), ()), "snapshot outside its run"
        assert not self._dirty, "partly freed run not compacted"
        for run in self._runs.values():
            assert run and all(n.alive for n in run) and len(set(run)) == len(run)
            held = ops.run_nbytes(run[0].kv)
            assert sum(n.nbytes for n in run) == held, "run holds bytes no block accounts for"
