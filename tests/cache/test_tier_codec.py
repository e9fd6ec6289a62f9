"""Block keys and the block format: keyed, chained, and every alteration refused."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache.tiers.codec import BlockCodec, BlockKeys, BlockMeta, CorruptBlock

NS = ("tenant-a", "model", "rev", "torch.float32", "weights", "tpl")
TOKENS = st.lists(st.integers(0, 50_000), min_size=1, max_size=12)
SECRET = b"s" * 32


def meta(keys: BlockKeys, tokens, ns=NS) -> BlockMeta:
    chain = keys.blocks(ns, tokens, len(tokens), 1)
    return BlockMeta(chain[1], chain[0], keys.namespace_tag(ns), tuple(tokens), None)


@settings(max_examples=200, deadline=None)
@given(a=TOKENS, b=TOKENS, secret=st.binary(min_size=32, max_size=48))
def test_keys_are_keyed_chained_and_prefix_stable(a, b, secret):
    keys, other = BlockKeys(secret, "L1"), BlockKeys(secret + b"x", "L1")
    bs = 2
    n = min(len(a), len(b)) // bs
    ka, kb = keys.blocks(NS, a, bs, n), keys.blocks(NS, b, bs, n)
    for i in range(n + 1):  # equal keys exactly while the token prefixes are equal
        assert (ka[i] == kb[i]) == (a[: i * bs] == b[: i * bs])
    assert keys.blocks(NS, a, bs, n) == ka  # deterministic
    assert other.blocks(NS, a, bs, n)[0] != ka[0]  # another secret: another chain
    assert BlockKeys(secret, "L2").root(NS) != ka[0]  # another layout
    assert keys.root(("tenant-b", *NS[1:])) != ka[0]  # another tenant
    assert keys.root((*NS[:3], "torch.bfloat16", *NS[4:])) != ka[0]  # another dtype


def test_keys_reveal_neither_tokens_nor_tenant():
    keys = BlockKeys(SECRET, "L1")
    chain = keys.blocks(NS, [104, 105], 2, 1)
    blob = b"".join(chain) + keys.namespace_tag(NS).encode()
    assert b"tenant-a" not in blob and (104).to_bytes(8, "little") not in blob
    assert all(len(k) == 16 for k in chain)


def test_secrets_shorter_than_32_bytes_are_refused():
    with pytest.raises(ValueError, match="32 bytes"):
        BlockKeys(b"s" * 31, "L1")


@pytest.mark.parametrize("encrypt", [False, True])
def test_round_trip_and_checks(encrypt):
    keys = BlockKeys(SECRET, "L1")
    kv = torch.randn(2, 2, 3, 4, 5)
    shape = tuple(kv.shape)
    codec = BlockCodec(keys, torch.float32, shape, encrypt=encrypt)
    m = meta(keys, [1, 2, 3, 4])
    blob = codec.encode(m, kv)
    assert torch.equal(codec.decode(blob, m), kv)
    assert BlockCodec(keys, torch.float32, shape, encrypt=not encrypt).decode(blob, m).equal(kv)  # opens both kinds
    other_tokens = BlockMeta(m.key, m.parent, m.namespace_tag, (1, 2, 3, 5), None)
    with pytest.raises(CorruptBlock, match="tokens"):
        codec.decode(blob, other_tokens)
    other_tenant = BlockMeta(m.key, m.parent, keys.namespace_tag(("b", *NS[1:])), m.tokens, None)
    with pytest.raises(CorruptBlock, match="ns"):
        codec.decode(blob, other_tenant)
    with pytest.raises(CorruptBlock, match="dtype"):
        BlockCodec(keys, torch.float16, shape).decode(blob, m)
    with pytest.raises(CorruptBlock, match="shape"):
        BlockCodec(keys, torch.float32, (2, 2, 3, 4, 4)).decode(blob, m)
    with pytest.raises(CorruptBlock, match="MAC"):  # the key is in the MAC: a block moved under another key
        codec.decode(blob, meta(keys, [9, 9, 9, 9]))


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_flipped_byte_or_truncation_is_refused(data):
    keys = BlockKeys(SECRET, "L1")
    kv = torch.arange(24, dtype=torch.float32).reshape(1, 2, 1, 4, 3)
    codec = BlockCodec(keys, torch.float32, tuple(kv.shape), encrypt=data.draw(st.booleans()))
    m = meta(keys, [5, 6, 7, 8])
    blob = bytearray(codec.encode(m, kv))
    if data.draw(st.booleans()):
        at = data.draw(st.integers(0, len(blob) - 1))
        blob[at] ^= data.draw(st.integers(1, 255))
    else:
        blob = blob[: data.draw(st.integers(0, len(blob) - 1))]
    with pytest.raises(CorruptBlock):
        codec.decode(bytes(blob), m)
