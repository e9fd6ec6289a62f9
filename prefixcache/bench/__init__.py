"""``prefixcache bench``: shared-prefix workloads, side by side with what users would pick instead.

Files follow the run: options (flags, presets) → workloads (seeded token streams) →
systems / batch (prefixcache, plain generate(), manual deepcopy reuse, transformers'
generate_batch, the bare-forward limit) → runner (one process, interleaved, checked)
→ metrics → report / plot. ``add_arguments`` and ``run`` are the command's interface.
"""
from __future__ import annotations

import argparse
import sys

from prefixcache.bench.options import RAG, BenchOptions, add_arguments, describe, options_from_args

__all__ = ["BenchOptions", "add_arguments", "run"]


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args`` (from ``add_arguments``); return an exit code.

    0 = done; 1 = a correctness check failed (prefixcache differed from generate()) or a
    system failed; 2 = bad options.
    """
    from prefixcache.bench import report, runner

    if args.preset == "gpu":
        from prefixcache.bench import gpu

        if args.shape is not None and args.shape not in gpu.SHAPES:
            print(f"prefixcache bench: --shape must be one of {', '.join(gpu.SHAPES)}", file=sys.stderr)
            return 2
        try:
            gpu.run_gpu(gpu.spec_from(args.shape, args.dtype, args.seed), args.out)
        except RuntimeError as exc:
            print(f"\nprefixcache bench: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.workloads and RAG in args.workloads:
        return _run_rag(args)
    try:
        opts = options_from_args(args)
    except argparse.ArgumentTypeError as exc:
        print(f"prefixcache bench: {exc}", file=sys.stderr)
        return 2
    print(describe(opts), flush=True)
    bar = _progress_bar(runner.total_steps(opts), opts.progress)
    try:
        result = runner.run_benchmark(opts, bar.update)
    except runner.CorrectnessError as exc:
        print(f"\nprefixcache bench: CORRECTNESS CHECK FAILED — {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        print(f"\nprefixcache bench: a system failed: {exc}", file=sys.stderr)
        return 1
    finally:
        bar.close()
    paths = report.write(result, opts.out, plot=opts.plot)
    print(report.markdown(result))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _run_rag(args: argparse.Namespace) -> int:
    from prefixcache.bench import rag

    if args.workloads != (RAG,):
        print(f"prefixcache bench: the {RAG} workload runs on its own (--workloads {RAG})", file=sys.stderr)
        return 2
    result = rag.run_rag(rag.RagSpec(seed=args.seed), args.out,
                         progress=lambda line: print(line, file=sys.stderr, flush=True) if args.progress else None)
    print(rag.markdown(result))
    print(f"wrote {args.out / 'rag.md'}, {args.out / 'rag.json'}")
    return 0


def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", disable=not enabled, file=sys.stderr, dynamic_ncols=True)
