"""Replicas behind ``sglang-router``: cache-aware vs round-robin routing, side by side in one run.

    python -m benchmarks.replicas --replicas 2 --groups 3 --questions 6 --rounds 3 --tier-redis

A workload of system-prompt groups (one tenant per group, so each replica's per-tenant
stats say where each group ran) is sent by one client thread per group, streamed, to:
one replica alone (the reference), then the router with each policy. With
``--tier-redis`` a second fleet of replicas shares one Redis tier (a ``redis-server``
started here; the same hash secret; write-through) and runs round-robin too, in the
same rounds. Every run starts from flushed caches (the Redis tier's too). Reported per
run: token hit rate (tier restores count as cached tokens, as the replicas report them),
TTFT p50/p99 and mean, requests per replica, Redis tier restores per replica, the groups
that ran on more than one replica, and whether the greedy answers equal the single
replica's. Prints a markdown table (medians over rounds).
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field

import httpx

from prefixcache.admin import FanOut
from tests.support.fleet import ADMIN_KEY, Fleet, SharedTier, fleet, shared_redis, tiny_model_folder

MODEL_NAME = "replica-model"
TOPICS = ("a shipping company's parcel desk", "a public library's catalogue", "a bakery's order line",
          "a city's bicycle rental", "a museum's ticket office", "a hospital's visitor desk",
          "a railway's lost-and-found", "a hotel's concierge")


@dataclass(frozen=True, slots=True)
class Call:
    group: int
    index: int
    body: dict


@dataclass(slots=True)
class Answer:
    group: int
    index: int
    text: str = ""
    ttft: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass(slots=True)
class RunResult:
    name: str
    answers: list[Answer]
    per_replica: list[int] = field(default_factory=list)  # requests each replica served
    groups_on: dict[int, list[int]] = field(default_factory=dict)  # group -> replicas it ran on
    tier_restores: list[int] | None = None  # per replica: prefixes restored from the shared Redis tier

    @property
    def token_hit_rate(self) -> float:
        prompt = sum(a.prompt_tokens for a in self.answers)
        return sum(a.cached_tokens for a in self.answers) / prompt if prompt else 0.0

    def ttft(self, q: float) -> float:
        times = sorted(a.ttft for a in self.answers)
        return times[min(len(times) - 1, round(q * (len(times) - 1)))]

    @property
    def mean_ttft(self) -> float:
        return statistics.fmean(a.ttft for a in self.answers)

    @property
    def split_groups(self) -> list[int]:
        return sorted(g for g, on in self.groups_on.items() if len(on) > 1)

    @property
    def late_misses(self) -> list[Answer]:
        """Answers that reused nothing although their group had been served before (each group's
        requests are sent one after another): what a replica new to the group costs."""
        return [a for a in self.answers if a.index > 0 and a.error is None and a.cached_tokens == 0]


def group_keys(groups: int) -> dict[str, str]:
    """One API key (so one tenant) per group: a replica's per-tenant stats count each group's requests."""
    return {f"sk-group-{g}": f"group-{g}" for g in range(groups)}


def workload(groups: int, questions: int, max_tokens: int = 4, system_repeat: int = 12) -> list[Call]:
    """``groups`` distinct system prompts (~15 words × ``system_repeat``), ``questions`` questions each."""
    calls = []
    for g in range(groups):
        topic = TOPICS[g % len(TOPICS)] + ("" if g < len(TOPICS) else f" (branch {g // len(TOPICS)})")
        system = f"You are the assistant of {topic}. " + f"Answer in one sentence, politely, about {topic}. " \
            * system_repeat
        for q in range(questions):
            calls.append(Call(g, q, {"model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0,
                                     "stream": True, "messages": [{"role": "system", "content": system},
                                                                  {"role": "user", "content": f"Question {q}: "
                                                                   f"what happens on day {q * 7 + g}?"}]}))
    return calls


def send(client: httpx.Client, url: str, call: Call, key: str) -> Answer:
    """One streamed chat call; TTFT is the time to the first content (or the end of the stream)."""
    answer = Answer(call.group, call.index)
    finished = False
    start = time.perf_counter()
    try:
        with client.stream("POST", url + "/v1/chat/completions", json=call.body,
                           headers={"Authorization": f"Bearer {key}"}) as response:
            if response.status_code != 200:
                answer.error = f"HTTP {response.status_code}: {response.read().decode(errors='replace')[:200]}"
                return answer
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    answer.error = chunk["error"].get("message", "error event")
                    return answer
                for choice in chunk.get("choices", []):
                    text = choice.get("delta", {}).get("content") or ""
                    if (text or choice.get("finish_reason")) and not answer.ttft:
                        answer.ttft = time.perf_counter() - start
                    answer.text += text
                if chunk.get("usage"):
                    answer.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    answer.cached_tokens = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
                    finished = True
    except httpx.HTTPError as exc:  # before any chunk: connection refused etc.; after: the stream broke off
        answer.error = f"{type(exc).__name__}: {exc}"
    if not finished:  # a replica that died mid-answer: the router's stream stops or breaks off
        answer.error = f"the stream ended before the answer finished (the replica serving it was lost: " \
            f"{answer.error or 'no last chunk'})"
    return answer


def drive(url: str, calls: Sequence[Call], stagger: float = 0.05, timeout: float = 120.0,
          settle: Callable[[], None] | None = None) -> list[Answer]:
    """One thread per group sends its calls in order; group g starts ``g * stagger`` s after the first.
    ``settle``: called after each answer, before the group's next call (``written_through``)."""
    groups = sorted({c.group for c in calls})
    keys = {g: f"sk-group-{g}" for g in groups}
    answers: list[Answer] = []
    lock = threading.Lock()

    def run(g: int) -> None:
        time.sleep(g * stagger)
        with httpx.Client(timeout=timeout) as client:
            for call in (c for c in calls if c.group == g):
                result = send(client, url, call, keys[g])
                with lock:
                    answers.append(result)
                if settle is not None:
                    settle()

    threads = [threading.Thread(target=run, args=(g,), name=f"prefixcache-bench-group-{g}") for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(answers, key=lambda a: (a.group, a.index))


def measure(running: Fleet, url: str, name: str, calls: Sequence[Call], tier: SharedTier = SharedTier(),
            settle: bool = False) -> RunResult:
    """Flush every replica (and ``tier``), drive ``calls`` at ``url``, then read where each group ran. ``settle``
    (with a shared tier): each group's next call waits until every replica's tier writes have landed
    (``written_through``), so a replica new to the group finds what another wrote through; without it a call
    may come before the write, and misses."""
    groups = sorted({c.group for c in calls})
    with FanOut(running.urls, ADMIN_KEY) as fan:
        if not fan.flush()["ok"]:
            raise RuntimeError("flushing a replica failed")
        tier.clear()
        before = [fan.stats(f"group-{g}")["replicas"] for g in groups]
        restored = tier_restores(fan)
        wait = (lambda: written_through(fan)) if settle and tier.server is not None else None
        result = RunResult(name, drive(url, calls, settle=wait))
        after = [fan.stats(f"group-{g}")["replicas"] for g in groups]
        if tier.server is not None:
            result.tier_restores = [n - m for n, m in zip(tier_restores(fan), restored, strict=True)]
    served = {g: [after[i][u]["queries"] - before[i][u]["queries"] for u in running.urls] for i, g in enumerate(groups)}
    result.per_replica = [sum(served[g][r] for g in groups) for r in range(len(running.urls))]
    result.groups_on = {g: [r for r, n in enumerate(served[g]) if n] for g in groups}
    return result


def written_through(fan: FanOut, timeout: float = 30.0) -> None:
    """Wait until no replica has tier writes queued (``queued_bytes``: written through, not yet in the tier)."""
    deadline = time.monotonic() + timeout
    while True:
        answers = fan.stats()["replicas"]
        queued = sum(figures.get("queued_bytes", 0) for u in fan.replicas
                     for figures in (answers[u].get("tiers") or {}).values())
        if not queued:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{queued} bytes of tier writes still queued after {timeout} s")
        time.sleep(0.01)


def tier_restores(fan: FanOut) -> list[int]:
    """Each replica's count of prefixes restored from its Redis tier so far (0 without one)."""
    answers = fan.stats()["replicas"]
    return [((answers[u].get("tiers") or {}).get("redis") or {}).get("restores", 0) for u in fan.replicas]


def compare(running: Fleet, calls: Sequence[Call], policies: Sequence[str] = ("cache_aware", "round_robin"),
            tier: SharedTier = SharedTier(), reference: bool = True, settle: bool = False) -> list[RunResult]:
    """The single-replica reference (unless ``reference`` is false), then each routing policy, in one run
    on one fleet; ``tier`` is what the fleet's replicas share (its name is added to the runs' names);
    ``settle``: as ``measure``'s."""
    suffix = "" if tier.server is None else f" + shared {tier.name.capitalize()} tier"
    results = [measure(running, running.urls[0], "one replica" + suffix, calls, tier, settle)] if reference else []
    for policy in policies:
        router = running.router(policy)
        results.append(measure(running, router.url, f"router: {policy}{suffix}", calls, tier, settle))
        router.server.stop()
    return results


def table(rounds: list[list[RunResult]]) -> str:
    """Markdown: one row per system, medians over rounds; answers compared with the reference's."""
    lines = ["| system | token hit rate | vs one replica | TTFT p50 (ms) | TTFT p99 (ms) | mean TTFT (ms) | "
             "requests per replica (each round) | Redis tier restores per replica (each round) | groups split | "
             "answers = one replica's |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for i, name in enumerate(r.name for r in rounds[0]):
        runs = [rs[i] for rs in rounds]
        hit = statistics.median(r.token_hit_rate for r in runs)
        ref = statistics.median(rs[0].token_hit_rate for rs in rounds)
        same = all([a.text for a in rs[i].answers] == [a.text for a in rs[0].answers] for rs in rounds)
        med = {q: statistics.median(r.ttft(q) for r in runs) * 1000 for q in (0.5, 0.99)}
        mean = statistics.median(r.mean_ttft for r in runs) * 1000
        restores = "-" if runs[0].tier_restores is None else \
            ", ".join(" / ".join(str(n) for n in r.tier_restores) for r in runs)
        lines.append(f"| {name} | {hit:.3f} | {hit / ref if ref else 0:.3f}x | {med[0.5]:.1f} | {med[0.99]:.1f} | "
                     f"{mean:.1f} | {', '.join(' / '.join(str(n) for n in r.per_replica) for r in runs)} | "
                     f"{restores} | {max(len(r.split_groups) for r in runs)} | {'yes' if same else 'NO'} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.replicas", description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--system-repeat", type=int, default=12, help="length of each system prompt (x ~15 words)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="model folder for every replica; 'default': the embedded "
                        "SmolLM2-135M-Instruct (its converted copy); unset: a tiny random Llama saved with the "
                        "default model's tokenizer")
    parser.add_argument("--tier-redis", action="store_true", help="also run round-robin on a second fleet whose "
                        "replicas share one Redis tier (a redis-server started here)")
    parser.add_argument("--json", default=None, help="also write every run's answers and figures here")
    args = parser.parse_args(argv)
    calls = workload(args.groups, args.questions, args.max_tokens, args.system_repeat)
    if args.model in (None, "default"):
        from prefixcache.loading import load_default_model

        model, tokenizer = load_default_model()
        if args.model == "default":
            rounds, label = _rounds(model.name_or_path, args, calls), "SmolLM2-135M-Instruct (embedded default)"
        else:
            with tiny_model_folder(tokenizer) as folder:
                rounds = _rounds(folder, args, calls)
            label = "tiny random Llama (2 layers, hidden 64) with the SmolLM2 tokenizer"
        del model
    else:
        rounds, label = _rounds(args.model, args, calls), args.model
    print(f"model: {label}; {args.replicas} replicas; {args.groups} groups x {args.questions} questions; "
          f"{args.rounds} rounds (medians){'; round-robin also on replicas sharing a Redis tier' * args.tier_redis}\n")
    print(table(rounds))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([[{**asdict(r), "token_hit_rate": r.token_hit_rate} for r in rs] for rs in rounds], f, indent=1)
    return 0


def _rounds(folder: str, args: argparse.Namespace, calls: Sequence[Call]) -> list[list[RunResult]]:
    """Each round: the plain fleet's runs, then (``--tier-redis``) round-robin on the fleet sharing Redis."""
    keys, base = group_keys(args.groups), ("--served-model-name", MODEL_NAME)
    with ExitStack() as stack:
        plain = stack.enter_context(fleet(folder, keys, args.replicas, replica_args=base))
        tier = stack.enter_context(shared_redis(args.tier_redis))
        tiered = None
        if tier.server is not None:
            tiered = stack.enter_context(fleet(folder, keys, args.replicas, replica_args=(*base, *tier.replica_args),
                                               replica_env=tier.replica_env))
        rounds = []
        for _ in range(args.rounds):
            results = compare(plain, calls)
            if tiered is not None:
                results += compare(tiered, calls, ("round_robin",), tier, reference=False)
            rounds.append(results)
        return rounds


if __name__ == "__main__":
    raise SystemExit(main())
