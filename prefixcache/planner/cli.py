"""``prefixcache plan LOG_OR_TRACE``: hit rate against budget and TTL, from the operator's own traffic."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from prefixcache.planner.grid import run_grid
from prefixcache.planner.replay import Scenario
from prefixcache.planner.report import markdown, write
from prefixcache.planner.trace import FORMATS, MOONCAKE_BLOCK_TOKENS, Trace, TraceError, read_trace, regroup
from prefixcache.planner.units import parse_duration, parse_size, split_list

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", nargs="+", metavar="LOG_OR_TRACE",
                        help="a request log of `prefixcache serve --request-log` (rotated files may be given "
                             "together) or a Mooncake-format trace")
    parser.add_argument("--format", choices=FORMATS, default="prefixcache", help="trace format")
    parser.add_argument("--block-tokens", type=int, default=None, metavar="N",
                        help=f"tokens per trace block (a prefixcache log records its own; Mooncake: "
                             f"{MOONCAKE_BLOCK_TOKENS})")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--kv-bytes-per-token", type=int, default=None, metavar="B",
                      help="KV bytes of one token (a prefixcache log records the server's)")
    size.add_argument("--model", default=None, metavar="M",
                      help="hub id or folder of a model: bytes per token from its config (with --dtype)")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="float32", help="KV dtype, with --model")
    parser.add_argument("--budgets", required=True, metavar="SIZES",
                        help="comma-separated budgets: bytes with a unit (512MiB, 4GiB) or a block count (2048blocks)")
    parser.add_argument("--ttls", default="5m,1h,none", metavar="DURATIONS",
                        help="comma-separated TTLs (30s, 5m, 1h, none); default 5m,1h,none")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="write plan.md, plan.json and plan.png here")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the markdown table")
    parser.add_argument("--skip-invalid", action="store_true",
                        help="skip (and count) malformed lines instead of stopping at the first")
    what_if = parser.add_argument_group("what-if knobs (each maps to a real setting)")
    what_if.add_argument("--block-size", type=int, default=None, metavar="N",
                         help="replay as a cache of N-token blocks (block_size; a multiple of the trace's blocks)")
    what_if.add_argument("--tenant-quota", default=None, metavar="SIZE",
                         help="per-tenant byte quota (tenant_quota_bytes)")
    what_if.add_argument("--pin", action="append", default=[], metavar="[TENANT:]IDS",
                         help="pin a prefix before the first request, as an operator's prewarm with pin does: "
                              "comma-separated leading block ids (the log's block keys or Mooncake hash_ids); "
                              "repeatable")
    what_if.add_argument("--tier2-budget", default=None, metavar="SIZE",
                         help="a second tier of this size: blocks evicted for room move there; its hits are "
                              "reported apart")
    what_if.add_argument("--tier2-ttl", default="none", metavar="DURATION", help="TTL of the second tier")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (TraceError, ValueError, OSError) as exc:
        print(f"prefixcache plan: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    trace = read_trace(args.trace, args.format, args.block_tokens, args.skip_invalid)
    bpt = _bytes_per_token(args, trace)
    if args.block_size is not None:
        if args.block_size < 1 or args.block_size % trace.block_tokens:
            raise ValueError(f"--block-size must be a multiple of the trace's {trace.block_tokens}-token blocks")
        trace = regroup(trace, args.block_size // trace.block_tokens)
    block_bytes = trace.block_tokens * bpt
    budgets = [parse_size(s, block_bytes) for s in split_list(args.budgets)]
    ttls = list(dict.fromkeys(parse_duration(s) for s in split_list(args.ttls)))
    base = Scenario(None, None, bpt,
                    tenant_quota_bytes=None if args.tenant_quota is None else parse_size(args.tenant_quota, block_bytes),
                    pins=tuple(_pin(text, trace) for text in args.pin),
                    tier2_bytes=None if args.tier2_budget is None else parse_size(args.tier2_budget, block_bytes),
                    tier2_ttl_seconds=parse_duration(args.tier2_ttl))
    from tqdm import tqdm

    total = len(trace) * len(ttls) * (len(budgets) + 1)
    with tqdm(total=total, unit="req", desc="replaying", disable=None, file=sys.stderr) as bar:
        grid = run_grid(trace, budgets, ttls, base, bar.update)
    if args.out is not None:
        paths = write(grid, args.out)
        print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    print(json.dumps(grid.as_dict(), indent=2) if args.json else markdown(grid), end="" if not args.json else "\n")
    return 0


def _bytes_per_token(args: argparse.Namespace, trace: Trace) -> int:
    if args.kv_bytes_per_token is not None:
        if args.kv_bytes_per_token < 1:
            raise ValueError("--kv-bytes-per-token must be >= 1")
        return args.kv_bytes_per_token
    if args.model is not None:
        return model_bytes_per_token(args.model, DTYPE_BYTES[args.dtype])
    if trace.kv_bytes_per_token is None:
        raise ValueError("this trace does not record KV bytes per token: pass --kv-bytes-per-token or --model")
    return trace.kv_bytes_per_token


def model_bytes_per_token(model: str, dtype_bytes: int) -> int:
    """layers x (K and V) x KV heads x head dim x dtype bytes, from the model's config alone (no weights)."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(model).get_text_config(decoder=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the config of --model {model}: {exc}") from None
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return cfg.num_hidden_layers * 2 * kv_heads * head_dim * dtype_bytes


def _pin(text: str, trace: Trace) -> tuple[str, tuple[int, ...]]:
    tenant, sep, ids = text.rpartition(":")
    known = list(trace.tenants)
    if not sep:
        if len(known) > 1:  # a pin under no tenant of the log: no request could ever hit it
            raise ValueError(f"--pin {text!r}: the log has several tenants ({', '.join(known)}): write TENANT:IDS")
        tenant = known[0] if known else ""
    elif known and tenant not in known:
        raise ValueError(f"--pin {text!r}: no tenant {tenant!r} in the log (its tenants: {', '.join(known)})")
    try:
        values = tuple(int(i, 16) if trace.kv_bytes_per_token is not None else int(i) for i in split_list(ids))
    except ValueError:
        raise ValueError(f"--pin {text!r}: block ids must be comma-separated "
                         f"{'16-hex-digit keys' if trace.kv_bytes_per_token is not None else 'integers'}") from None
    values = tuple(v - 2**64 if v >= 2**63 else v for v in values)
    return tenant, values
