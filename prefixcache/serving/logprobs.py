"""Log-probabilities of generated tokens, as OpenAI's ``logprobs``/``top_logprobs`` report them.

The distribution is the model's own: ``log_softmax`` of the raw logits of the step that chose the
token, before temperature, penalties, logit bias, top-k/top-p and a response format's grammar mask
(vLLM's default, ``raw_logprobs``), so a sampled token may be one the model itself found unlikely,
and the figures do not depend on how the token was chosen. Only requests that ask pay: per asking
row of a step, one float32 ``log_softmax`` over the vocabulary and a ``topk`` on the logits' device
(on a 49,152-token vocabulary about 200 KB of float32 read and written per row), and ``1 + 2 * top``
numbers copied to the host. The batching engine copies them with the step's greedy tokens when every
asking row is greedy, so the step synchronises no more often than without them; a sampled asking row
adds one copy to its step, shared by the step's asking rows. Rows that do not ask compute nothing more.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: The most alternatives a token may report (OpenAI's limit for ``top_logprobs``).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log-probability, and the ``top`` likeliest tokens of its step as
    (token id, log-probability), likeliest first, equally likely ones by id (as many as the call asked; the
    chosen token is among them only if it is that likely)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], tops: Sequence[int]) -> list[TokenLogprob]:
    """logits: [R, V] raw logits of R rows (any float dtype, any device); tokens: [R] the token each row
    chose; tops: [R] alternatives each row wants (0..``MAX_TOP_LOGPROBS``). One copy to the host."""
    chosen = torch.tensor(list(tokens), dtype=torch.long, device=logits.device)
    k = top_width(logits, tops)
    return unpack(pack(logits, chosen, k).cpu().tolist(), tokens, tops, k)


def top_width(logits: torch.Tensor, tops: Sequence[int]) -> int:
    """The alternatives ``pack`` computes for every row: the most any row wants (at most the vocabulary)."""
    return min(max(tops, default=0), logits.shape[-1])


def pack(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """logits: [R, V]; tokens: [R] on their device. [R, 1 + 2k] float64 there: each row's chosen token's
    log-probability, then its ``k`` likeliest tokens' log-probabilities and ids (ids < 2**53: exact)."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    parts = [lp.gather(1, tokens[:, None]).double()]
    if k:
        values, index = torch.topk(lp, k, dim=1)  # [R, k], likeliest first
        if k > 1:  # equally likely tokens by id, as argmax (greedy) picks the first maximum: it heads the list
            index, order = index.sort(dim=1)
            values, order = values.gather(1, order).sort(dim=1, descending=True, stable=True)
            index = index.gather(1, order)
        parts += [values.double(), index.double()]
    return torch.cat(parts, dim=1)


def unpack(host: Sequence[Sequence[float]], tokens: Sequence[int], tops: Sequence[int], k: int) -> list[TokenLogprob]:
    """``pack``'s rows, copied to the host, as each row's ``TokenLogprob`` with its own ``tops`` alternatives."""
    out = []
    for row, token, want in zip(host, tokens, tops, strict=True):
        top = tuple((int(row[1 + k + j]), row[1 + j]) for j in range(min(want, k)))
        out.append(TokenLogprob(int(token), row[0], top))
    return out


class RawLogits:
    """While entered, keeps the last position's logits of every forward of ``model`` run on the entering
    thread (``last``: [V]; ``generate()``'s raw scores of the step), through a forward hook: the serial
    engine's logits processors see scores already changed by ``generate()``'s own processors."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.last = model, None
        self._thread = threading.get_ident()
        self._handle: Any = None

    def _hook(self, _module: torch.nn.Module, _args: Any, output: Any) -> None:
        if threading.get_ident() == self._thread:  # the batching engine's steps run the same model elsewhere
            self.last = output.logits[0, -1]

    def __enter__(self) -> RawLogits:
        self._thread = threading.get_ident()
        self._handle = self.model.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()
