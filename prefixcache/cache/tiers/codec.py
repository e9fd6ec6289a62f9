"""Lower-tier block format and keys: keyed hashes, a verified header, raw KV bytes.

A block's key chains its parent's key with its own token ids under a secret
(``blake2b`` keyed mode), starting from a root that hashes the namespace (tenant, model
identity and revision, dtype, template) and the KV layout. Keys therefore reveal nothing
about prompt content or tenant names, and another secret, namespace, dtype or layout
never produces the same key.

A stored block (``encode``) is::

    MAGIC | u32 header length | header (JSON) | KV bytes | xxh3-128 of everything before

The header names the block's key, its parent's key, a keyed digest of the namespace, the
token ids, dtype and shape of the KV, and its absolute expiry (wall-clock seconds, or
null). ``decode`` checks every one of them against what the reader expects: a
truncated, flipped or swapped block, or one of another model, dtype, layout or
namespace, is refused (``CorruptBlock``), never returned. No pickle: tensors travel as
raw bytes with dtype and shape in the header.
"""
from __future__ import annotations

import hashlib
import json
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from prefixcache.cache.hashing import encode_namespace, token_bytes

MAGIC = b"PCKVBLK1"
KEY_BYTES = 16
_LEN = struct.Struct("<I")
_DIGEST = 16
#: dtype names a header may carry (the tensors a causal LM keeps as KV).
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


class CorruptBlock(ValueError):
    """A stored block that does not match what the reader expects (the reason is the message)."""


class BlockKeys:
    """Chained keyed block hashes for one process's model and layout.

    ``layout`` names the KV layout (e.g. ``"L30xH3xD64"``) and the block size: blocks of
    another layout live under other keys.
    """

    __slots__ = ("_secret", "_layout")

    def __init__(self, secret: bytes, layout: str):
        if not secret:
            raise ValueError("the tier hash secret must not be empty")
        self._secret = hashlib.blake2b(secret, digest_size=32).digest()  # any length in, a valid blake2b key out
        self._layout = layout

    def _hash(self, data: bytes) -> bytes:
        return hashlib.blake2b(data, key=self._secret, digest_size=KEY_BYTES).digest()

    def root(self, namespace: Sequence[str]) -> bytes:
        return self._hash(b"root" + encode_namespace([*namespace, self._layout]))

    def namespace_tag(self, namespace: Sequence[str]) -> str:
        """Keyed digest of the namespace and layout, carried in every header (says nothing in the clear)."""
        return self._hash(b"tag" + encode_namespace([*namespace, self._layout])).hex()

    def chain(self, parent: bytes, tokens: Sequence[int]) -> bytes:
        return self._hash(parent + token_bytes(tokens))

    def blocks(self, namespace: Sequence[str], tokens: Sequence[int], block_size: int, n_blocks: int) -> list[bytes]:
        """Keys of the first ``n_blocks`` full blocks of ``tokens``, preceded by the root: ``n_blocks + 1`` keys."""
        keys = [self.root(namespace)]
        for i in range(n_blocks):
            keys.append(self.chain(keys[-1], tokens[i * block_size : (i + 1) * block_size]))
        return keys


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What a block header says besides its KV."""

    key: bytes
    parent: bytes
    namespace_tag: str
    tokens: tuple[int, ...]
    expires_at: float | None  # wall-clock seconds; None: no TTL


def encode(meta: BlockMeta, kv: torch.Tensor) -> bytes:
    """One block as bytes. ``kv``: ``[L, 2, H, n, D]`` (any device; copied to the CPU)."""
    kv = kv.detach().contiguous().cpu()
    header = json.dumps({
        "key": meta.key.hex(), "parent": meta.parent.hex(), "ns": meta.namespace_tag, "tokens": list(meta.tokens),
        "expires_at": meta.expires_at, "dtype": str(kv.dtype).removeprefix("torch."), "shape": list(kv.shape),
    }, separators=(",", ":")).encode()
    body = b"".join((MAGIC, _LEN.pack(len(header)), header, kv.view(torch.uint8).reshape(-1).numpy().tobytes()))
    return body + xxhash.xxh3_128_digest(body)


def read_header(blob: bytes | bytearray | memoryview) -> dict:
    """The header of an encoded block, after checking its framing and checksum (``CorruptBlock`` if not)."""
    view = memoryview(blob)
    if len(view) < len(MAGIC) + _LEN.size + _DIGEST or bytes(view[: len(MAGIC)]) != MAGIC:
        raise CorruptBlock("not a block (bad magic or too short)")
    if xxhash.xxh3_128_digest(view[:-_DIGEST]) != bytes(view[-_DIGEST:]):
        raise CorruptBlock("checksum mismatch (truncated or altered)")
    (size,) = _LEN.unpack_from(view, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    try:
        header = json.loads(bytes(view[start : start + size]))
    except ValueError as exc:
        raise CorruptBlock(f"unreadable header: {exc}") from None
    header["_payload"] = start + size
    return header


def decode(blob: bytes | bytearray | memoryview, meta: BlockMeta, dtype: torch.dtype,
           shape: tuple[int, ...]) -> torch.Tensor:
    """The KV of ``blob`` if it is exactly the block ``meta`` describes, with ``dtype`` and ``shape``.

    The returned tensor views ``blob`` (read only: never written). Raises ``CorruptBlock``.
    """
    header = read_header(blob)
    expect = {"key": meta.key.hex(), "parent": meta.parent.hex(), "ns": meta.namespace_tag,
              "tokens": list(meta.tokens), "dtype": str(dtype).removeprefix("torch."), "shape": list(shape)}
    for field, want in expect.items():
        if header.get(field) != want:
            raise CorruptBlock(f"header field {field!r} does not match")
    start = header["_payload"]
    nbytes = len(blob) - _DIGEST - start
    if nbytes != torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size():
        raise CorruptBlock("payload size does not match its shape")
    with warnings.catch_warnings():  # a read-only buffer: the tensor is only ever read
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(blob, dtype=torch.uint8, count=nbytes, offset=start)
    return raw.view(dtype).reshape(shape)


def expires_at(header: dict) -> float | None:
    value = header.get("expires_at")
    return None if value is None else float(value)
