"""MKL-packed linear weights: same products as F.linear, installed per step, never stale."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from prefixcache.model.cpu.packed_linear import PackedLinears

pytestmark = pytest.mark.skipif(PackedLinears.build(torch.nn.Linear(4, 4), 4)[0] is None,
                                reason="this torch build has no MKL packed linear")


def layers(seed=0):
    torch.manual_seed(seed)
    return torch.nn.ModuleList([torch.nn.Linear(40, 24), torch.nn.Linear(24, 56, bias=False),
                                torch.nn.Linear(56, 40)]).eval()


def run(mods, x):
    for m in mods:
        x = m(x)
    return x


def reference(mods, x):
    for m in mods:
        x = F.linear(x, m.weight, m.bias)
    return x


@pytest.mark.parametrize("shape", [(1, 40), (3, 40), (4, 40), (5, 40), (8, 40), (9, 40), (3, 3, 40), (1, 6, 40), (2, 4, 40)])
def test_products_match_linear_for_every_row_count(shape):
    mods = layers()
    packed, reason = PackedLinears.build(mods, 8)
    assert reason is None
    x = torch.randn(*shape)
    rows = x.numel() // x.shape[-1]
    with torch.no_grad(), packed.installed():
        got = run(mods, x)
    assert got.shape == (*shape[:-1], 40)
    torch.testing.assert_close(got, reference(mods, x), rtol=1e-5, atol=1e-5)
    assert packed.calls == (3 if 4 <= rows <= 8 else 0)  # under half of 8 rows, or over 8: F.linear


def test_installed_only_inside_the_block_and_wrappers_left_alone():
    mods = layers()
    def wrapper(x):
        return torch.zeros(*x.shape[:-1], 56)
    mods[1].forward = wrapper  # a user's / library's instance-level forward
    packed, _ = PackedLinears.build(mods, 8)
    x = torch.randn(4, 40)
    with torch.no_grad():
        with packed.installed():
            assert "forward" in mods[0].__dict__ and mods[1].__dict__["forward"] is wrapper
            out = run(mods, x)
        assert "forward" not in mods[0].__dict__ and "forward" not in mods[2].__dict__
        assert mods[1].__dict__["forward"] is wrapper
        torch.testing.assert_close(out, run(mods, x))
    assert packed.calls == 2  # the wrapped module was not served


def test_weights_changed_in_place_or_replaced_are_packed_again():
    mods = layers()
    packed, _ = PackedLinears.build(mods, 8)
    x = torch.randn(4, 40)
    with torch.no_grad():
        with packed.installed():
            before = run(mods, x)
        mods[0].weight.mul_(2)  # in place: the version counter moves
        mods[2].weight = torch.nn.Parameter(torch.randn(40, 56))  # replaced
        mods[2].bias.add_(1)
        with packed.installed():
            after = run(mods, x)
    assert packed.packs == 3 + 2
    torch.testing.assert_close(after, reference(mods, x), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(after, before)
    with torch.inference_mode():
        mods[0].weight = torch.nn.Parameter(torch.randn(24, 40), requires_grad=False)  # no version counter
    with torch.no_grad(), packed.installed():
        assert "forward" not in mods[0].__dict__  # served by its own forward, not by a stale pack
        torch.testing.assert_close(run(mods, x), reference(mods, x), rtol=1e-5, atol=1e-5)


def test_other_threads_and_autograd_use_the_modules_own_forward():
    mods = layers()
    packed, _ = PackedLinears.build(mods, 8)
    x = torch.randn(4, 40)
    seen = {}
    def other():
        with torch.no_grad():  # grad mode is per thread
            seen["out"] = run(mods, x)
    with packed.installed():
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert packed.calls == 0
        torch.testing.assert_close(seen["out"], reference(mods, x), rtol=0, atol=0)
        y = run(mods, x.requires_grad_())  # grad enabled: own forward, gradients flow
        y.sum().backward()
    assert packed.calls == 0 and x.grad is not None


def test_build_says_why_it_cannot_serve():
    assert "bfloat16" in PackedLinears.build(layers().to(torch.bfloat16), 8)[1]
    assert "no torch.nn.Linear" in PackedLinears.build(torch.nn.Sequential(torch.nn.ReLU()), 8)[1]
    assert "1 row" in PackedLinears.build(layers(), 1)[1]
    with torch.inference_mode():
        made_in_inference_mode = torch.nn.Linear(4, 4)
    assert "version counter" in PackedLinears.build(made_in_inference_mode, 4)[1]
    weights = sum(m.weight.nbytes for m in layers())
    assert "more than" in PackedLinears.build(layers(), 8, max_bytes=weights - 1)[1]
    assert PackedLinears.build(layers(), 8, max_bytes=weights)[0] is not None
