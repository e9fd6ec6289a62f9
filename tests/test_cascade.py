"""Cascade attention equals plain attention over [prefix + private], to fp32 rounding."""
from __future__ import annotations

import pytest
import torch

from prefixcache.cascade import Shared, batched_cascade, cascade_attention


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
    queries = [3, 1, 7, 2]  # request 3 has no shared prefix
    spans, pos = [], 0
    for r in queries:
        spans.append((pos, pos + r))
        pos += r
    private = [(torch.randn(hkv, r + extra, d), torch.randn(hkv, r + extra, d)) for r, extra in zip(queries, (0, 5, 2, 9))]
    q = torch.randn(hq, pos, d)
    out = cascade_attention(q, spans, [seg_a, seg_b, seg_c], private, scale=0.25)
    for i, ((s, e), (k, v)) in enumerate(zip(spans, private)):
        segs = [sg for sg in (seg_a, seg_b, seg_c) if i in sg.members]
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
