"""Test hooks on the batching engine's model step, so timing is arranged rather than hoped for.

``step_delay(seconds)``: every batched step sleeps first, a floor under its duration whatever
the CPU. Tests whose outcome needs requests in flight use it; ``PREFIXCACHE_TEST_STEP_DELAY``
(read by tests/conftest.py only, never by the package) adds it to every test, to show the
timing-dependent ones hold on a ~10x slower machine. A replica process gets it by running
``python -P tests/step_hooks.py SECONDS serve ...`` (``Fleet(cli=replica_cli(seconds))``).

``hold_until_cancelled(cache)``: a request that has its first token takes no further step
until it is cancelled (a timeout, a disconnect): it is mid-answer when that comes, on any machine.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prefixcache import PrefixCache
from prefixcache.serving.model_runner import ModelRunner

#: Seconds a held step waits for its request to be cancelled before it runs anyway (a test gone wrong).
HOLD_LIMIT = 30.0


@contextmanager
def step_delay(seconds: float) -> Iterator[None]:
    """Every ``ModelRunner.run`` (one batched forward) sleeps ``seconds`` first, inside the block."""
    if seconds <= 0:
        yield
        return
    run = ModelRunner.run

    def delayed(self: ModelRunner, plan):
        time.sleep(seconds)
        return run(self, plan)

    ModelRunner.run = delayed
    try:
        yield
    finally:
        ModelRunner.run = run


@contextmanager
def hold_until_cancelled(cache: PrefixCache) -> Iterator[None]:
    """Inside the block, a step of ``cache``'s batching engine whose requests have all begun their answer
    waits until one of them is cancelled (at most ``HOLD_LIMIT`` s), then runs."""
    runner = cache.batcher.runner
    run = runner.run

    def held(plan):
        deadline = time.monotonic() + HOLD_LIMIT
        while all(req.output for req, _ in plan) and not any(req.cancelled for req, _ in plan) \
                and time.monotonic() < deadline:
            time.sleep(0.005)
        return run(plan)

    runner.run = held
    try:
        yield
    finally:
        del runner.run  # the class's method again


def replica_cli(seconds: float) -> tuple[str, ...]:
    """The command a ``Fleet`` runs its replicas' CLI with: this file, each step ``seconds`` longer
    (``-P``: tests/ stays off ``sys.path``, where its packages would shadow top-level names)."""
    return (sys.executable, "-P", str(Path(__file__).resolve()), repr(float(seconds)))


if __name__ == "__main__":
    from prefixcache.cli import main

    with step_delay(float(sys.argv[1])):
        raise SystemExit(main(sys.argv[2:]))
