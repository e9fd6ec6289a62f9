"""Traces: prefixcache request logs and Mooncake-format JSONL, read into one compact form.

Semantics shared by every format: a request is a chain of block ids (equal ids at equal
positions are equal prefixes); it may reuse its longest run of leading cached *full*
blocks, never its last prompt token (``match_blocks``); it then stores ``insert_blocks``
blocks: its prompt and, when the trace has them, its output (a trace without output ids
stores only the prompt's full blocks).

A bad line raises ``TraceError`` naming the file and line, unless ``skip_invalid``: then
it is counted in ``Trace.skipped``. A trace with no request is an error.
"""
from __future__ import annotations

import json
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMATS = ("prefixcache", "mooncake")
#: Mooncake's published traces use 512-token blocks.
MOONCAKE_BLOCK_TOKENS = 512
#: Fields of a prefixcache request-log line (``planner.request_log`` writes them).
LOG_FIELDS = ("ts", "tenant", "prompt_tokens", "cached_tokens", "output_tokens", "held_tokens", "block_tokens",
              "kv_bytes_per_token", "blocks")


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file and line."""


@dataclass(slots=True)
class Trace:
    """Requests in time order, columnar (a few bytes per block, no object per block)."""

    block_tokens: int
    kv_bytes_per_token: int | None  # known from a prefixcache log; a Mooncake trace does not say
    ts: array = field(default_factory=lambda: array("d"))  # seconds
    tenant: array = field(default_factory=lambda: array("l"))  # index into ``tenants``
    tenants: list[str] = field(default_factory=list)
    prompt_tokens: array = field(default_factory=lambda: array("q"))
    logged_cached: array = field(default_factory=lambda: array("q"))  # what the server reported; -1: unknown
    match_blocks: array = field(default_factory=lambda: array("l"))
    offsets: array = field(default_factory=lambda: array("q", [0]))  # blocks of request i: ids[offsets[i]:offsets[i+1]]
    ids: array = field(default_factory=lambda: array("q"))
    skipped: int = 0

    def __len__(self) -> int:
        return len(self.ts)

    def chain(self, i: int) -> array:
        return self.ids[self.offsets[i] : self.offsets[i + 1]]

    def add(self, ts: float, tenant: str, prompt_tokens: int, cached: int, ids: Sequence[int], match: int,
            tenant_index: dict[str, int]) -> None:
        t = tenant_index.get(tenant)
        if t is None:
            t = tenant_index[tenant] = len(self.tenants)
            self.tenants.append(tenant)
        self.ts.append(ts)
        self.tenant.append(t)
        self.prompt_tokens.append(prompt_tokens)
        self.logged_cached.append(cached)
        self.match_blocks.append(match)
        self.ids.extend(ids)
        self.offsets.append(len(self.ids))

    def sorted_by_time(self) -> Trace:
        """The same requests in time order (stable: equal times keep file order)."""
        order = sorted(range(len(self)), key=self.ts.__getitem__)
        if all(i == j for i, j in enumerate(order)):
            return self
        out = Trace(self.block_tokens, self.kv_bytes_per_token, tenants=self.tenants, skipped=self.skipped)
        for i in order:
            out.ts.append(self.ts[i])
            out.tenant.append(self.tenant[i])
            out.prompt_tokens.append(self.prompt_tokens[i])
            out.logged_cached.append(self.logged_cached[i])
            out.match_blocks.append(self.match_blocks[i])
            out.ids.extend(self.chain(i))
            out.offsets.append(len(out.ids))
        return out


def read_trace(paths: Sequence[str | Path], fmt: str, block_tokens: int | None = None,
               skip_invalid: bool = False) -> Trace:
    """Read one or more files of format ``fmt`` (rotated logs may be given together) in time order."""
    if fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if block_tokens is not None and block_tokens < 1:
        raise TraceError(f"--block-tokens must be >= 1, got {block_tokens}")
    trace: Trace | None = None
    index: dict[str, int] = {}
    skipped = 0
    for path in paths:
        for where, record in _records(Path(path)):
            try:
                if trace is None:
                    trace = _new_trace(fmt, record, block_tokens)
                parsed = (_mooncake if fmt == "mooncake" else _prefixcache)(record, trace)
            except (ValueError, TypeError, KeyError) as exc:
                if not skip_invalid:
                    raise TraceError(f"{where}: {exc}") from None
                skipped += 1
                continue
            trace.add(*parsed, tenant_index=index)
    if trace is None or len(trace) == 0:
        names = ", ".join(str(p) for p in paths)
        raise TraceError(f"{names}: no requests to replay" + (f" ({skipped} invalid lines skipped)" if skipped else ""))
    trace.skipped = skipped
    return trace.sorted_by_time()

def regroup(trace: Trace, factor: int) -> Trace:
    """The trace as a cache with blocks of ``factor`` times its own would see it.

    A block id names its whole prefix (chained), so the id of a group's last block names the group.
    """
    if factor == 1:
        return trace
    bt = trace.block_tokens * factor
    out = Trace(bt, trace.kv_bytes_per_token, tenants=trace.tenants, skipped=trace.skipped)
    for i in range(len(trace)):
        ids = trace.chain(i)[factor - 1 :: factor]
        out.ts.append(trace.ts[i])
        out.tenant.append(trace.tenant[i])
        out.prompt_tokens.append(trace.prompt_tokens[i])
        out.logged_cached.append(trace.logged_cached[i])
        out.match_blocks.append(min(len(ids), (trace.prompt_tokens[i] - 1) // bt))
        out.ids.extend(ids)
        out.offsets.append(len(out.ids))
    return out


def _records(path: Path) -> Iterator[tuple[str, Any]]:
    """(``file:line``, parsed JSON) for every non-blank line; a line that is not JSON is a TraceError."""
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror}") from None
    with handle:
        for number, raw in enumerate(handle, 1):
            if not raw.strip():
                continue
            where = f"{path}:{number}"
            try:
                yield where, json.loads(raw)
            except ValueError as exc:
                yield where, _Invalid(f"not a JSON object: {exc}")


class _Invalid:
    def __init__(self, reason: str):
        self.reason = reason


def _new_trace(fmt: str, record: Any, block_tokens: int | None) -> Trace:
    if fmt == "mooncake":
        return Trace(block_tokens or MOONCAKE_BLOCK_TOKENS, None)
    _object(record)
    logged = _int(record, "block_tokens", 1)
    if block_tokens is not None and block_tokens != logged:
        raise ValueError(f"the log's blocks are {logged} tokens, not --block-tokens {block_tokens}")
    return Trace(logged, _int(record, "kv_bytes_per_token", 1))


def _mooncake(record: Any, trace: Trace) -> tuple:
    _object(record)
    ts = _number(record, "timestamp") / 1000.0
    n_in = _int(record, "input_length", 1)
    _int(record, "output_length", 0)
    ids = record["hash_ids"]
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError("'hash_ids' must be a list of integers")
    bt = trace.block_tokens
    full, needed = n_in // bt, -(-n_in // bt)
    if not full <= len(ids) <= needed:
        raise ValueError(f"'hash_ids' has {len(ids)} ids; input_length {n_in} in {bt}-token blocks needs "
                         f"{needed}" + (f" (or {full})" if full != needed else ""))
    if any(not -2**63 <= i < 2**63 for i in ids):
        raise ValueError("'hash_ids' must fit in 64 bits")
    return ts, "", n_in, -1, ids[:full], (n_in - 1) // bt


def _prefixcache(record: Any, trace: Trace) -> tuple:
    _object(record)
    missing = [k for k in LOG_FIELDS if k not in record]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    ts = _number(record, "ts")
    tenant = record["tenant"]
    if not isinstance(tenant, str):
        raise ValueError("'tenant' must be a string")
    prompt = _int(record, "prompt_tokens", 1)
    cached = _int(record, "cached_tokens", 0)
    _int(record, "output_tokens", 0)
    held = _int(record, "held_tokens", 0)
    for name, want in (("block_tokens", trace.block_tokens), ("kv_bytes_per_token", trace.kv_bytes_per_token)):
        if _int(record, name, 1) != want:
            raise ValueError(f"'{name}' is {record[name]}, but earlier lines say {want}")
    keys = record["blocks"]
    if not isinstance(keys, list) or len(keys) != held // trace.block_tokens:
        raise ValueError(f"'blocks' must list one key per full block of held_tokens ({held // trace.block_tokens})")
    ids = [_key(k) for k in keys]
    return ts, tenant, prompt, cached, ids, min(len(ids), (prompt - 1) // trace.block_tokens)


def _key(text: Any) -> int:
    """A logged block key (16 hex digits) as a signed 64-bit id."""
    if not isinstance(text, str) or len(text) != 16:
        raise ValueError(f"block key {text!r} is not 16 hex digits")
    value = int(text, 16)
    return value - 2**64 if value >= 2**63 else value


def _object(record: Any) -> None:
    if isinstance(record, _Invalid):
        raise ValueError(record.reason)
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")


def _number(record: dict, name: str) -> float:
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < 0:
        raise ValueError(f"'{name}' must be a number >= 0, got {value!r}")
    return float(value)


def _int(record: dict, name: str, lo: int) -> int:
    if name not in record:
        raise ValueError(f"missing field '{name}'")
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"'{name}' must be an integer >= {lo}, got {value!r}")
    return value
