"""CUDA graphs: the ``step_graphs.Capture`` of CUDA devices."""
from __future__ import annotations

from collections.abc import Callable

import torch


class CudaGraphCapture:
    """Captures a step as a CUDA graph on ``device``. Every graph draws its memory from one pool:
    steps are replayed one at a time, and each replay's output is read before the next."""

    def __init__(self, device: torch.device):
        self.device = device
        self._pool = None

    def __call__(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device), torch.inference_mode():
            # Thread-local: a client thread touching the device meanwhile does not spoil the capture.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay
