"""CPU worker threads of torch's parallel runtime, given back by a thread that goes idle.

torch runs a CPU operator on an OpenMP team of the calling thread: the first parallel operator a
thread runs starts ``torch.get_num_threads() - 1`` workers for it, kept as long as the thread lives.
GNU libgomp (the runtime torch's Linux wheels ship) counts the workers of every team, and once
teams' threads outnumber the CPUs it lets every worker spin only 100 times before sleeping at a
barrier instead of 300,000: each of the thousands of parallel regions of a forward then pays a
futex wake-up. So a thread that ran one forward and then merely waits (the batching loop between
requests, a server's worker thread after a serial call, the thread that built the cache) slows
every other thread's forwards for as long as it lives (docs/benchmarks.md: a quarter on a 2-core
machine). ``omp_pause_resource_all`` ends the calling thread's team; its next parallel operator
starts a new one (a thread start per worker).

``WorkerThreads.release`` does that where torch runs on libgomp, and nothing elsewhere (other
runtimes, or torch built with another parallel backend); it is called by a thread about to idle.
"""
from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

#: ``omp_pause_soft`` of ``omp_pause_resource_t`` (OpenMP 5.0); libgomp ends the calling thread's team for any kind.
OMP_PAUSE_SOFT = 1


class WorkerThreads:
    """``release()``: give back the calling thread's CPU worker threads (``pause``: the runtime's
    ``omp_pause_resource_all``; None: nothing to give back)."""

    def __init__(self, pause: Callable[[int], int] | None = None):
        self._pause = pause

    @classmethod
    def of_torch(cls, maps: Path = Path("/proc/self/maps")) -> WorkerThreads:
        """The runtime this process's torch runs CPU operators on, where it is libgomp (read from ``maps``)."""
        if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
            return cls()
        try:
            loaded = maps.read_text()
            pause = ctypes.CDLL(None).omp_pause_resource_all if "libgomp" in loaded else None
        except (OSError, AttributeError) as exc:  # no /proc (not Linux), or the symbol is not global
            log.debug("no OpenMP runtime to pause: %s", exc)
            return cls()
        if pause is None:
            return cls()
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        return cls(pause)

    @property
    def active(self) -> bool:
        """Whether ``release`` gives anything back in this process."""
        return self._pause is not None

    def release(self) -> None:
        """End the calling thread's worker team (outside a parallel region; a no-op if it has none)."""
        if self._pause is not None:
            self._pause(OMP_PAUSE_SOFT)
