"""Linear layers computed from MKL-packed weights during a batched step (CPU, fp32).

Why: for a few rows, torch's fp32 ``linear`` on CPU calls MKL's sgemm, which repacks the
whole weight matrix on every call, so a decode step of several requests costs far more
matmul time than one request's. MKL can pack a weight once for a given row count and
reuse it (``torch.ops.mkl._mkl_reorder_linear_weight`` / ``_mkl_linear``, the ops
``torch.compile`` uses for frozen CPU models). Figures: docs/benchmarks.md.

How it is used: weights are packed for exactly ``rows`` rows (the engine's batch size).
A call with ``rows/2``..``rows`` rows is padded to ``rows`` (each output row depends on
its own input row only) and computed from the packed weight (tests check closeness to
``F.linear``, not bits). Fewer rows (padding them would cost more than it saves), more
rows, autograd, other dtypes or devices and other threads run the module's own forward.

What it costs: one packed copy of each packed weight (resident bytes ≈ the weight's),
made when the engine starts.

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
from collections.abc import Callable, Iterator, Sequence
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


class PackedWeight:
    """The weights of one or more ``nn.Linear`` reading the same input, packed as one product
    (their outputs side by side) for exactly ``rows`` rows.

    A group (e.g. a layer's q, k and v projections) costs one call instead of one per module.
    The packed copy is the only copy made: MKL's op also takes the unpacked weight, but reads it
    only when the row count differs from ``rows``, which ``__call__`` never lets happen (it pads).
    """

    def __init__(self, modules: Sequence[torch.nn.Linear], rows: int, ops, pads: dict[int, torch.Tensor]):
        self.modules = tuple(modules)
        self.rows = rows
        self._reorder, self._linear = ops
        self._pads = pads  # in_features -> [rows, in_features] input buffer, shared by a model's weights
        self._sources: list[tuple[torch.Tensor, torch.Tensor | None, int, int]] = []
        self.packed: torch.Tensor | None = None
        self._origin: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None
        self.packs = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the source weights (what ``weight_bytes`` figures count)."""
        return sum(m.weight.nbytes for m in self.modules)

    def refresh(self) -> None:
        """Pack again if a weight or bias was replaced or edited in place since the last packing.

        Raises RuntimeError for a weight without a version counter (an inference tensor): a
        change to it could not be seen, so it must not be served packed.
        """
        sources = [(m.weight, m.bias, m.weight._version, -1 if m.bias is None else m.bias._version)
                   for m in self.modules]
        if self.packed is not None and all(w is w0 and b is b0 and v == v0 and u == u0
                                           for (w, b, v, u), (w0, b0, v0, u0) in zip(sources, self._sources)):
            return
        weights = [m.weight.detach() for m in self.modules]
        if len(weights) == 1:
            weight, bias = weights[0], None if self.modules[0].bias is None else self.modules[0].bias.detach()
            self._origin = weight
        else:
            weight = torch.cat(weights)  # freed once packed
            biases = [m.bias.detach() if m.bias is not None else w.new_zeros(w.shape[0])
                      for m, w in zip(self.modules, weights)]
            bias = torch.cat(biases) if any(m.bias is not None for m in self.modules) else None
            # Right shape, no memory: only read for another row count, which __call__ never passes.
            self._origin = weight.new_zeros(()).expand(weight.shape)
        self.packed, self._bias = self._reorder(weight, self.rows), bias
        self._sources = sources
        self.packs += 1

    def serves(self, rows: int) -> bool:
        """Whether a call of ``rows`` rows is computed from the packed weight (rows/2..rows, at least 2)."""
        return max(2, (self.rows + 1) // 2) <= rows <= self.rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [n, in_features] with ``serves(n)`` → [n, sum of out_features]."""
        rows, features = x.shape
        if not self.serves(rows):
            raise ValueError(f"{rows} rows: packed for {self.rows}")
        if rows == self.rows:
            return self._linear(x, self.packed, self._origin, self._bias, self.rows)
        pad = self._pads.get(features)
        if pad is None:
            with torch.inference_mode(False):  # a normal tensor: reused in and out of inference mode
                pad = self._pads[features] = torch.zeros(self.rows, features, dtype=x.dtype)
        pad[:rows].copy_(x)
        return self._linear(pad, self.packed, self._origin, self._bias, self.rows)[:rows]


def packing_ops_reason(modules: Sequence[torch.nn.Linear], rows: int, max_bytes: int | None):
    """(ops, None) if ``modules`` can have packed weights for ``rows`` rows, else (None, why not)."""
    ops = _ops()
    if ops is None:
        return None, "this torch build has no MKL packed-linear ops"
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
    return ops, None


@dataclass(slots=True)
class _Entry:
    weight: PackedWeight
    forward: Callable[[torch.Tensor], torch.Tensor] | None = None
    packs: int = 0  # weight.packs when ``forward`` was made


class PackedLinears:
    """Packed copies of a model's ``nn.Linear`` weights, installed step by step."""

    def __init__(self, modules: list[torch.nn.Linear], rows: int, ops):
        self.rows = rows
        pads: dict[int, torch.Tensor] = {}
        self._entries = [_Entry(PackedWeight([m], rows, ops, pads)) for m in modules]
        self._owner: int | None = None  # thread running the installed step
        self.calls = 0  # linear calls served from packed weights

    @classmethod
    def build(cls, model: torch.nn.Module, rows: int,
              max_bytes: int | None = None) -> tuple[PackedLinears | None, str | None]:
        """Packed linears for ``model``, or (None, reason) where they cannot serve it.

        ``max_bytes`` bounds the weights packed (the copy costs about as much again).
        """
        modules = [m for m in model.modules() if type(m) is torch.nn.Linear]
        ops, reason = packing_ops_reason(modules, rows, max_bytes)
        if reason is not None:
            return None, reason
        packed = cls(modules, rows, ops)
        for e in packed._entries:  # now, not in the first request's step
            packed._refresh(e)
        return packed, None

    @property
    def packs(self) -> int:
        """Weights packed (initially and after a change)."""
        return sum(e.weight.packs for e in self._entries)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights that have a packed copy (the copy's resident size is about the same)."""
        return sum(e.weight.nbytes for e in self._entries if e.weight.packed is not None)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Serve the packed modules' rows/2..rows-row calls (this thread's) from packed weights inside the block."""
        mine = []
        self._owner = threading.get_ident()
        try:
            for e in self._entries:
                d = e.weight.modules[0].__dict__
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
                d = e.weight.modules[0].__dict__
                if d.get("forward") is e.forward:
                    del d["forward"]

    def _refresh(self, e: _Entry) -> None:
        e.weight.refresh()
        if e.forward is None or e.packs != e.weight.packs:
            e.forward, e.packs = self._forward_for(e.weight), e.weight.packs

    def _forward_for(self, packed: PackedWeight) -> Callable[[torch.Tensor], torch.Tensor]:
        module = packed.modules[0]
        own_forward = type(module).forward
        out_features = module.weight.shape[0]

        def forward(x: torch.Tensor) -> torch.Tensor:
            shape = x.shape
            features = shape[-1]
            rows = x.numel() // features if features else 0
            if (not packed.serves(rows) or torch.is_grad_enabled() or x.dtype != torch.float32
                    or x.device.type != "cpu" or threading.get_ident() != self._owner):
                return own_forward(module, x)
            self.calls += 1
            return packed(x.reshape(rows, features)).view(shape[:-1] + (out_features,))

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
