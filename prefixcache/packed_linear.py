"""Linear layers computed from MKL-packed weights during a batched step (CPU, fp32).

Why: for a few rows, torch's fp32 ``linear`` on CPU calls MKL's sgemm, which repacks the
whole weight matrix on every call; a decode step of 8 requests spent ~2× the matmul time
of 1 request on the default model. MKL can pack a weight once for a given row count and
reuse it (``torch.ops.mkl._mkl_reorder_linear_weight`` / ``_mkl_linear``, the ops
``torch.compile`` uses for frozen CPU models). Figures: docs/benchmarks.md.

How it is used: weights are packed for exactly ``rows`` rows (the engine's batch size).
A call with ``rows/2``..``rows`` rows is padded to ``rows`` (each output row depends on
its own input row only) and computed from the packed weight; for 4 to 16 rows the result
was bitwise what ``F.linear`` gives on this machine (tests check closeness, not bits).
Fewer rows (padding would cost more than it saves: 2 rows padded to 16 took 47 ms for
the model's layers against 27 ms unpadded), more rows, autograd, other dtypes or devices
and other threads run the module's own forward.

What it costs: one packed copy of each packed weight (resident bytes ≈ the weight's:
538 MB for the default model in fp32, which shares its LM head with the embeddings),
made when the engine starts (~0.3 s there).

How it stays right:
- ``installed()`` puts a forward on each packed ``nn.Linear`` instance for one step and
  takes it away afterwards; a module that already has an instance-level ``forward``
  (a user's or a library's wrapper) is left alone.
- Before installing, each weight (and bias) is checked by identity and by its version
  counter; one replaced or edited in place is packed again, so a stale product is never
  served.
- Only where the ops exist and agree with ``F.linear`` on a probe (``PackedLinears.build``
  returns the reason otherwise).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _ops():
    """The MKL packing ops, or None where this torch build lacks them."""
    mkl = getattr(torch.ops, "mkl", None)
    try:
        return mkl._mkl_reorder_linear_weight, mkl._mkl_linear
    except (AttributeError, RuntimeError):
        return None


@dataclass(slots=True)
class _Entry:
    module: torch.nn.Linear
    forward: Callable[[torch.Tensor], torch.Tensor] | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    packed: torch.Tensor | None = None
    versions: tuple[int, int] = (-1, -1)


class PackedLinears:
    """Packed copies of a model's ``nn.Linear`` weights, installed step by step."""

    def __init__(self, modules: list[torch.nn.Linear], rows: int, ops):
        self.rows = rows
        self._reorder, self._linear = ops
        self._entries = [_Entry(m) for m in modules]
        self._pads: dict[int, torch.Tensor] = {}  # in_features -> [rows, in_features] input buffer
        self._owner: int | None = None  # thread running the installed step
        self.calls = 0  # linear calls served from packed weights
        self.packs = 0  # weights packed (initially and after a change)

    @classmethod
    def build(cls, model: torch.nn.Module, rows: int,
              max_bytes: int | None = None) -> tuple[PackedLinears | None, str | None]:
        """Packed linears for ``model``, or (None, reason) where they cannot serve it.

        ``max_bytes`` bounds the weights packed (the copy costs about as much again).
        """
        ops = _ops()
        if ops is None:
            return None, "this torch build has no MKL packed-linear ops"
        modules = [m for m in model.modules() if type(m) is torch.nn.Linear]
        if not modules:
            return None, "the model has no torch.nn.Linear layers"
        weight = modules[0].weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return None, f"packed weights serve fp32 on CPU, not {weight.dtype} on {weight.device.type}"
        if any(m.weight.device != weight.device or m.weight.dtype != weight.dtype for m in modules):
            return None, "the linear layers mix devices or dtypes"
        if any(t.is_inference() for m in modules for t in (m.weight, m.bias) if t is not None):
            return None, "inference-mode weights have no version counter, so a change could not be detected"
        reason = _probe(ops)
        if reason is not None:
            return None, reason
        if rows < 2:
            return None, f"packing for {rows} row(s) saves nothing"
        total = sum(m.weight.nbytes for m in modules)
        if max_bytes is not None and total > max_bytes:
            return None, f"the linear weights take {total} bytes, more than the {max_bytes} allowed for a packed copy"
        packed = cls(modules, rows, ops)
        for e in packed._entries:  # now, not in the first request's step
            packed._refresh(e)
        return packed, None

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights that have a packed copy (the copy's resident size is about the same)."""
        return sum(e.weight.nbytes for e in self._entries if e.packed is not None)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Serve the packed modules' rows/2..rows-row calls (this thread's) from packed weights inside the block."""
        mine = []
        self._owner = threading.get_ident()
        try:
            for e in self._entries:
                d = e.module.__dict__
                if "forward" in d:  # someone else's wrapper (or another engine's step): leave it
                    continue
                try:
                    self._refresh(e)
                except RuntimeError:  # e.g. a weight swapped for an inference tensor: no version to check
                    continue
                d["forward"] = e.forward
                mine.append(e)
            yield
        finally:
            self._owner = None
            for e in mine:
                if e.module.__dict__.get("forward") is e.forward:
                    del e.module.__dict__["forward"]

    def _refresh(self, e: _Entry) -> None:
        m = e.module
        w, b = m.weight, m.bias
        versions = (w._version, -1 if b is None else b._version)
        if w is e.weight and b is e.bias and versions == e.versions and e.packed is not None:
            return
        e.weight, e.bias, e.versions = w, b, versions
        e.packed = self._reorder(w.detach(), self.rows)
        e.forward = self._forward_for(e)
        self.packs += 1

    def _forward_for(self, e: _Entry) -> Callable[[torch.Tensor], torch.Tensor]:
        module, packed, weight, bias = e.module, e.packed, e.weight, e.bias
        own_forward = type(module).forward
        linear, rows_packed, out_features = self._linear, self.rows, weight.shape[0]
        fewest = max(2, (rows_packed + 1) // 2)

        def forward(x: torch.Tensor) -> torch.Tensor:
            shape = x.shape
            features = shape[-1]
            rows = x.numel() // features if features else 0
            if (rows < fewest or rows > rows_packed or torch.is_grad_enabled() or x.dtype != torch.float32
                    or x.device.type != "cpu" or threading.get_ident() != self._owner):
                return own_forward(module, x)
            self.calls += 1
            if rows == rows_packed:  # the op takes [..., features] and keeps the leading dims
                return linear(x, packed, weight, bias, rows_packed)
            pad = self._pads.get(features)
            if pad is None:
                with torch.inference_mode(False):  # a normal tensor: reused in and out of inference mode
                    pad = self._pads[features] = torch.zeros(rows_packed, features)
            pad[:rows].copy_(x.reshape(rows, features))
            y = linear(pad, packed, weight, bias, rows_packed)[:rows]  # exactly the packed row count
            return y.view(shape[:-1] + (out_features,))

        return forward


def _probe(ops) -> str | None:
    """None if packed products match ``F.linear`` on a small random case, else why not."""
    reorder, linear = ops
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=gen)
    b = torch.randn(48, generator=gen)
    x = torch.randn(5, 40, generator=gen)
    try:
        y = linear(x, reorder(w, 5), w, b, 5)
    except RuntimeError as exc:
        return f"MKL packed linear failed on a probe: {exc}"
    if not torch.allclose(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5):
        return "MKL packed linear disagrees with torch.nn.functional.linear on a probe"
    return None
