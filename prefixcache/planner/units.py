"""Parsing of the planner's sizes (``4GiB``, ``512blocks``) and durations (``5m``, ``1h``, ``none``)."""
from __future__ import annotations

import math
import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_BYTES = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SECONDS = {"": 1, "ms": 1e-3, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}


def parse_size(text: str, block_bytes: int) -> int:
    """Bytes of ``text``: a number with a unit (``B``, ``KB``…``TB``, ``KiB``…``TiB``) or ``Nblocks``."""
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or (unit not in _BYTES and unit not in ("block", "blocks")):
        raise ValueError(f"not a size: {text!r} (examples: 512MiB, 4GiB, 1.5GB, 2048blocks)")
    value = float(m.group(1))
    size = value * (block_bytes if unit in ("block", "blocks") else _BYTES[unit])
    if size < 1 or not math.isfinite(size):
        raise ValueError(f"a size must be at least 1 byte: {text!r}")
    return int(size)


def parse_duration(text: str) -> float | None:
    """Seconds of ``text`` (``90``, ``30s``, ``5m``, ``1h``, ``1d``); ``none`` means no TTL (None)."""
    if text.strip().lower() in ("none", "inf", "off"):
        return None
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SECONDS or float(m.group(1)) <= 0:
        raise ValueError(f"not a duration: {text!r} (examples: 30s, 5m, 1h, none)")
    return float(m.group(1)) * _SECONDS[unit]


def split_list(text: str) -> list[str]:
    items = [part.strip() for part in text.split(",")]
    if not all(items):
        raise ValueError(f"empty item in the list {text!r}")
    return items


def format_size(n: int | None) -> str:
    if n is None:
        return "unlimited"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n} B"


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "none"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"
