"""``prefixcache bench --workloads rag``: documents reused anywhere in the prompt (chunk blending).

Documents are the language reference topics every Python ships (``pydoc_data.topics``), cut at
a line to 300-1,000 tokens. A prompt is a shared system prompt, a user turn holding a few of
them (each a marked part, drawn in varying order and combination) and a question about one.
Two sets, from disjoint halves of the topics: the timed workload and a held-out fidelity set
(nothing in the blending code was chosen on either; ``benchmarks/blend_variants.py`` compares
ways of blending on a third set, the timed half's documents the timed workload leaves unused).

- TTFT: each request served by plain ``generate()`` (no cache), by prefixcache with prefix
  reuse only (documents not marked) and by prefixcache blending the marked documents, one
  after another request by request (same machine noise); the two prefixcache arms on the
  serial engine, each with its own store.
- Fidelity: per held-out prompt, the full prefill's greedy answer and its log-likelihood; per
  recompute share, the blended greedy answer (equal to the full prefill's or not), the
  log-likelihood of the full prefill's answer under the blended KV, and the first-token time; where
  answers part, the full prefill's top-1 − top-2 logit margin there; as references, the full prefill
  by copies of the model in bfloat16 and float16 against the float32 one.
"""
from __future__ import annotations

import json
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from prefixcache.bench import models
from prefixcache.bench.systems import FirstTokenTimer
from prefixcache.cache.scope import Scope
from prefixcache.config import CacheConfig
from prefixcache.loading import load_default_model
from prefixcache.model.hf_cache import WorkingCache
from prefixcache.sdk import PrefixCache
from prefixcache.serving.blend import BlendRequest

SYSTEM = ("You are a careful assistant for Python programmers. Answer the question using only the documents "
          "provided, in one or two sentences.")
#: Recompute shares the fidelity table measures.
SHARES = (0.0, 0.05, 0.15, 0.30, 0.50, 1.0)
#: The timed arms served as the SDK serves by default (the batching engine answers, the serial engine blends).
ON_BATCHING = " (batching engine)"
PREFIX_ONLY = "prefix reuse only"


@dataclass(frozen=True, slots=True)
class RagSpec:
    documents: int = 6  # documents of the timed workload
    requests: int = 16
    per_prompt: tuple[int, int] = (2, 3)  # documents per prompt, at least and at most
    tokens: tuple[int, int] = (300, 700)  # document length range (tokens), within 300-1,000
    output_tokens: int = 8  # timed workload: tokens generated per request
    timed_shares: tuple[float, ...] = (0.15, 0.30)  # timed workload: one blended arm per share
    fidelity_prompts: int = 16
    answer_tokens: int = 16  # fidelity: greedy answer length compared
    shares: tuple[float, ...] = SHARES
    reference_dtypes: tuple[str, ...] = ("bfloat16", "float16")  # full prefills compared with the float32 one
    clients: int = 8  # concurrent blending clients (serial engine against the batching engine)
    client_tokens: int = 32  # tokens each of them generates
    client_rounds: int = 2  # rounds of each engine, alternating
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Document:
    title: str
    text: str


@dataclass(frozen=True, slots=True)
class RagPrompt:
    ids: list[int]
    chunks: tuple[tuple[int, int], ...]
    titles: tuple[str, ...]


@dataclass(slots=True)
class RagResult:
    spec: RagSpec
    machine: dict[str, object]
    default_share: float
    ttft: dict[str, list[float]] = field(default_factory=dict)  # arm -> seconds per request
    prompt_tokens: list[int] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    prefix_answers_equal: int = 0  # prefix-only answers equal to generate()'s
    fidelity: list[dict[str, float]] = field(default_factory=list)  # one row per share
    references: list[dict[str, object]] = field(default_factory=list)  # one row per reference dtype
    margins: list[list[float]] = field(default_factory=list)  # per fidelity prompt: top-1 - top-2 logit per step
    full_ttft: list[float] = field(default_factory=list)  # fidelity prompts, full prefill
    concurrent: list[dict[str, object]] = field(default_factory=list)  # one row per round and engine
    elapsed: float = 0.0


def documents(tokenizer, spec: RagSpec, half: int) -> list[Document]:
    """Topics of one half (0: timed, 1: held out), each cut at a line to a length drawn in ``spec.tokens``."""
    from pydoc_data.topics import topics

    rng = random.Random(f"{spec.seed}:docs:{half}")
    names = sorted(topics)[half::2]
    rng.shuffle(names)
    out = []
    for name in names:
        target = rng.randint(*spec.tokens)
        text, lines = "", topics[name].strip().splitlines()
        for line in lines:
            longer = f"{text}\n{line}" if text else line
            if len(tokenizer(longer, add_special_tokens=False)["input_ids"]) > target:
                break
            text = longer
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) >= spec.tokens[0]:
            out.append(Document(name, f"Document '{name}':\n{text}"))
    return out


def prompts(cache: PrefixCache, docs: Sequence[Document], count: int, spec: RagSpec, salt: str) -> list[RagPrompt]:
    """``count`` prompts: the system prompt, then documents drawn in varying order and combination, then a question."""
    rng = random.Random(f"{spec.seed}:{salt}")
    out = []
    for _ in range(count):
        chosen = rng.sample(list(docs), rng.randint(*spec.per_prompt))
        subject = rng.choice(chosen).title
        parts = [{"type": "text", "text": d.text, "prefixcache_chunk": True} for d in chosen]
        parts.append({"type": "text", "text": f"Question: what does the document '{subject}' explain?"})
        encoded = cache.canonicalizer.encode_chat([{"role": "system", "content": SYSTEM},
                                                   {"role": "user", "content": parts}])
        if encoded.unplaced:
            raise RuntimeError(f"{encoded.unplaced} document(s) not rendered verbatim by the chat template")
        out.append(RagPrompt(list(encoded.token_ids), encoded.chunks, tuple(d.title for d in chosen)))
    return out


def run_rag(spec: RagSpec, out: Path, progress: Callable[[str], None] = print,
            clock: Callable[[], float] = time.perf_counter) -> RagResult:
    """The timed workload and the fidelity table on the embedded default model, float32."""
    start = clock()
    model, tokenizer = load_default_model(dtype=torch.float32)
    config = CacheConfig(ttl_seconds=None)
    # One cache per arm: each finds only what its own earlier requests stored. The serial engine's arms, and
    # prefix reuse and the default share as served by default (the batching engine).
    serial = [PREFIX_ONLY, *(_arm(share) for share in spec.timed_shares), "fidelity"]
    caches = {name: PrefixCache(model, tokenizer, config, batching=False, start_sweeper=False) for name in serial}
    caches.update({name + ON_BATCHING: PrefixCache(model, tokenizer, config, start_sweeper=False)
                   for name in (PREFIX_ONLY, _arm(config.blend_recompute_share))})
    result = RagResult(spec, models.machine(), config.blend_recompute_share)
    try:
        canon = caches["fidelity"]
        timed = prompts(canon, documents(tokenizer, spec, 0)[: spec.documents], spec.requests, spec, "timed")
        held_out = prompts(canon, documents(tokenizer, spec, 1), spec.fidelity_prompts, spec, "held-out")
        _warm_up(model)
        _timed(result, model, caches, timed, spec, progress, clock)
        _fidelity(result, model, canon, held_out, spec, progress, clock)
        _concurrent(result, model, tokenizer, timed, spec, progress, clock)
    finally:
        for cache in caches.values():
            cache.close()
    result.elapsed = clock() - start
    out.mkdir(parents=True, exist_ok=True)
    (out / "rag.json").write_text(json.dumps(asdict(result), indent=1, default=str))
    (out / "rag.md").write_text(markdown(result))
    return result


def _warm_up(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model(input_ids=torch.zeros((1, 64), dtype=torch.long))


def _generate(model: torch.nn.Module, ids: list[int], tokens: int, clock) -> tuple[list[int], float, torch.Tensor]:
    """Plain ``generate()``: greedy answer, first-token time, and the raw logits of each step ``[tokens, V]``."""
    timer = FirstTokenTimer(clock)
    t0 = clock()
    out = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, eos_token_id=None,
                         pad_token_id=0, logits_processor=[timer], output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(ids):].tolist(), timer.at - t0, torch.cat(out.logits).float()


def _arm(share: float) -> str:
    return f"blended, {share:.0%} recomputed"


def _timed(result: RagResult, model, caches: dict[str, PrefixCache], timed: list[RagPrompt], spec: RagSpec,
           progress, clock) -> None:
    arms: dict[str, list[float]] = {"no cache (generate)": [], PREFIX_ONLY: []}
    arms.update({_arm(share): [] for share in spec.timed_shares})
    batched = [name for name in caches if name.endswith(ON_BATCHING)]
    arms.update({name: [] for name in batched})
    opts = {"max_new_tokens": spec.output_tokens, "ignore_eos": True}
    for i, p in enumerate(timed):
        reference, ttft, _ = _generate(model, p.ids, spec.output_tokens, clock)
        arms["no cache (generate)"].append(ttft)
        plain = caches[PREFIX_ONLY].answer(p.ids, **opts)
        arms[PREFIX_ONLY].append(plain.stats.ttft_seconds)
        result.prefix_answers_equal += list(plain.token_ids) == reference
        for share in spec.timed_shares:
            mixed = caches[_arm(share)].answer(p.ids, chunks=p.chunks, blend=share, **opts)
            arms[_arm(share)].append(mixed.stats.ttft_seconds)
        for name in batched:  # the server's default share (blend=None) where the arm blends
            chunks = None if name.startswith(PREFIX_ONLY) else p.chunks
            arms[name].append(caches[name].answer(p.ids, chunks=chunks, **opts).stats.ttft_seconds)
        result.prompt_tokens.append(len(p.ids))
        result.chunk_tokens.append(sum(e - s for s, e in p.chunks))
        progress(f"rag timed {i + 1}/{len(timed)}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in arms.items()))
    result.ttft = arms


def _fidelity(result: RagResult, model, cache: PrefixCache, held_out: list[RagPrompt], spec: RagSpec,
              progress, clock) -> None:
    """Per prompt and share: the blended KV built once (the documents stored beforehand, untimed; no prompt
    prefix stored, so every share starts alike), then the greedy answer and the log-likelihood of the
    full prefill's answer after it."""
    rows = {share: {"agree": 0, "first": 0, "lead": [], "gap": [], "ttft": []} for share in spec.shares}
    if cache.serial.blender.prepare() is not None:
        raise RuntimeError(f"the model cannot blend: {cache.serial.blender.unsupported_reason}")
    answers = []
    for i, p in enumerate(held_out):
        answer, ttft, logits = _generate(model, p.ids, spec.answer_tokens, clock)
        answers.append(answer)
        full = _loglik(logits, answer)
        top = logits.topk(2, dim=-1).values
        result.margins.append((top[:, 0] - top[:, 1]).tolist())
        result.full_ttft.append(ttft)
        _store_chunks(cache, p)  # untimed: every share then finds the documents stored
        for share in spec.shares:
            got, ttft, loglik = _blended(model, cache, p, share, answer, clock)
            row = rows[share]
            row["agree"] += got == answer
            row["first"] += got[:1] == answer[:1]
            row["lead"].append(_leading(got, answer))
            row["ttft"].append(ttft)
            row["gap"].append((full - loglik) / len(answer))
        progress(f"rag fidelity {i + 1}/{len(held_out)}")
    n = len(held_out)
    result.fidelity = [{"share": share, "agree": r["agree"] / n, "first_token": r["first"] / n,
                        "leading_equal": statistics.fmean(r["lead"]),
                        "loglik_gap_per_token": statistics.fmean(r["gap"]),
                        "loglik_gap_max": max(r["gap"]), "ttft_p50": statistics.median(r["ttft"]),
                        "parting_margins": _parting(result.margins, r["lead"]), "leads": r["lead"]}
                       for share, r in rows.items()]
    _references(result, model, held_out, answers, spec, progress, clock)


def _references(result: RagResult, model, held_out: list[RagPrompt], answers: list[list[int]], spec: RagSpec,
                progress, clock) -> None:
    """How far plain attention in a lower precision already moves the same greedy answers: the full prefill
    of each held-out prompt by a copy of the model in each of ``spec.reference_dtypes``, against float32's."""
    import copy

    for name in spec.reference_dtypes:
        low = copy.deepcopy(model).to(getattr(torch, name))
        leads = [_leading(_generate(low, p.ids, len(answer), clock)[0], answer) for p, answer in zip(held_out, answers)]
        del low
        result.references.append({"dtype": name, "agree": sum(j == len(a) for j, a in zip(leads, answers)) / len(leads),
                                  "leading_equal": statistics.fmean(leads),
                                  "parting_margins": _parting(result.margins, leads), "leads": leads})
        progress(f"rag fidelity reference {name}")


def stable_agreement(result: RagResult, dtype: str) -> tuple[int, list[tuple[float, int]]]:
    """Answers a full prefill in ``dtype`` leaves as float32's (how many prompts) and, per share, how many of those
    the blend reproduces: agreement on the answers plain attention in a lower precision does not move."""
    ref = next(r for r in result.references if r["dtype"] == dtype)
    n = result.spec.answer_tokens
    stable = [i for i, lead in enumerate(ref["leads"]) if lead == n]
    return len(stable), [(row["share"], sum(row["leads"][i] == n for i in stable)) for row in result.fidelity]


def _parting(margins: list[list[float]], leads: list[int]) -> list[float]:
    """Per prompt whose answer parts: the full prefill's margin at the first differing step."""
    return [m[j] for m, j in zip(margins, leads) if j < len(m)]


def _leading(got: list[int], answer: list[int]) -> int:
    """How many leading tokens of ``got`` equal ``answer``'s."""
    return next((j for j, (a, b) in enumerate(zip(got, answer)) if a != b), len(answer))


def _concurrent(result: RagResult, model, tokenizer, timed: list[RagPrompt], spec: RagSpec, progress,
                clock) -> None:
    """``spec.clients`` threads each blending one of the timed prompts at the default share at once, served by
    the serial engine or by the batching engine (rounds alternating, a fresh cache each with the documents
    stored first): wall time, tokens/s, first-token p50, and whether both engines gave the same answers."""
    chosen = timed[: spec.clients]
    first: list[list[int]] | None = None  # the first round's answers (the serial engine's)
    for round_ in range(spec.client_rounds):
        for batching in (False, True):
            with PrefixCache(model, tokenizer, CacheConfig(ttl_seconds=None), batching=batching,
                             start_sweeper=False) as cache:
                for p in chosen:  # untimed: every document stored, no prompt
                    _store_chunks(cache, p)
                out: list = [None] * len(chosen)

                def call(i: int, cache: PrefixCache = cache, out: list = out) -> None:
                    out[i] = cache.answer(chosen[i].ids, chunks=chosen[i].chunks, max_new_tokens=spec.client_tokens,
                                          ignore_eos=True)

                threads = [threading.Thread(target=call, args=(i,)) for i in range(len(chosen))]
                t0 = clock()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                wall = clock() - t0
            if any(o is None for o in out):
                raise RuntimeError("a concurrent blending call failed")
            tokens = [list(o.token_ids) for o in out]
            first = tokens if first is None else first
            result.concurrent.append({
                "engine": "batching" if batching else "serial", "round": round_ + 1, "wall": wall,
                "tokens_per_s": sum(map(len, tokens)) / wall,
                "ttft_p50": statistics.median(o.stats.ttft_seconds for o in out),
                "executors": sorted({o.stats.executor for o in out}),
                "blended": sum(1 for o in out if o.stats.chunk_reused_tokens), "same_answers": tokens == first})
            progress(f"rag concurrent round {round_ + 1} {'batching' if batching else 'serial'}: {wall:.2f} s")


def _loglik(logits: torch.Tensor, answer: list[int]) -> float:
    """Sum of log p(answer token) under ``logits`` ``[len(answer), V]``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return float(logp[torch.arange(len(answer)), torch.tensor(answer)].sum())


def _store_chunks(cache: PrefixCache, p: RagPrompt) -> None:
    """Compute and store the prompt's documents not stored yet (a build that recomputes nothing)."""
    if cache.serial.blender.prepare() is not None:
        raise RuntimeError(f"the model cannot blend: {cache.serial.blender.unsupported_reason}")
    scope = Scope(cache.namespace("default"), "default")
    lease = cache.store.acquire(scope, p.ids, len(p.ids) - 1)
    try:
        with torch.no_grad():
            cache.serial.blender.build(p.ids, BlendRequest(p.chunks, 0.0), lease, scope)
    finally:
        cache.store.release(lease)


def _blended(model, cache: PrefixCache, p: RagPrompt, share: float, answer: list[int],
             clock) -> tuple[list[int], float, float]:
    """(greedy answer, first-token time, log-likelihood of ``answer``) after the prompt's blended KV: what the
    serial engine does for a blended call (lease, build, the last prompt token), without storing the prompt."""
    engine, n, tenant = cache.serial, len(p.ids), "default"
    scope = Scope(cache.namespace(tenant), tenant)
    t0 = clock()
    lease = cache.store.acquire(scope, p.ids, n - 1)
    try:
        with torch.no_grad():
            built = engine.blender.build(p.ids, BlendRequest(p.chunks, share), lease, scope, room=n + len(answer))
            kv = WorkingCache.adopt(engine.layout, built.buffer, n - 1)  # decoding writes from n - 1 on
            token = int(model(input_ids=torch.tensor([p.ids[-1:]]), past_key_values=kv).logits[0, -1].argmax())
            ttft = clock() - t0
            greedy = [token]
            while len(greedy) < len(answer):
                step = model(input_ids=torch.tensor([[greedy[-1]]]), past_key_values=kv).logits[0, -1]
                greedy.append(int(step.argmax()))
            scored = WorkingCache(engine.layout, [(built.buffer, n - 1)], n + len(answer))
            logits = model(input_ids=torch.tensor([[p.ids[-1], *answer[:-1]]]), past_key_values=scored).logits[0]
    finally:
        cache.store.release(lease)
    return greedy, ttft, _loglik(logits, answer)


def _margins(values: list[float]) -> str:
    return ", ".join(f"{m:.3f}" for m in sorted(values)) if values else "no answer parts"


def fidelity_lines(result: RagResult) -> list[str]:
    """The fidelity table, where the answers part, and the lower-precision references, as markdown lines."""
    spec, lines = result.spec, []
    lines += [f"Fidelity: {len(result.full_ttft)} held-out prompts, greedy answers of {spec.answer_tokens} "
              f"tokens; full prefill TTFT p50 {statistics.median(result.full_ttft):.3f} s.", "",
              "| recompute share | answers = full prefill | first token = | leading tokens equal (mean) "
              "| log-likelihood gap per token (mean) | gap (worst prompt) | TTFT p50 s |", "|---|---|---|---|---|---|---|"]
    for row in result.fidelity:
        lines.append(f"| {row['share']:.0%} | {row['agree']:.0%} | {row['first_token']:.0%} | "
                     f"{row['leading_equal']:.1f} | {row['loglik_gap_per_token']:.4f} | {row['loglik_gap_max']:.4f} | "
                     f"{row['ttft_p50']:.3f} |")
    lines += ["", "Log-likelihood gap: (log p of the full prefill's greedy answer after a full prefill − the same "
              "after the blended KV) / answer tokens, in nats; 0 = the blended KV predicts the answer as well."]
    if result.margins:
        every = [m for steps in result.margins for m in steps]
        default = next((r for r in result.fidelity if r["share"] == result.default_share), None)
        lines += ["", f"Where answers part: the float32 full prefill's top-1 minus top-2 logit at the first differing "
                  f"token; over all {len(every)} answer steps its median is {statistics.median(every):.2f} and "
                  f"{sum(m < 0.1 for m in every)} steps are under 0.1."]
        if default is not None:
            lines.append(f"- blended at the default share ({result.default_share:.0%}): "
                         f"{_margins(default['parting_margins'])}")
        for ref in result.references:
            lines.append(f"- full prefill in {ref['dtype']}: {_margins(ref['parting_margins'])}")
    if result.references:
        lines += ["", "Plain attention in a lower precision, the same prompts: each full prefill by a copy of the "
                  "model in that dtype against the float32 full prefill's answers.", "",
                  "| full prefill in | greedy answer = float32 full prefill's | leading tokens equal (mean) |",
                  "|---|---|---|"]
        lines += [f"| {r['dtype']} | {r['agree']:.0%} | {r['leading_equal']:.1f} |" for r in result.references]
        for ref in (r for r in result.references if r["agree"] < 1):  # where that dtype moved an answer
            count, rows = stable_agreement(result, ref["dtype"])
            lines += ["", f"On the {count} prompts whose float32 answer the {ref['dtype']} full prefill also gives "
                      "(answers plain attention in that dtype does not move), blended answers equal to the full "
                      "prefill's: " + ", ".join(f"{share:.0%} {agree}/{count}" for share, agree in rows) + "."]
    return lines


def markdown(result: RagResult) -> str:
    spec, m = result.spec, result.machine
    p50 = {arm: statistics.median(v) for arm, v in result.ttft.items()}

    def versus(arm: str) -> float:  # prefix reuse on the same engine
        return p50[arm] / p50[PREFIX_ONLY + (ON_BATCHING if arm.endswith(ON_BATCHING) else "")]

    lines = [
        "# prefixcache bench — workload `rag`", "",
        f"- machine: {m['cpu']}, {m['cpus']} CPUs, torch threads {m['torch_threads']}; torch {m['torch']}, "
        f"transformers {m['transformers']}; prefixcache commit {m.get('commit')}; run took {result.elapsed:.0f} s",
        "- model: SmolLM2-135M-Instruct (embedded default), float32; the serial engine serves the prefixcache arms "
        "but those marked batching engine (as the SDK and proxy serve by default: the serial engine blends, the "
        "batching engine answers), compared with prefix reuse on the same engine",
        f"- timed: {spec.requests} requests over {spec.documents} documents ({spec.per_prompt[0]}-{spec.per_prompt[1]} "
        f"per prompt, {spec.tokens[0]}-{spec.tokens[1]} tokens each), prompts of "
        f"{min(result.prompt_tokens)}-{max(result.prompt_tokens)} tokens ({statistics.fmean(result.chunk_tokens):.0f} "
        f"document tokens on average), {spec.output_tokens} tokens out; the server's default share: "
        f"{result.default_share:.0%}; prefix-only answers equal to generate()'s: "
        f"{result.prefix_answers_equal}/{len(result.prompt_tokens)}",
        "", "| arm | TTFT p50 s | TTFT mean s | vs prefix reuse only on its engine (p50) |", "|---|---|---|---|"]
    for arm, values in result.ttft.items():
        lines.append(f"| {arm} | {p50[arm]:.3f} | {statistics.fmean(values):.3f} | {versus(arm):.2f}x |")
    lines += ["", *fidelity_lines(result)]
    if result.concurrent:
        lines += ["", f"Concurrent: {spec.clients} clients at once, each blending one timed prompt at the default "
                  f"share, {spec.client_tokens} tokens each.", "",
                  "| round | engine | wall s | tokens/s | TTFT p50 s | calls blended | answers = the serial engine's first round |",
                  "|---|---|---|---|---|---|---|"]
        for row in result.concurrent:
            lines.append(f"| {row['round']} | {row['engine']} | {row['wall']:.2f} | {row['tokens_per_s']:.1f} | "
                         f"{row['ttft_p50']:.2f} | {row['blended']}/{spec.clients} | {row['same_answers']} |")
    return "\n".join(lines) + "\n"
