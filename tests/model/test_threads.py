"""A thread about to idle gives its CPU worker threads back (``model/threads.py``), engines' threads included.

Observed through the process's OS threads (``/proc/self/task``): a parallel operator starts
workers for the thread that runs it, and a release ends them. Nothing here is timed.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from prefixcache.model.threads import WorkerThreads

RUNTIME = WorkerThreads.of_torch()
needs_libgomp = pytest.mark.skipif(not RUNTIME.active, reason="torch here does not run CPU operators on libgomp")
#: How long an ended worker may take to leave ``/proc/self/task`` (it exits after the release returns).
EXIT_GRACE = 10.0


def tasks() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def workers(base: set[int]) -> set[int]:
    """OS threads started since ``base`` that are no Python thread: CPU workers."""
    return tasks() - base - {t.native_id for t in threading.enumerate()}


def settled(base: set[int]) -> set[int]:
    """``workers(base)`` once none is left, or what is still left after ``EXIT_GRACE`` seconds."""
    deadline = time.monotonic() + EXIT_GRACE
    while (left := workers(base)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def parallel_operator() -> None:
    torch.ones(1 << 22).mul_(2)  # millions of elements: split over the thread's workers


@pytest.fixture
def two_threads():
    """Two torch threads (so a parallel operator has a worker) while the test runs."""
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(1)


def test_the_runtime_is_found_only_where_torch_runs_on_libgomp(tmp_path: Path):
    elsewhere = tmp_path / "maps"
    elsewhere.write_text("7f00-7f01 r-xp 00000000 00:00 0 /usr/lib/libomp.so\n")
    other = WorkerThreads.of_torch(maps=elsewhere)
    assert not other.active
    other.release()  # nothing to give back: a no-op
    assert not WorkerThreads().active
    if "parallel backend: OpenMP" in torch.__config__.parallel_info() and "libgomp" in Path("/proc/self/maps").read_text():
        assert RUNTIME.active


@needs_libgomp
def test_a_release_ends_the_calling_threads_workers_and_the_next_operator_starts_them_again(two_threads):
    seen: dict[str, set[int]] = {}

    def run() -> None:
        torch.set_num_threads(2)
        base = tasks()
        parallel_operator()
        seen["started"] = workers(base)
        RUNTIME.release()
        seen["left"] = settled(base)
        parallel_operator()  # a new team: the thread computes as before
        seen["again"] = workers(base)
        RUNTIME.release()
        seen["finally"] = settled(base)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen["started"], "a parallel operator on two threads started no worker"
    assert seen["left"] == set() and seen["finally"] == set()
    assert seen["again"]


@needs_libgomp
@pytest.mark.parametrize("batching", [True, False], ids=["batching", "serial"])
def test_after_a_call_neither_the_caller_nor_the_engine_keeps_workers(llama, new_cache, two_threads, batching):
    """A caller thread that stays alive, as a server's worker does: it builds the cache and calls it."""
    base = tasks()
    called, checked = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def caller() -> None:
        try:
            torch.set_num_threads(2)
            cache = new_cache(llama, batching=batching, start_sweeper=False)
            seen["out"] = cache.generate(torch.randint(5, 200, (1, 300)), max_new_tokens=3, do_sample=False)
            seen["executor"] = cache.last_call.executor
        finally:
            called.set()
            checked.wait(EXIT_GRACE * 2)

    thread = threading.Thread(target=caller)
    thread.start()
    try:
        assert called.wait(120)
        assert seen["executor"] == ("batched" if batching else "serial") and seen["out"].shape[1] == 303
        # The caller's team (it built the cache, ran the call) and the batching loop's (idle now) are gone.
        assert settled(base) == set()
    finally:
        checked.set()
        thread.join()
