"""The request log: keyed hashes only, chained block keys, written by its thread, rotated by size."""
from __future__ import annotations

import json

from prefixcache.planner.request_log import KeyedHasher, RequestLog
from prefixcache.planner.trace import read_trace


def test_keys_chain_prefixes_and_depend_on_the_secret():
    h, other = KeyedHasher(b"secret"), KeyedHasher(b"another")
    a = h.chain(list(range(10)), 4)
    b = h.chain([*range(8), 99, 98, 97, 96], 4)
    assert len(a) == 2 and a[:2] == b[:2] and len(b) == 3  # equal prefixes, equal keys; full blocks only
    assert h.chain([*range(4), 5, 4, 6, 7], 4)[1] != a[1]  # one token differs: the key differs
    assert other.chain(list(range(10)), 4) != a and other.tenant("acme") != h.tenant("acme")


def test_lines_hold_no_token_ids_or_names_and_rotate(tmp_path):
    path = tmp_path / "requests.jsonl"
    log = RequestLog(path, block_tokens=4, kv_bytes_per_token=8, secret=b"s", max_bytes=1200, backups=20,
                     clock=iter(range(100, 1000)).__next__)
    prompt = [123456, 234567, 345678, 456789, 567891, 678912]
    for _ in range(30):
        log.record("acme-corp", prompt, [111111, 222222], cached_tokens=4, held_tokens=7)
    log.close()
    files = sorted(tmp_path.iterdir())
    assert len(files) > 2  # rotated by size
    text = "".join(f.read_text() for f in files)
    assert "acme" not in text and not any(str(t) in text for t in prompt + [111111, 222222])
    line = json.loads(path.read_text().splitlines()[0])
    assert line["held_tokens"] == 7 and len(line["blocks"]) == 1 and line["prompt_tokens"] == 6
    trace = read_trace(files, "prefixcache")  # rotated files together, in time order
    assert len(trace) == 30 and list(trace.ts) == sorted(trace.ts) and trace.match_blocks[0] == 1
