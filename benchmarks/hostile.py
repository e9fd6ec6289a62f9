"""The soak's hostile tenant: every hostile case the hardening work was built against, sent in a loop.

``run_hostile`` sends them from ``clients`` threads of this process; ``HostileProcess`` runs
that in a process of its own, as a hostile client elsewhere would be: its GIL and its work
building bodies are then not those of the client measuring the well-behaved tenant.
"""
from __future__ import annotations

import itertools
import multiprocessing
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

KEYS = {"sk-soak-good": "good", "sk-soak-evil": "evil"}
GOOD, EVIL, ADMIN = "sk-soak-good", "sk-soak-evil", "sk-soak-admin"
#: The hostile case that is not a single request: a stream left after 1-3 events.
DISCONNECT = "disconnect-mid-stream"


@dataclass(slots=True)
class Tally:
    """Outcomes of one phase's requests; ``lock`` guards every field."""

    statuses: Counter[str] = field(default_factory=Counter)
    hung: int = 0
    cases: Counter[str] = field(default_factory=Counter)  # "case status" -> requests (the hostile tenant's)
    ttft: list[float] = field(default_factory=list)
    headers: list[float] = field(default_factory=list)  # time to the response's headers (the stream opened)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def status(self, label: str | int, case: str | None = None) -> None:
        with self.lock:
            self.statuses[str(label)] += 1
            if case is not None:
                self.cases[f"{case} {label}"] += 1

    def timed_out(self, case: str | None = None) -> None:
        with self.lock:
            self.hung += 1
            if case is not None:
                self.cases[f"{case} hung"] += 1

    def merge(self, other: Tally) -> None:
        """Add ``other``'s outcomes (a finished phase's) to these."""
        with self.lock:
            self.statuses.update(other.statuses)
            self.cases.update(other.cases)
            self.hung += other.hung
            self.ttft += other.ttft
            self.headers += other.headers
            self.prompt_tokens += other.prompt_tokens
            self.cached_tokens += other.cached_tokens


def _chat(model: str, **extra: Any) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


def _raw(path: str, text: str | bytes, key: str = EVIL) -> dict:
    headers = {"content-type": "application/json", "authorization": f"Bearer {key}"}
    return {"method": "POST", "url": path, "content": text, "headers": headers}


def _chunked(size: int):
    piece = b'{"model": "m", "prompt": "' + b"x" * 65536
    sent = 0
    while sent < size:
        yield piece
        sent += len(piece)


def hostile_cases(model: str, context: int) -> dict[str, Callable[[int], dict]]:
    """Each hostile case: request ``i`` of it as ``httpx.Client.request`` keyword arguments."""
    chat, prewarm = "/v1/chat/completions", "/v1/cache/prewarm"
    return {
        "huge-prewarm": lambda i: {"method": "POST", "url": prewarm, "json": {"prompt": "word " * 300_000}},
        "prewarm-over-context": lambda i: {"method": "POST", "url": prewarm,
                                           "json": {"prompt": "word " * (context + 64)}},
        "20000-messages": lambda i: {"method": "POST", "url": chat,
                                     "json": {"model": model, "max_tokens": 4,
                                              "messages": [{"role": "user", "content": "a"}] * 20_000}},
        "long-stop-strings": lambda i: {"method": "POST", "url": chat,
                                        "json": _chat(model, stop=["x" * 40_000] * 4)},
        "oversized-chunked-body": lambda i: {"method": "POST", "url": chat, "content": _chunked(6 << 20),
                                             "headers": {"content-type": "application/json"}},
        "pin-without-ttl": lambda i: {"method": "POST", "url": prewarm,
                                      "json": {"prompt": f"Pinned policy {i}. " + "clause " * 300, "pin": True}},
        "seeded-sampled": lambda i: {"method": "POST", "url": chat,
                                     "json": _chat(model, temperature=1.0, seed=i, max_tokens=8)},
        "deep-json": lambda i: _raw(chat, "[" * 100_000 + "]" * 100_000),
        "huge-logit-bias": lambda i: {"method": "POST", "url": chat,
                                      "json": _chat(model, logit_bias={str(t): 1 for t in range(5000)})},
        "max-tokens-beyond-context": lambda i: {"method": "POST", "url": chat, "json": _chat(model, max_tokens=context * 4)},
        "number-too-large": lambda i: _raw(chat, '{"model": "%s", "messages": [], "max_tokens": %s}'
                                           % (model, "9" * 5000)),
        "float-overflow": lambda i: _raw(chat, '{"model": "%s", "messages": [{"role": "user", "content": "x"}], '
                                         '"max_tokens": 1e999}' % model),
        "unauthenticated-body": lambda i: _raw(chat, b'{"prompt": "' + b"x" * (2 << 20) + b'"}', key="sk-not-a-key"),
        "many-tools": lambda i: {"method": "POST", "url": chat, "json": _chat(model, tools=[
            {"type": "function", "function": {"name": f"f{k}", "parameters": {"type": "object"}}} for k in range(200)])},
    }


def hostile_request(client: httpx.Client, name: str, case: Callable[[int], dict], i: int, tally: Tally,
                    deadline: float) -> None:
    try:
        r = client.request(**case(i), timeout=deadline)
        tally.status(r.status_code, name)
    except httpx.TimeoutException:
        tally.timed_out(name)
    except httpx.TransportError:  # the server answered (413) and closed while the body was still going out
        tally.status("closed-while-sending", name)


def disconnect_mid_stream(client: httpx.Client, model: str, i: int, tally: Tally, deadline: float) -> None:
    body = _chat(model, stream=True, max_tokens=64, temperature=0,
                 messages=[{"role": "user", "content": f"Tell me a long story number {i}."}])
    try:
        with client.stream("POST", "/v1/chat/completions", json=body, timeout=deadline) as r:
            if r.status_code != 200:
                r.read()
                tally.status(r.status_code, DISCONNECT)
                return
            for n, _line in enumerate(r.iter_lines()):
                if n >= 1 + i % 3:
                    break  # leave: the response is closed unread
        tally.status("disconnected", DISCONNECT)
    except httpx.TimeoutException:
        tally.timed_out(DISCONNECT)


def case_names() -> list[str]:
    return [*hostile_cases("m", 8).keys(), DISCONNECT]


def run_hostile(url: str, model: str, context: int, requests: int, clients: int, deadline: float, seed: int,
                stop: Any, only: list[str] | None = None) -> Tally:
    """Send hostile requests from ``clients`` threads, cycling through the cases (``only``: these), until
    ``requests`` are sent and ``stop`` (an event) is set."""
    tally = Tally()
    cases = [(name, case) for name, case in hostile_cases(model, context).items() if not only or name in only]
    disconnect = not only or DISCONNECT in only
    kinds = len(cases) + disconnect
    if not kinds:
        raise ValueError(f"no hostile case among {only}; they are {case_names()}")
    counter = itertools.count()

    def worker() -> None:
        with httpx.Client(base_url=url, headers={"authorization": f"Bearer {EVIL}"}) as client:
            while (i := next(counter)) < requests or not stop.is_set():
                kind = (i * 7 + seed) % kinds
                if kind == len(cases):
                    disconnect_mid_stream(client, model, i, tally, deadline)
                else:
                    hostile_request(client, *cases[kind], i, tally, deadline)

    with ThreadPoolExecutor(clients, thread_name_prefix="prefixcache-bench-client") as pool:
        for f in [pool.submit(worker) for _ in range(clients)]:
            f.result()
    return tally


def _hostile_main(args: tuple, only: list[str] | None, stop: Any, out: Any) -> None:
    out.put("ready")
    started = time.process_time()
    tally = run_hostile(*args, stop=stop, only=only)
    out.put((dict(tally.statuses), tally.hung, dict(tally.cases), time.process_time() - started))


class HostileProcess:
    """``run_hostile`` in a process of its own (spawned: no state inherited from this one)."""

    def __init__(self, url: str, model: str, context: int, requests: int, clients: int, deadline: float,
                 seed: int, only: list[str] | None = None):
        ctx = multiprocessing.get_context("spawn")
        self.stop, self._out = ctx.Event(), ctx.Queue()
        self._deadline = deadline
        args = (url, model, context, requests, clients, deadline, seed)
        self._proc = ctx.Process(target=_hostile_main, args=(args, only, self.stop, self._out),
                                 name="soak-hostile", daemon=True)

    def start(self) -> None:
        self._proc.start()
        if self._out.get(timeout=120) != "ready":
            raise RuntimeError("the hostile process did not start")

    def result(self) -> tuple[Tally, float]:
        """Stop sending (after the requests asked for) and return the outcomes and the process's CPU seconds."""
        self.stop.set()
        try:
            statuses, hung, cases, cpu = self._out.get(timeout=self._deadline * 2 + 120)
        finally:
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.kill()
        return Tally(Counter(statuses), hung, Counter(cases)), cpu
