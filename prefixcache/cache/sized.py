"""Byte sizes in place of KV: the store's ``RunOps`` for replaying traffic without tensors.

A ``SizedKV`` says how many tokens a snapshot covers and how many bytes each takes; views
of one run share its identity, so run bookkeeping, compaction and the exact-memory checks
of ``KVStore.check_integrity`` work on sizes exactly as they do on tensors. The capacity
planner drives the real trie, policy and store through it.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple


class SizedKV(NamedTuple):
    """Tokens ``[offset, offset + tokens)`` of run ``run_id``; ``run_tokens`` is the run's length.

    Immutable, like a published snapshot; a tuple because a replay makes one per block."""

    tokens: int
    bytes_per_token: int
    run_id: int = 0
    offset: int = 0
    run_tokens: int = 0

    @property
    def nbytes(self) -> int:
        return self.tokens * self.bytes_per_token


_new = tuple.__new__


class SizedRuns:
    """``RunOps`` over ``SizedKV``. ``run(n, bytes_per_token)`` makes what a slicer returns."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)

    def run(self, tokens: int, bytes_per_token: int) -> SizedKV:
        return SizedKV(tokens, bytes_per_token, next(self._ids), 0, tokens)

    def per_token(self, run: SizedKV) -> int:
        return run.bytes_per_token

    def view(self, run: SizedKV, start: int, end: int) -> SizedKV:
        # tuple.__new__ skips the named constructor's Python frame: a replay makes a view per block.
        return _new(SizedKV, (end - start, run.bytes_per_token, run.run_id, run.offset + start, run.run_tokens))

    def copy(self, run: SizedKV, end: int) -> SizedKV:
        return self.run(end, run.bytes_per_token)

    def key(self, snap: SizedKV) -> int:
        return snap.run_id

    def follows(self, a: SizedKV, b: SizedKV) -> bool:
        return a.run_id == b.run_id and b.offset == a.offset + a.tokens

    def join(self, snaps: Sequence[SizedKV]) -> SizedKV:
        return self.run(sum(s.tokens for s in snaps), snaps[0].bytes_per_token)

    def tokens(self, snap: SizedKV) -> int:
        return snap.tokens

    def nbytes(self, snap: SizedKV) -> int:
        return snap.nbytes

    def run_nbytes(self, snap: SizedKV) -> int:
        return snap.run_tokens * snap.bytes_per_token

    def own(self, snap: SizedKV, nbytes: int) -> SizedKV:
        return snap if self.run_nbytes(snap) == nbytes else self.run(snap.tokens, snap.bytes_per_token)
