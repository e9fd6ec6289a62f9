"""Benchmark settings: workload sizes, systems, presets and their command-line flags.

Every size has one default per preset (``PRESETS``); a flag given on the command line
overrides it. ``options_from_args`` is the only place flags become a ``BenchOptions``.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

WORKLOADS = ("shared-prefix", "multi-turn", "no-reuse")
#: Runs on its own (``bench/rag.py``): documents reused anywhere in the prompt, on the embedded default model.
RAG = "rag"
#: Systems run one request at a time, interleaved request by request (same noise for all).
SEQUENTIAL_SYSTEMS = ("generate", "prefixcache", "manual-reuse", "limit")
#: Systems that take the whole workload (or one multi-turn round) in one call.
BATCH_SYSTEMS = ("prefixcache-batched", "generate-batch", "generate-batch-noshare")
#: Opt-in: each starts its server as a subprocess and is fed over HTTP by the same client pool.
HTTP_SYSTEMS = ("http-prefixcache", "http-transformers-serve")
SYSTEMS = SEQUENTIAL_SYSTEMS + BATCH_SYSTEMS + HTTP_SYSTEMS
DEFAULT_SYSTEMS = ("generate", "prefixcache", "manual-reuse", "limit", "prefixcache-batched", "generate-batch")
DTYPES = ("float32", "bfloat16")
#: What ``transformers serve`` (the http-transformers-serve peer) imports beyond the core install: the `bench` extra.
SERVING_PACKAGES = ("openai", "fastapi", "uvicorn", "pydantic")
#: The one line that says how to get the bench's optional parts (plots, the transformers serve peer).
INSTALL_EXTRA = "pip install 'prefixcache[bench]'"


@dataclass(slots=True)
class SharedPrefixSpec:
    groups: int  # G groups, one system prompt each
    prompts: int  # P prompts per group
    system_tokens: int  # S
    question_tokens: int  # Q

    @property
    def requests(self) -> int:
        return self.groups * self.prompts

    @property
    def ideal_hit_rate(self) -> float:
        """(1 − 1/P)·S/(S+Q): every prompt but a group's first reuses its system prompt."""
        return (1 - 1 / self.prompts) * self.system_tokens / (self.system_tokens + self.question_tokens)


@dataclass(slots=True)
class MultiTurnSpec:
    users: int  # U conversations
    rounds: int  # R turns each
    system_tokens: int  # system prompt shared by every user
    question_tokens: int  # new user tokens per turn

    @property
    def requests(self) -> int:
        return self.users * self.rounds


@dataclass(slots=True)
class NoReuseSpec:
    prompts: int
    prompt_tokens: int

    @property
    def requests(self) -> int:
        return self.prompts


@dataclass(slots=True)
class BenchOptions:
    preset: str
    shared: SharedPrefixSpec
    multi: MultiTurnSpec
    unique: NoReuseSpec
    output_tokens: int  # O, generated per request with EOS ignored
    dtypes: tuple[str, ...] = ("float32",)
    workloads: tuple[str, ...] = WORKLOADS
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    model: str | None = None  # hub id or local path; None = the preset's model
    seed: int = 0
    out: Path = Path("bench-out")
    progress: bool = True
    plot: bool = True
    #: generate_batch: tokens per forward. Its default (8,192, pool from free RAM) took 75 s
    #: on 8 requests sharing 1,024 tokens here; 1,024 took 15 s, 256 took 13 s (the best).
    cb_max_batch_tokens: int = 256
    threads: int | None = None  # torch intra-op threads; None = torch's default
    #: prefixcache-batched and the HTTP systems: clients sending requests concurrently (closed loop).
    concurrency: int = 4
    #: Requests served untimed by each system before its timed run: the first ones that open a
    #: session, as SGLang's bench_serving warms up on its first request without flushing the
    #: cache after. 0 (the default): every system starts cold.
    warmup_requests: int = 0

    def spec(self, workload: str) -> SharedPrefixSpec | MultiTurnSpec | NoReuseSpec:
        return {"shared-prefix": self.shared, "multi-turn": self.multi, "no-reuse": self.unique}[workload]


PRESETS: dict[str, BenchOptions] = {
    # Tiny random Llama, small vocabulary: seconds; used by the tests.
    "small": BenchOptions(
        preset="small", shared=SharedPrefixSpec(groups=2, prompts=3, system_tokens=96, question_tokens=16),
        multi=MultiTurnSpec(users=2, rounds=3, system_tokens=48, question_tokens=12),
        unique=NoReuseSpec(prompts=4, prompt_tokens=80), output_tokens=8),
    # The embedded SmolLM2-135M in float32 and bfloat16: S=2,048 and Q=128 as the TTFT
    # target is defined; 16 concurrent clients as the throughput target is defined (one
    # request each); the rest is sized to keep both runs within ~30 minutes on a 2-core CPU.
    "default": BenchOptions(
        preset="default", shared=SharedPrefixSpec(groups=2, prompts=8, system_tokens=2048, question_tokens=128),
        multi=MultiTurnSpec(users=3, rounds=3, system_tokens=512, question_tokens=64),
        unique=NoReuseSpec(prompts=8, prompt_tokens=576), output_tokens=32, dtypes=("float32", "bfloat16"),
        concurrency=16),
}

def _flags(section: str | None, label: str, **fields: tuple[str, str]) -> dict[str, tuple[str, str]]:
    """{flag: (dataclass path inside BenchOptions, help)} for fields of one section, given as flag=(field, help)."""
    return {flag: (f"{section}.{field}" if section else field, label + text) for flag, (field, text) in fields.items()}


_SIZE_FLAGS = {
    **_flags("shared", "shared-prefix: ", groups=("groups", "groups G"), prompts=("prompts", "prompts per group P"),
             system_tokens=("system_tokens", "system prompt tokens S"),
             question_tokens=("question_tokens", "question tokens Q")),
    **_flags("multi", "multi-turn: ", users=("users", "users U"), rounds=("rounds", "rounds R per user"),
             turn_system_tokens=("system_tokens", "shared system prompt tokens"),
             turn_tokens=("question_tokens", "new user tokens per round")),
    **_flags("unique", "no-reuse: ", unique_prompts=("prompts", "prompts"),
             unique_tokens=("prompt_tokens", "tokens per prompt")),
    **_flags(None, "", output_tokens=("output_tokens", "tokens generated per request O (EOS ignored)"),
             cb_max_batch_tokens=("cb_max_batch_tokens", "generate_batch: max tokens per forward"),
             concurrency=("concurrency", "prefixcache-batched and http-*: concurrent clients (closed loop)")),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's flags to ``parser`` (used by ``prefixcache bench`` and ``python -m``)."""
    parser.add_argument("--preset", choices=sorted([*PRESETS, "gpu"]), default="small",
                        help="sizes and model: 'small' = tiny random Llama (seconds), "
                             "'default' = the embedded SmolLM2-135M (minutes), 'gpu' = a random-weight "
                             "Llama-3.2-1B-shaped model on CUDA: cold, hit, 64 clients and memory against "
                             "model.generate and generate_batch (bfloat16 unless --dtype)")
    parser.add_argument("--shape", default=None, help="--preset gpu: model shape (llama-1b, tiny)")
    parser.add_argument("--model", default=None, help="hub id or local path instead of the preset's model")
    parser.add_argument("--dtype", nargs="+", choices=DTYPES, default=None,
                        help="one or more dtypes, each a separate run (default: the preset's: float32 for small, "
                             "float32 and bfloat16 for default, bfloat16 for gpu)")
    parser.add_argument("--workloads", type=_names((*WORKLOADS, RAG)), default=None,
                        help=f"comma-separated subset of {','.join(WORKLOADS)}; or {RAG} alone: documents "
                             "reused anywhere in the prompt (blended vs prefix reuse vs no cache, and the "
                             "fidelity of each recompute share) on the embedded default model")
    parser.add_argument("--systems", type=_names(SYSTEMS), default=None,
                        help=f"comma-separated subset of {','.join(SYSTEMS)} (default {','.join(DEFAULT_SYSTEMS)})")
    for name, (_, text) in _SIZE_FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=_positive, default=None,
                            help=f"{text} (default: from the preset)")
    parser.add_argument("--warmup-requests", type=_non_negative, default=0,
                        help="requests each system serves untimed before its timed run, caches kept "
                             "(SGLang bench_serving's warm-up; default 0: cold)")
    parser.add_argument("--threads", type=_positive, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random token content and order")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for results.{md,json,png}")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    parser.add_argument("--no-plot", dest="plot", action="store_false", help="skip the PNG plot")


def options_from_args(args: argparse.Namespace,
                      find_spec: Callable[[str], object | None] = importlib.util.find_spec) -> BenchOptions:
    """The options ``args`` describe; ``find_spec`` (injectable) tells whether a peer's packages are installed."""
    opts = _copy(PRESETS[args.preset])
    for name, (path, _) in _SIZE_FLAGS.items():
        value = getattr(args, name, None)
        if value is not None:
            _set_path(opts, path, value)
    if args.dtype:
        opts.dtypes = tuple(dict.fromkeys(args.dtype))
    if args.workloads:
        opts.workloads = args.workloads
    if args.systems:
        opts.systems = args.systems
    opts.model, opts.seed, opts.out, opts.threads = args.model, args.seed, args.out, args.threads
    opts.progress, opts.plot = args.progress, args.plot
    opts.warmup_requests = getattr(args, "warmup_requests", 0)
    if opts.shared.prompts < 2 and "shared-prefix" in opts.workloads:
        raise argparse.ArgumentTypeError("--prompts must be >= 2 for any reuse to happen")
    missing = [name for name in SERVING_PACKAGES if find_spec(name) is None]
    if "http-transformers-serve" in opts.systems and missing:
        raise argparse.ArgumentTypeError(f"http-transformers-serve runs `transformers serve`, which needs "
                                         f"{', '.join(missing)} (not installed): {INSTALL_EXTRA}")
    return opts


def describe(opts: BenchOptions) -> str:
    s, m, u = opts.shared, opts.multi, opts.unique
    return (f"preset={opts.preset} model={opts.model or opts.preset} dtypes={','.join(opts.dtypes)} "
            f"O={opts.output_tokens} seed={opts.seed}\n"
            f"  shared-prefix: G={s.groups} P={s.prompts} S={s.system_tokens} Q={s.question_tokens} "
            f"(ideal hit rate {s.ideal_hit_rate:.3f})\n"
            f"  multi-turn:    U={m.users} R={m.rounds} system={m.system_tokens} per-turn={m.question_tokens}\n"
            f"  no-reuse:      N={u.prompts} tokens={u.prompt_tokens}\n"
            f"  systems: {', '.join(opts.systems)}; workloads: {', '.join(opts.workloads)}\n"
            f"  generate-batch: max_batch_tokens={opts.cb_max_batch_tokens}, 256-token pages, pool sized to the "
            f"workload; prefixcache-batched and http-*: {opts.concurrency} concurrent clients"
            + (f"\n  warm-up: each system serves the first {opts.warmup_requests} session-opening request(s) untimed "
               f"before its timed run, caches kept" if opts.warmup_requests else ""))


def _copy(opts: BenchOptions) -> BenchOptions:
    return dataclasses.replace(opts, shared=dataclasses.replace(opts.shared), multi=dataclasses.replace(opts.multi),
                               unique=dataclasses.replace(opts.unique))


def _set_path(obj: object, path: str, value: object) -> None:
    *parents, leaf = path.split(".")
    for p in parents:
        obj = getattr(obj, p)
    setattr(obj, leaf, value)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def _names(allowed: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown {bad or text!r}; choose from {','.join(allowed)}")
        return names

    parse.__name__ = "list"
    return parse
