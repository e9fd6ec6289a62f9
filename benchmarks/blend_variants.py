"""Ways to choose what a blend recomputes, side by side on a development set (never the held-out one).

Run: ``python -m benchmarks.blend_variants [--prompts 12] [--variants NAME ...] [--near-ties TAU ...]`` (embedded default model,
float32; about 25 s per variant and 12 prompts on 2 cores). The prompts are built like the ``rag``
workload's from the documents of its timed half that the timed workload does not use, so nothing here
touches the held-out fidelity set. Per variant: greedy 16-token answers equal to the full prefill's, how
many leading tokens agree on average, and the mean log-likelihood gap of the full prefill's answer.

Variants (every one re-rotates each document's KV, computed alone, to its place first):

- ``share=S`` / ``layer=L``: what ``Blender`` does, the share S of document tokens deviating most on layer L
  (layers up to L are then a full prefill's for every token);
- ``oracle``: the share deviating most summed over all layers, against a full prefill: the best any
  per-token choice of that size can do (it needs the full prefill it saves, so it only bounds the others);
- ``sink``: each document computed after a fixed head (the tokenizer's BOS, or the chat template's user
  header) instead of nothing, so its first token is not the attention sink; ``after the system prompt`` and
  ``as first seen``: after the prompt's system prompt, or after it and another document (the KV a store would
  keep from the prompt the document first came in);
- ``normalized``: the deviation of keys and of values each divided by its mean square on that layer and KV head
  (``oracle 15%, normalized``: the same summed over all layers against a full prefill, a bound);
- ``attention``: deviation weighted by the attention the question's last 48 tokens pay each token on layer L;
- ``exact=K``: layers 0..K recomputed for every token, no token recomputed above;
- ``lead``: each document's first tokens always among the share recomputed (where the document's
  computation alone put its attention sink and, in these prompts, its title), the rest by deviation;
- ``mean correction``: the tokens left reused shifted, per document, layer above L, KV and head, by a mean
  change (keys compared before their rotation): ``oracle`` the full prefill's change over the whole document
  (a bound on any such shift; it needs the full prefill), ``recomputed`` the change the recompute made to the
  document's recomputed tokens (biased: they were chosen for deviating most), ``recomputed, half`` that change
  halved, ``sample`` a third of the share spent on tokens evenly spread over the documents, their change the
  estimate;
- ``bound: layers 0-K reused``: the full prefill's KV everywhere but the documents' layers 0..K, which are
  as computed alone: how much reuse the answers tolerate even with every layer above exact (a bound on
  any scheme that reuses those layers; it needs the full prefill it would save).

``--near-ties TAU ...`` measures a safety net instead: answer from what ``Blender`` builds (15 %), and at
the first step whose top-1 − top-2 logit margin is under TAU switch to the exact KV (the prompt and the
answer so far prefilled) for the rest: how many answers then equal the full prefill's, and how many
prompts needed the switch (each switch costs the full prefill the blend saved).
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from prefixcache.bench.rag import RagPrompt, RagSpec, _generate, _leading, _loglik, documents, prompts
from prefixcache.config import CacheConfig
from prefixcache.loading import load_default_model
from prefixcache.model.blend import kv_deviation, recompute_count, rerotate, rotate_half
from prefixcache.model.hf_cache import BlendCache, WorkingCache, blend_forward, compute_alone
from prefixcache.sdk import PrefixCache

QUESTION_ROWS = 48  # the ``attention`` variant's question rows


@dataclass(frozen=True)
class Variant:
    name: str
    share: float = 0.15
    layer: int = 1
    score: str = "deviation"  # deviation | oracle | attention
    normalized: bool = False  # keys' and values' squared change each over their mean square on that layer and head
    head: str = ""  # "" | bos | user | system | seen: what each document is computed after
    exact: int | None = None  # layers 0..exact recomputed for every token (share unused)
    lead: int = 0  # each document's first ``lead`` tokens always among those recomputed (within the share)
    reuse_below: int | None = None  # bound: the full prefill's KV, but documents' layers < this as computed alone
    correct: str = ""  # "" | oracle | recomputed | sample: the mean change reused tokens are shifted by
    scale: float = 1.0  # of that change


VARIANTS = {v.name: v for v in [
    Variant("share 0%", share=0.0), Variant("share 15%"), Variant("share 30%", share=0.30),
    Variant("share 50%", share=0.50), Variant("share 80%", share=0.80), Variant("share 95%", share=0.95),
    Variant("layer 3", layer=3), Variant("layer 6", layer=6),
    Variant("oracle 15%", score="oracle"), Variant("oracle 30%", share=0.30, score="oracle"),
    Variant("sink bos", head="bos"), Variant("sink user header", head="user"),
    Variant("after the system prompt", head="system"), Variant("as first seen", head="seen"),
    Variant("as first seen, 30%", head="seen", share=0.30), Variant("as first seen, 0%", head="seen", share=0.0),
    Variant("attention", score="attention"), Variant("exact 0-14", exact=14), Variant("exact 0-21", exact=21),
    Variant("lead 16", lead=16),
    Variant("normalized", normalized=True), Variant("oracle 15%, normalized", score="oracle", normalized=True),
    Variant("mean correction, oracle", correct="oracle"), Variant("mean correction, recomputed", correct="recomputed"),
    Variant("mean correction, recomputed, half", correct="recomputed", scale=0.5),
    Variant("mean correction, sample", correct="sample"),
    *(Variant(f"bound: layers 0-{k - 1} reused", reuse_below=k) for k in (2, 4, 8)),
]}


def mean_change(change: torch.Tensor, positions: torch.Tensor, rotation) -> torch.Tensor:
    """``change`` ``[L, 2, H, m, D]`` of tokens at ``positions``: its mean over the tokens ``[L, 2, H, 1, D]``, keys
    rotated back to position 0 first (a rotated key's change is the rotated change of the key before rotation)."""
    cos, sin = rotation[0][positions], rotation[1][positions]
    keys = change[:, 0].float()
    return torch.stack([keys * cos - rotate_half(keys) * sin, change[:, 1].float()], dim=1).mean(dim=3, keepdim=True)


def shift_by(kv: torch.Tensor, positions: torch.Tensor, change: torch.Tensor, rotation, scale: float) -> None:
    """Add ``scale`` times ``change`` (``mean_change``'s) to ``kv`` ``[L, 2, H, n, D]`` at ``positions``, keys rotated."""
    if positions.numel():
        cos, sin = rotation[0][positions], rotation[1][positions]
        kv[:, 0, :, positions] += (scale * (change[:, 0] * cos + rotate_half(change[:, 0]) * sin)).to(kv.dtype)
        kv[:, 1, :, positions] += (scale * change[:, 1]).expand_as(kv[:, 1, :, positions]).to(kv.dtype)


def normalized_deviation(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Per layer and token, ``[L, T]``: the squared change of keys and of values ``[L, 2, H, T, D]``, each over its
    mean square in that layer, K/V and head (so neither the keys' larger scale nor one head dominates)."""
    scale = new.float().square().mean(dim=(3, 4), keepdim=True).clamp_min(1e-12)
    return ((new.float() - old.float()).square() / scale).sum(dim=(1, 2, 4))


class MeanCorrecting(BlendCache):
    """A blend forward that, on each layer above ``stop``, shifts each document's reused tokens by the mean change
    the forward makes to the document's tokens in ``estimate_from`` (a subset of the rows it computes)."""

    def __init__(self, buffer, positions, chunks, estimate_from, computed, stop: int, rotation, scale: float):
        super().__init__(buffer, positions)
        row = torch.full((buffer.shape[3],), -1, dtype=torch.long)
        row[positions] = torch.arange(positions.numel())
        self.groups = [(torch.arange(s, e)[estimate_from[s:e]], torch.arange(s, e)[~computed[s:e]]) for s, e in chunks]
        self.row, self.stop, self.rotation, self.scale = row, stop, rotation, scale

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx > self.stop:
            new = torch.stack([key_states[0], value_states[0]]).to(self.buffer.dtype)  # [2, H, T, D]
            for sample, rest in self.groups:
                if sample.numel() and rest.numel():
                    change = new[:, :, self.row[sample]] - self.buffer[layer_idx, :, :, sample]
                    shift_by(self.buffer[layer_idx : layer_idx + 1], rest,
                             mean_change(change[None], sample, self.rotation), self.rotation, self.scale)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class Lab:
    def __init__(self, cache: PrefixCache, tokenizer):
        self.cache, self.model = cache, cache.model
        self.blender = cache.serial.blender
        if self.blender.prepare() is not None:
            raise SystemExit(f"the model cannot blend: {self.blender.unsupported_reason}")
        self.layout = self.blender.layout
        self.heads = {"": [], "bos": [tokenizer.bos_token_id],
                      "user": tokenizer("<|im_start|>user\n", add_special_tokens=False)["input_ids"]}
        self._alone: dict[tuple, torch.Tensor] = {}
        self.pool: list[list[int]] = []  # every document of the prompts (``seen``'s other documents)

    def document(self, tokens: list[int], head: str, p: RagPrompt) -> tuple[torch.Tensor, int]:
        """A document's KV computed after ``head`` (not included) and where its first token sat: ``system``
        after ``p``'s system prompt, ``seen`` after it and another document (as a store would keep the KV of
        the prompt it first came in)."""
        system = p.ids[: p.chunks[0][0]]
        if head == "system":
            before = system
        elif head == "seen":
            pool = self.pool or [p.ids[s:e] for s, e in p.chunks]  # without a pool, the prompt's other documents
            other = next(d for d in pool[len(tokens) % len(pool):] + pool if d != tokens)
            before = system + other
        else:
            before = self.heads[head]
        key = (tuple(tokens), head, tuple(before))
        if key not in self._alone:
            self._alone[key] = compute_alone(self.model, self.layout, before + tokens).slice(len(before),
                                                                                             len(before) + len(tokens))
        return self._alone[key], len(before)

    def build(self, p: RagPrompt, v: Variant) -> torch.Tensor:
        ids, end, layout = p.ids, len(p.ids) - 1, self.layout
        first = p.chunks[0][0]
        buf = torch.empty((layout.num_layers, 2, layout.num_kv_heads, end, layout.head_dim), dtype=layout.dtype)
        buf[:, :, :, :first] = compute_alone(self.model, layout, ids[:first]).slice(0, first)
        reused = torch.zeros(end, dtype=torch.bool)
        for s, e in p.chunks:
            kv, at = self.document(ids[s:e], v.head, p)
            rerotate(kv, s - at, self.blender.shift, out=buf[:, :, :, s:e])
            reused[s:e] = True
        if v.reuse_below is not None:
            full = compute_alone(self.model, layout, ids[:end]).slice(0, end)
            full[: v.reuse_below, :, :, reused] = buf[: v.reuse_below, :, :, reused]
            return full
        rows = torch.arange(first, end)
        positions = torch.nonzero(reused).flatten()
        k = 0 if v.exact is not None else recompute_count(int(positions.numel()), v.share)
        chosen = positions[:0]
        if v.exact is not None or 0 < k < positions.numel():
            top = layout.num_layers - 1  # a small model has fewer layers than a variant names
            watch = min(v.layer, top - 1) if v.score == "attention" else None  # the attention is read below the stop
            stop = watch + 1 if watch is not None else min(v.exact if v.exact is not None else v.layer, top)
            score = self._score(buf, ids, rows, v, stop, end, watch)
            if k:
                score = score[reused[first:end]].clone()
                if v.lead:
                    head = torch.zeros(end, dtype=torch.bool)
                    for s, e in p.chunks:
                        head[s : min(e, s + v.lead)] = True
                    score[head[positions]] = float("inf")
                spread = k // 3 if v.correct == "sample" else 0
                order = torch.sort(score, descending=True, stable=True).indices[: k - spread]
                if spread:
                    rest = torch.ones(positions.numel(), dtype=torch.bool)
                    rest[order] = False
                    rest = torch.nonzero(rest).flatten()
                    sample = rest[torch.linspace(0, rest.numel() - 1, spread).round().long()]
                    order = torch.cat([order, sample])
                chosen = positions[order]
        elif k:
            chosen = positions
        compute = ~reused
        compute[:first] = False
        compute[chosen] = True
        todo = torch.nonzero(compute).flatten()
        cache = BlendCache(buf, todo)
        if v.correct:
            stop = min(v.layer, layout.num_layers - 1)
            rotation = self._rotation(end)
            if v.correct == "oracle":
                full = compute_alone(self.model, layout, ids[:end]).slice(0, end)
                for s, e in p.chunks:
                    rest = torch.arange(s, e)[~compute[s:e]]
                    change = mean_change(full[stop + 1 :, :, :, s:e] - buf[stop + 1 :, :, :, s:e], torch.arange(s, e), rotation)
                    shift_by(buf[stop + 1 :], rest, change, rotation, v.scale)
            else:
                estimate_from = compute.clone() if v.correct == "recomputed" else torch.zeros_like(compute)
                if v.correct == "sample":
                    estimate_from[chosen[k - k // 3 :]] = True
                cache = MeanCorrecting(buf, todo, [(s, e) for s, e in p.chunks], estimate_from, compute, stop, rotation,
                                       v.scale)
        blend_forward(self.model, torch.tensor([ids[i] for i in todo.tolist()]), cache)
        return buf

    def _rotation(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[n, D]`` of the rotation to each position ``0..n-1``."""
        cos, sin = zip(*(self.blender.shift(i) for i in range(n)))
        return torch.stack(cos), torch.stack(sin)

    def _score(self, buf, ids, rows, v: Variant, stop: int, end: int, watch: int | None) -> torch.Tensor:
        """Per token after the system prompt: what the variant ranks by. Leaves layers 0..stop a full prefill's."""
        if v.score == "oracle":
            full = compute_alone(self.model, self.layout, ids[:end]).slice(0, end)[:, :, :, rows]
            if v.normalized:
                return normalized_deviation(buf[:, :, :, rows], full).sum(dim=0)
            return (full - buf[:, :, :, rows]).square().sum(dim=(0, 1, 2, 4))
        seen: dict[str, torch.Tensor] = {}

        class Recording(BlendCache):
            def attend(self, layer, query, scale):
                if layer == watch:
                    q = query[0, :, -QUESTION_ROWS:]
                    keys = self.buffer[layer, 0, :, : self.end].repeat_interleave(query.shape[1] // self.buffer.shape[2], 0)
                    logits = (q @ keys.transpose(1, 2)) * scale
                    logits = logits.masked_fill(~self.visible[-QUESTION_ROWS:], float("-inf"))
                    seen["attention"] = torch.softmax(logits, -1).mean(dim=(0, 1))
                return super().attend(layer, query, scale)

        cache = Recording(buf, rows, stop_layer=stop)
        blend_forward(self.model, torch.tensor(ids[int(rows[0]) : end]), cache)
        deviation = (normalized_deviation(cache.previous[None], buf[None, stop, :, :, rows])[0] if v.normalized
                     else kv_deviation(cache.previous, buf[stop, :, :, rows]))
        return deviation * seen["attention"][rows] if v.score == "attention" else deviation

    def answer(self, buf: torch.Tensor, p: RagPrompt, tokens: int) -> list[int]:
        return self.margins(buf, p, tokens)[0]

    def margins(self, buf: torch.Tensor, p: RagPrompt, tokens: int) -> tuple[list[int], list[float]]:
        """The greedy answer from ``buf`` and the top-1 − top-2 logit margin of each of its steps."""
        kv = WorkingCache(self.layout, [(buf, len(p.ids) - 1)], len(p.ids) + tokens)
        out, margins = [p.ids[-1]], []
        for _ in range(tokens):
            logits = self.model(input_ids=torch.tensor([out[-1:]]), past_key_values=kv).logits[0, -1]
            top = logits.topk(2).values
            margins.append(float(top[0] - top[1]))
            out.append(int(logits.argmax()))
        return out[1:], margins

    def loglik(self, buf: torch.Tensor, p: RagPrompt, answer: list[int]) -> float:
        kv = WorkingCache(self.layout, [(buf, len(p.ids) - 1)], len(p.ids) + len(answer))
        return _loglik(self.model(input_ids=torch.tensor([[p.ids[-1], *answer[:-1]]]), past_key_values=kv).logits[0],
                       answer)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--near-ties", nargs="*", type=float, metavar="TAU",
                        help="measure switching to the exact KV at the first margin under TAU (no variants)")
    args = parser.parse_args(argv)
    model, tokenizer = load_default_model(dtype=torch.float32)
    spec = RagSpec()
    with PrefixCache(model, tokenizer, CacheConfig(ttl_seconds=None), batching=False, start_sweeper=False) as cache, \
            torch.no_grad():
        dev = prompts(cache, documents(tokenizer, spec, 0)[spec.documents :], args.prompts, spec, "dev")
        lab = Lab(cache, tokenizer)
        lab.pool = [d for d in {tuple(p.ids[s:e]): None for p in dev for s, e in p.chunks}]
        lab.pool = [list(d) for d in lab.pool]
        references = []
        for p in dev:
            answer, _, logits = _generate(model, p.ids, args.answer_tokens, time.perf_counter)
            references.append((answer, _loglik(logits, answer)))
        print(f"{len(dev)} development prompts of {min(len(p.ids) for p in dev)}-{max(len(p.ids) for p in dev)} "
              f"tokens, {args.answer_tokens}-token greedy answers\n")
        if args.near_ties:
            near_ties(lab, dev, references, args.near_ties, args.answer_tokens)
            return
        print("| variant | answers = full prefill | leading tokens equal (mean) | log-likelihood gap per token |")
        print("|---|---|---|---|")
        for name in args.variants:
            equal, lead, gaps = 0, [], []
            for p, (answer, full) in zip(dev, references):
                buf = lab.build(p, VARIANTS[name])
                got = lab.answer(buf, p, len(answer))
                equal += got == answer
                lead.append(_leading(got, answer))
                gaps.append((full - lab.loglik(buf, p, answer)) / len(answer))
            print(f"| {name} | {equal}/{len(dev)} | {statistics.fmean(lead):.1f} | {statistics.fmean(gaps):.4f} |",
                  flush=True)


def near_ties(lab: Lab, dev: list[RagPrompt], references, taus: list[float], tokens: int) -> None:
    """Per TAU: answers equal to the full prefill's when the blend's answer switches to the exact KV at its first
    step with a margin under TAU; how many prompts switched, and at which step on average."""
    runs = [lab.margins(lab.build(p, VARIANTS["share 15%"]), p, tokens) for p in dev]
    print("| switch to the exact KV below a margin of | answers = full prefill | prompts switched | step of the switch (mean) |")
    print("|---|---|---|---|")
    for tau in taus:
        equal, steps = 0, []
        for p, (answer, _), (got, margins) in zip(dev, references, runs):
            step = next((i for i, m in enumerate(margins) if m < tau), None)
            if step is not None:
                steps.append(step)
                got = got[:step] + _generate(lab.model, p.ids + got[:step], tokens - step, time.perf_counter)[0]
            equal += got == answer
        mean = f"{statistics.fmean(steps):.1f}" if steps else "-"
        print(f"| {tau:g} | {equal}/{len(dev)} | {len(steps)}/{len(dev)} | {mean} |", flush=True)


if __name__ == "__main__":
    main()
