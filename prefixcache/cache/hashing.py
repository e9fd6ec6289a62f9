"""Block hashes: chained xxhash over token blocks, rooted in a namespace.

A hash only *finds* a candidate; the trie confirms every hit by comparing token ids,
so a collision (or a hash function forced to a constant in tests) can cost speed,
never correctness.
"""
from __future__ import annotations

import secrets
from array import array
from collections.abc import Callable, Sequence

import xxhash

#: (data, seed) -> 64-bit digest. Injected so tests can force collisions.
HashFn = Callable[[bytes, int], int]


#: The default ``HashFn`` (the C function itself: a block key is computed for every block stored).
xxh3_64: HashFn = xxhash.xxh3_64_intdigest


def encode_namespace(parts: Sequence[str]) -> bytes:
    """Length-prefix every part so ("a", "bc") and ("ab", "c") encode differently."""
    out = bytearray(len(parts).to_bytes(4, "little"))
    for part in parts:
        if not isinstance(part, str):
            raise TypeError(f"namespace parts must be str, got {type(part).__name__}")
        raw = part.encode("utf-8")
        out += len(raw).to_bytes(8, "little") + raw
    return bytes(out)


def token_bytes(tokens: Sequence[int]) -> bytes:
    return array("q", tokens).tobytes()


class BlockHasher:
    """Computes namespace roots and chained block keys with one per-process seed."""

    __slots__ = ("seed", "_fn")

    def __init__(self, seed: int | None = None, hash_fn: HashFn = xxh3_64):
        # A secret seed keeps block keys unpredictable to clients who could otherwise
        # craft colliding prompts (collisions are harmless for correctness, not for speed).
        self.seed = secrets.randbits(64) if seed is None else seed
        self._fn = hash_fn

    def root(self, namespace: Sequence[str]) -> int:
        return self._fn(b"ns" + encode_namespace(namespace), self.seed)

    def chain(self, parent_key: int, tokens: Sequence[int]) -> int:
        """Key of a block: its parent's key followed by its own token ids."""
        return self._fn(parent_key.to_bytes(8, "little") + array("q", tokens).tobytes(), self.seed)  # token_bytes, inlined
