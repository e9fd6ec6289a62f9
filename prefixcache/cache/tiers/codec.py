"""Lower-tier block format and keys: keyed hashes, a MAC over every block, optional encryption.

A block's key chains its parent's key with its own token ids under a secret
(``blake2b`` keyed mode), starting from a root that hashes the namespace (tenant, model
identity and revision, dtype, template) and the KV layout. Keys therefore reveal nothing
about prompt content or tenant names, and another secret, namespace, dtype or layout
never produces the same key.

A stored block (``BlockCodec.encode``) is::

    PREFIX: MAGIC | flags u8 | expires_at f64 (NaN: none) | u32 body length
    body:   u32 header length | header (JSON object) | KV bytes             (flags 0)
            salt (16) | nonce (12) | AES-256-GCM(the plain body above)       (flags 1: encrypted)
    MAC:    BLAKE2b-256 keyed from the secret, over the block's key, PREFIX and body

The MAC is checked in constant time before anything past the size is parsed: a block
altered by anyone without the secret, moved under another key, or written under another
secret is refused. Encryption uses a key derived from the secret and the block's random
salt, with the block key and PREFIX as associated data, so a stored value holds neither
token ids nor KV in the clear. The expiry stays in the clear (the disk tier indexes it at
start-up without reading whole blocks); the MAC covers it. The header names the block's
key, its parent's key, a keyed digest of the namespace, the token ids, dtype and shape:
``decode`` checks each against what the reader expects, so every failure is
``CorruptBlock``, never a wrong tensor. No pickle: tensors travel as raw bytes.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
import secrets
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prefixcache.cache.hashing import encode_namespace, token_bytes

MAGIC = b"PCKVBLK2"
KEY_BYTES = 16
#: Shortest hash secret accepted (bytes): shorter ones can be guessed offline from any stored block.
MIN_SECRET_BYTES = 32
#: Largest header a block may carry (a block of 4,096 token ids of 10 digits fits).
MAX_HEADER_BYTES = 64 << 10
MAC_BYTES = 32
ENCRYPTED = 0x01
PREFIX = struct.Struct("<8sBdI")
_LEN = struct.Struct("<I")
_SALT, _NONCE, _TAG = 16, 12, 16
#: dtype names a header may carry (the tensors a causal LM keeps as KV).
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}
#: Header fields and their JSON types (lists hold integers only).
_FIELDS = {"key": str, "parent": str, "ns": str, "tokens": list, "dtype": str, "shape": list}


class CorruptBlock(ValueError):
    """A stored block that does not match what the reader expects (the reason is the message)."""


class BlockKeys:
    """Chained keyed block hashes for one process's model and layout, and the keys derived from the secret.

    ``layout`` names the KV layout (e.g. ``"L30xH3xD64"``) and the block size: blocks of
    another layout live under other keys.
    """

    __slots__ = ("_secret", "_layout")

    def __init__(self, secret: bytes, layout: str):
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the tier hash secret must be at least {MIN_SECRET_BYTES} bytes")
        self._secret = hashlib.blake2b(secret, digest_size=32).digest()  # any length in, a valid blake2b key out
        self._layout = layout

    def _hash(self, data: bytes) -> bytes:
        return hashlib.blake2b(data, key=self._secret, digest_size=KEY_BYTES).digest()

    def derive(self, purpose: bytes) -> bytes:
        """A 32-byte key for ``purpose`` (MAC, encryption), independent of the key hashes and of each other."""
        return hashlib.blake2b(purpose, key=self._secret, digest_size=32, person=b"prefixcache.key").digest()

    def root(self, namespace: Sequence[str]) -> bytes:
        return self._hash(b"root" + encode_namespace([*namespace, self._layout]))

    def namespace_tag(self, namespace: Sequence[str]) -> str:
        """Keyed digest of the namespace and layout, carried in every header (says nothing in the clear)."""
        return self._hash(b"tag" + encode_namespace([*namespace, self._layout])).hex()

    def tenant_tag(self, tenant: str) -> str:
        """Keyed digest of a tenant: what tiers group blocks by so a tenant's can be purged (names no tenant)."""
        return self._hash(b"tenant" + encode_namespace([tenant])).hex()

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
    """What a block header says besides its KV, and the tenant tag tiers group it by."""

    key: bytes
    parent: bytes
    namespace_tag: str
    tokens: tuple[int, ...]
    expires_at: float | None  # wall-clock seconds; None: no TTL
    tenant: str = ""  # ``BlockKeys.tenant_tag`` (a reader knows it from the request's tenant, as the writer did)


@dataclass(frozen=True, slots=True)
class Prefix:
    """The clear, fixed-size start of a block (read before the rest; trusted only once the MAC holds)."""

    flags: int
    expires_at: float | None
    body_bytes: int

    @property
    def total_bytes(self) -> int:
        return PREFIX.size + self.body_bytes + MAC_BYTES


def read_prefix(head: bytes | bytearray | memoryview) -> Prefix:
    """The framing of a block from its first ``PREFIX.size`` bytes (``CorruptBlock`` if it is not one)."""
    if len(head) < PREFIX.size:
        raise CorruptBlock("not a block (too short)")
    magic, flags, expires, body = PREFIX.unpack_from(head)
    if magic != MAGIC:
        raise CorruptBlock("not a block (bad magic)")
    if flags & ~ENCRYPTED or math.isinf(expires):
        raise CorruptBlock("unknown flags or expiry")
    return Prefix(flags, None if math.isnan(expires) else expires, body)


class BlockCodec:
    """Seals and opens the blocks of one chain: a ``dtype`` KV of ``shape``, under keys derived from the secret.

    ``encrypt`` makes ``encode`` encrypt header and KV; ``decode`` opens both kinds (the MAC
    holds either way), so turning encryption on or off needs no migration.
    """

    def __init__(self, keys: BlockKeys, dtype: torch.dtype, shape: tuple[int, ...], *, encrypt: bool = False):
        self.dtype, self.shape, self.encrypt = dtype, tuple(shape), encrypt
        self._mac_key = keys.derive(b"mac")
        self._enc_key = keys.derive(b"encrypt")
        self.payload_bytes = torch.Size(self.shape).numel() * torch.empty((), dtype=dtype).element_size()
        #: The largest value a block of this chain can be: anything larger is refused before it is read.
        self.max_bytes = PREFIX.size + _SALT + _NONCE + _TAG + _LEN.size + MAX_HEADER_BYTES + self.payload_bytes \
            + MAC_BYTES
        if encrypt:
            _aead(bytes(32))  # fail at start-up, not at the first write, without the ``cryptography`` package

    def encode(self, meta: BlockMeta, kv: torch.Tensor) -> bytes:
        """One block as bytes. ``kv``: ``[L, 2, H, n, D]`` (any device; copied to the CPU)."""
        kv = kv.detach().contiguous().cpu()
        header = json.dumps({
            "key": meta.key.hex(), "parent": meta.parent.hex(), "ns": meta.namespace_tag, "tokens": list(meta.tokens),
            "dtype": str(kv.dtype).removeprefix("torch."), "shape": list(kv.shape),
        }, separators=(",", ":")).encode()
        if len(header) > MAX_HEADER_BYTES:
            raise ValueError(f"a block header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
        plain = b"".join((_LEN.pack(len(header)), header, kv.view(torch.uint8).reshape(-1).numpy().tobytes()))
        return self.seal(meta.key, plain, meta.expires_at)

    def seal(self, key: bytes, plain: bytes, expires_at: float | None) -> bytes:
        """A block of key ``key`` around ``plain`` (header length, header, KV), encrypted if so configured, MACed.

        ``encode`` is the one writer; tests call this to seal a malformed body with the right secret.
        """
        expires = math.nan if expires_at is None else float(expires_at)
        if self.encrypt:
            prefix = PREFIX.pack(MAGIC, ENCRYPTED, expires, _SALT + _NONCE + len(plain) + _TAG)
            salt, nonce = secrets.token_bytes(_SALT), secrets.token_bytes(_NONCE)
            body = salt + nonce + _aead(self._block_key(salt)).encrypt(nonce, plain, key + prefix)
        else:
            prefix, body = PREFIX.pack(MAGIC, 0, expires, len(plain)), plain
        return prefix + body + self._mac(key, (prefix, body))

    def decode(self, blob: bytes | bytearray | memoryview, meta: BlockMeta) -> torch.Tensor:
        """The KV of ``blob`` if it is exactly the block ``meta`` describes, sealed under this secret.

        The returned tensor may view ``blob`` (read only: never written). Raises ``CorruptBlock``.
        """
        view = memoryview(blob)
        if not PREFIX.size + MAC_BYTES <= len(view) <= self.max_bytes:
            raise CorruptBlock(f"{len(view)} bytes: not the size of a block of this layout")
        if not hmac.compare_digest(self._mac(meta.key, (view[:-MAC_BYTES],)), bytes(view[-MAC_BYTES:])):
            raise CorruptBlock("MAC mismatch (altered, moved, or written under another secret)")
        prefix = read_prefix(view)
        if prefix.total_bytes != len(view):
            raise CorruptBlock("body length does not match the block's size")
        body, base = view[PREFIX.size : -MAC_BYTES], PREFIX.size
        if prefix.flags & ENCRYPTED:
            body, base = memoryview(self._open(meta.key, bytes(view[: PREFIX.size]), body)), 0
        header, start = parse_header(body)
        expect = {"key": meta.key.hex(), "parent": meta.parent.hex(), "ns": meta.namespace_tag,
                  "tokens": list(meta.tokens), "dtype": str(self.dtype).removeprefix("torch."),
                  "shape": list(self.shape)}
        for field, want in expect.items():
            if header[field] != want:
                raise CorruptBlock(f"header field {field!r} does not match")
        if len(body) - start != self.payload_bytes:
            raise CorruptBlock("payload size does not match its shape")
        with warnings.catch_warnings():  # a read-only buffer: the tensor is only ever read
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(body.obj if base == 0 else blob, dtype=torch.uint8, count=self.payload_bytes,
                                   offset=base + start)
        return raw.view(self.dtype).reshape(self.shape)

    def _mac(self, key: bytes, parts: Sequence[bytes | memoryview]) -> bytes:
        mac = hashlib.blake2b(key, key=self._mac_key, digest_size=MAC_BYTES)
        for part in parts:
            mac.update(part)
        return mac.digest()

    def _block_key(self, salt: bytes) -> bytes:
        return hashlib.blake2b(salt, key=self._enc_key, digest_size=32).digest()  # one key per block: no nonce reuse

    def _open(self, key: bytes, prefix: bytes, body: memoryview) -> bytes:
        if len(body) < _SALT + _NONCE + _TAG:
            raise CorruptBlock("encrypted body too short")
        salt, nonce = bytes(body[:_SALT]), bytes(body[_SALT : _SALT + _NONCE])
        try:
            return _aead(self._block_key(salt)).decrypt(nonce, body[_SALT + _NONCE :], key + prefix)
        except Exception as exc:  # InvalidTag, or a malformed ciphertext
            raise CorruptBlock(f"decryption failed ({type(exc).__name__})") from None


def parse_header(body: memoryview) -> tuple[dict, int]:
    """The header at the start of a plain body and where the KV starts; ``CorruptBlock`` unless it is a
    bounded JSON object of exactly the expected fields, each of its type (lists: integers only)."""
    if len(body) < _LEN.size:
        raise CorruptBlock("body too short for a header")
    (size,) = _LEN.unpack_from(body)
    if size > MAX_HEADER_BYTES or _LEN.size + size > len(body):
        raise CorruptBlock(f"header length {size} out of bounds")
    try:
        header = json.loads(bytes(body[_LEN.size : _LEN.size + size]))
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the parser's stack
        raise CorruptBlock(f"unreadable header: {type(exc).__name__}") from None
    if not isinstance(header, dict):
        raise CorruptBlock("header is not a JSON object")
    if set(header) != set(_FIELDS):
        raise CorruptBlock("header fields are not the expected ones")
    for field, kind in _FIELDS.items():
        value = header[field]
        if not isinstance(value, kind) or (kind is list and not all(type(v) is int for v in value)):
            raise CorruptBlock(f"header field {field!r} has the wrong type")
    return header, _LEN.size + size


def _aead(key: bytes):
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as exc:  # a dependency; only encryption needs it
        raise RuntimeError("tier_encrypt needs the `cryptography` package (pip install cryptography)") from exc
    return AESGCM(key)
