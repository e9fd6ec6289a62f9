"""Cascade attention equals plain attention over [prefix + private], to fp32 rounding."""
from __future__ import annotations

import pytest
import torch

from prefixcache.model.cascade import Shared, batched_cascade, cascade_attention


def reference(q, keys, values, scale):
    """Plain causal attention (bottom-right aligned) of q [Hq, r, D] over keys [Hkv, n, D], GQA by repeat."""
    g = q.shape[0] // keys.shape[0]
    k = keys.repeat_interleave(g, dim=0)
    v = values.repeat_interleave(g, dim=0)
    r, n = q.shape[1], k.shape[1]
    allowed = torch.arange(n).unsqueeze(0) <= (n - r + torch.arange(r)).unsqueeze(1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("t", [1, 5])
def test_batched_cascade_matches_concatenated(hq, hkv, t):
    torch.manual_seed(hq * 10 + t)
    d, p, b = 16, 37, 4
    pk, pv = torch.randn(1, hkv, p, d), torch.randn(1, hkv, p, d)
    lengths = [t, t + 3, t + 11, t + 1]  # ragged private lengths, each ends with the t query tokens
    private = [(torch.randn(hkv, m, d), torch.randn(hkv, m, d)) for m in lengths]
    q = torch.randn(b, hq, t, d)
    out = batched_cascade(q, pk, pv, private, scale=d ** -0.5)
    for i, (k, v) in enumerate(private):
        ref = reference(q[i], torch.cat([pk[0], k], 1), torch.cat([pv[0], v], 1), d ** -0.5)
        torch.testing.assert_close(out[i], ref, rtol=1e-5, atol=1e-5)


def test_packed_ragged_queries_and_partial_membership():
    """Requests with different query counts; segments shared by some requests only; one with no prefix."""
    torch.manual_seed(7)
    hq, hkv, d = 6, 2, 8
    seg_a = Shared(torch.randn(hkv, 20, d), torch.randn(hkv, 20, d), (0, 1, 2))
    seg_b = Shared(torch.randn(hkv, 9, d), torch.randn(hkv, 9, d), (0, 2))
    seg_c = Shared(torch.randn(hkv, 4, d), torch.randn(hkv, 4, d), (1,))
    # Chains of stored runs: more segments with the same members, not next to their siblings.
    seg_b2 = Shared(torch.randn(hkv, 6, d), torch.randn(hkv, 6, d), (0, 2))
    seg_c2 = Shared(torch.randn(hkv, 11, d), torch.randn(hkv, 11, d), (1,))
    segments = [seg_a, seg_b, seg_c, seg_b2, seg_c2]
    queries = [3, 1, 7, 2]  # request 3 has no shared prefix
    spans, pos = [], 0
    for r in queries:
        spans.append((pos, pos + r))
        pos += r
    private = [(torch.randn(hkv, r + extra, d), torch.randn(hkv, r + extra, d)) for r, extra in zip(queries, (0, 5, 2, 9))]
    q = torch.randn(hq, pos, d)
    out = cascade_attention(q, spans, segments, private, scale=0.25)
    for i, ((s, e), (k, v)) in enumerate(zip(spans, private)):
        segs = [sg for sg in segments if i in sg.members]
        keys = torch.cat([*(sg.keys for sg in segs), k], 1)
        values = torch.cat([*(sg.values for sg in segs), v], 1)
        torch.testing.assert_close(out[:, s:e], reference(q[:, s:e], keys, values, 0.25), rtol=1e-5, atol=1e-5)


def test_shared_segments_are_not_written():
    torch.manual_seed(3)
    k, v = torch.randn(2, 10, 8), torch.randn(2, 10, 8)
    before = (k.clone(), v.clone())
    cascade_attention(torch.randn(4, 3, 8), [(0, 1), (1, 3)], [Shared(k, v, (0, 1))],
                      [(torch.randn(2, 1, 8), torch.randn(2, 1, 8)), (torch.randn(2, 4, 8), torch.randn(2, 4, 8))], 0.3)
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])


@pytest.mark.parametrize("slots", [(0, 1, 2, 3), (3, 0, 2), (1,)])
def test_private_batch_of_single_token_queries_matches_plain_attention(slots):
    """Decode rows read their private KV as slots of one padded tensor (some slots idle, stale
    data past each length) and mix with a prefix and with a per-request private row."""
    from prefixcache.model.cascade import PrivateBatch

    torch.manual_seed(len(slots))
    hq, hkv, d, cap = 6, 2, 8, 16
    keys, values = torch.randn(4, hkv, cap, d) * 50, torch.randn(4, hkv, cap, d)  # stale junk beyond lengths
    lengths = (5, 16, 1, 9)[: len(slots)]
    prefix = Shared(torch.randn(hkv, 12, d), torch.randn(hkv, 12, d), tuple(range(len(slots) + 1)))
    spans = [(i, i + 1) for i in range(len(slots))] + [(len(slots), len(slots) + 3)]  # last: a 3-token prefill
    own = (torch.randn(hkv, 7, d), torch.randn(hkv, 7, d))
    q = torch.randn(hq, len(slots) + 3, d)
    batch = PrivateBatch.build(keys[:, :, : max(lengths)], values[:, :, : max(lengths)], range(len(slots)),
                               slots, lengths)
    out = cascade_attention(q, spans, [prefix], [None] * len(slots) + [own], 0.3, [batch])
    for i, (slot, n) in enumerate(zip(slots, lengths)):
        ref = reference(q[:, i : i + 1], torch.cat([prefix.keys, keys[slot, :, :n]], 1),
                        torch.cat([prefix.values, values[slot, :, :n]], 1), 0.3)
        torch.testing.assert_close(out[:, i : i + 1], ref, rtol=1e-5, atol=1e-5)
    s, e = spans[-1]
    ref = reference(q[:, s:e], torch.cat([prefix.keys, own[0]], 1), torch.cat([prefix.values, own[1]], 1), 0.3)
    torch.testing.assert_close(out[:, s:e], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_only_step_reads_every_row_from_one_batch(dtype, tol):
    """A step of decodes only (every packed row in one batch, in order): the batch output is
    used as is, then folded with a prefix shared by all and one shared by a subset."""
    from prefixcache.model.cascade import PrivateBatch

    torch.manual_seed(11)
    hq, hkv, d, n = 6, 2, 8, 4
    keys, values = torch.randn(n, hkv, 10, d, dtype=dtype), torch.randn(n, hkv, 10, d, dtype=dtype)
    lengths = (3, 10, 1, 6)
    common = Shared(torch.randn(hkv, 12, d, dtype=dtype), torch.randn(hkv, 12, d, dtype=dtype), (0, 1, 2, 3))
    some = Shared(torch.randn(hkv, 5, d, dtype=dtype), torch.randn(hkv, 5, d, dtype=dtype), (1, 3))
    q = torch.randn(hq, n, d, dtype=dtype)
    batch = PrivateBatch.build(keys, values, range(n), range(n), lengths)
    assert batch.in_order and batch.slots is None
    out = cascade_attention(q, [(i, i + 1) for i in range(n)], [common, some], [None] * n, 0.3, [batch])
    assert out.dtype == dtype
    for i, m in enumerate(lengths):
        segs = [sg for sg in (common, some) if i in sg.members]
        ks = torch.cat([*(sg.keys for sg in segs), keys[i, :, :m]], 1).float()
        vs = torch.cat([*(sg.values for sg in segs), values[i, :, :m]], 1).float()
        ref = reference(q[:, i : i + 1].float(), ks, vs, 0.3)
        torch.testing.assert_close(out[:, i : i + 1].float(), ref, rtol=tol, atol=tol)


def test_merge_two_equals_softmax_over_the_union():
    from prefixcache.model.cascade import attend, merge_two

    torch.manual_seed(5)
    q = torch.randn(1, 2, 3, 8)
    ka, va, kb, vb = torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    oa, la = attend(q, ka, va, 0.5)
    ob, lb = attend(q, kb, vb, 0.5)
    whole, lw = attend(q, torch.cat([ka, kb], 2), torch.cat([va, vb], 2), 0.5)
    torch.testing.assert_close(merge_two(oa, la, ob, lb), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.logaddexp(la, lb), lw, rtol=1e-5, atol=1e-5)
    absent = torch.full_like(la, float("-inf"))  # part a on no row: part b unchanged, never NaN
    torch.testing.assert_close(merge_two(torch.zeros_like(oa), absent, ob, lb), ob)
